"""Layer 4, the model: `CausalModel` (a Qwen backbone + the causal heads of one or several adapters) and
`get_causal_model`, built on the model's math (modeling/) and its files (saving/)."""
from .causal_model import CausalModel, CausalOutput, get_causal_model

__all__ = ["CausalModel", "CausalOutput", "get_causal_model"]
