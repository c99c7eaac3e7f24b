"""One module per Hugging Face model_type; MODELS maps model_type to its model class."""

from .qwen3_moe import Qwen3Moe

MODELS = {"qwen3_moe": Qwen3Moe}
