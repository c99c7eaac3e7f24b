"""A submitted generation as the protocol modules see it: when it started, then its parts as they come."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from .request import Generation, RequestError
from .tool_calls import AnswerParts, ToolCall
from .worker import Failed, Finished, Started, Text


@dataclass
class Done:
    """How a generation ended: the worker's Finished, and whether it called tools."""

    finished: Finished
    called_tools: bool


@dataclass
class Run:
    gen: Generation
    started: Started
    events: AsyncIterator  # the worker's Text / Finished / Failed events after Started
    forced: str = ""  # the forced opening of the answer (tool_choice), already in the prompt
    created: int = field(default_factory=lambda: int(time.time()))

    async def parts(self) -> AsyncIterator[str | ToolCall | Done]:
        """Text and tool calls in order, then one Done. A failure mid-way raises RequestError."""
        answer, calls = AnswerParts(self.gen.parses_tools, self.forced), 0
        async for event in self.events:
            if isinstance(event, Text):
                for part in answer.push(event.text):
                    calls += isinstance(part, ToolCall)
                    yield part
            elif isinstance(event, Finished):
                for part in answer.finish(cut_short=event.reason == "length"):
                    calls += isinstance(part, ToolCall)
                    yield part
                yield Done(event, calls > 0)
                return
            elif isinstance(event, Failed):
                raise event.error
        raise RequestError("the generation ended without finishing", status=500, kind="engine")

    async def collect(self) -> tuple[str, list[ToolCall], Done]:
        text, calls, done = [], [], None
        async for part in self.parts():
            if isinstance(part, Done):
                done = part
            elif isinstance(part, ToolCall):
                calls.append(part)
            else:
                text.append(part)
        return "".join(text), calls, done
