"""`mosaic serve`: one local HTTP server speaking the OpenAI and Anthropic protocols, with a web chat.

app.py routes and guards requests; openai_api.py and anthropic_api.py turn each protocol's bodies into a
Generation and its events back into that protocol's responses; worker.py runs generations one at a time on
the engine; fleet.py knows the models and keeps one resident; tool_calls.py finds tool calls in the output.
"""
