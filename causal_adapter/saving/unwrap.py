"""The CausalModel inside the wrappers that training puts around it (DDP, FSDP, torch.compile,
accelerate's autocast forward)."""
from __future__ import annotations

from typing import Any


def _is_causal_model(model: Any) -> bool:
    # asked of the class: FSDP1's root forwards unknown attributes to the module it wraps, so the
    # instance of the wrapper would answer for the CausalModel inside
    return hasattr(type(model), "adapter_state_dict")


def unwrap_model(model: Any):
    """The CausalModel under DDP / FSDP1 / accelerate wrappers (their ``.module``); `model` itself when it
    is not wrapped."""
    while not _is_causal_model(model) and hasattr(model, "module"):
        model = model.module
    return model


def unwrap_causal_model(model: Any):
    """The CausalModel inside DDP / FSDP / compile / accelerate wrappers, or None."""
    seen = 0
    while model is not None and not _is_causal_model(model) and seen < 8:
        model = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        seen += 1
    return model if _is_causal_model(model) else None
