"""One module per Hugging Face model_type; MODELS maps model_type to its model class."""

from .qwen3_moe import Qwen3Moe
from .qwen3_next import Qwen3Next

MODELS = {"qwen3_moe": Qwen3Moe, "qwen3_next": Qwen3Next, "qwen3_5_moe": Qwen3Next}
