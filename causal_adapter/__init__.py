"""causal_adapter: turn a Qwen checkpoint into a causal language model, PEFT-style."""
from ._version import __version__
from .config import CausalAdapterConfig, LoraSettings
from .modeling.verify import verify_initialization
from .numbers import NumberTokenizer, find_numbers, format_number
from .model import CausalModel, CausalOutput, get_causal_model

__all__ = [
    "CausalAdapterConfig",
    "LoraSettings",
    "CausalModel",
    "CausalOutput",
    "get_causal_model",
    "verify_initialization",
    "NumberTokenizer",
    "find_numbers",
    "format_number",
    "__version__",
]
