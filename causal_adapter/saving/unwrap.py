"""The CausalModel inside the wrappers that training puts around it (DDP, FSDP, torch.compile,
accelerate's autocast forward)."""
from __future__ import annotations

from typing import Any


def unwrap_model(model: Any):
    """The CausalModel under DDP / accelerate wrappers (their ``.module``); `model` itself when it
    is not wrapped."""
    while not hasattr(model, "adapter_state_dict") and hasattr(model, "module"):
        model = model.module
    return model


def unwrap_causal_model(model: Any):
    """The CausalModel inside DDP / FSDP / compile / accelerate wrappers, or None."""
    seen = 0
    while model is not None and not hasattr(model, "adapter_state_dict") and seen < 8:
        model = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        seen += 1
    return model if hasattr(model, "adapter_state_dict") else None
