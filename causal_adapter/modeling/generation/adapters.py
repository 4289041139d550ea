"""Rows of several adapters in one backbone pass (peft's mixed batch): each row's embedding phi its own adapter's
(`embed_rows`), and every peft LoRA layer running each row's own adapter (`lora_rows`: the `adapter_names` argument of
peft's layers, passed by a forward pre-hook for the duration of one backbone call)."""
from __future__ import annotations

import contextlib
import sys

import torch
from torch import Tensor


def use_adapter(model, adapter: str | None) -> None:
    """Make `adapter` the active one (None: the model as it is)."""
    if adapter is not None and model.active_adapter != adapter:
        model.set_adapter(adapter)


def embed_rows(model, names: list[str | None], ids: Tensor, values: Tensor) -> Tensor:
    """inputs_embeds [B, s, H] of ids / values [B, s], each row with its adapter's phi (`names`: one per row). The
    adapters are taken last to first: the heads then run first to last, so each switch of adapter is made once."""
    order = list(dict.fromkeys(names))
    if len(order) == 1:
        use_adapter(model, order[0])
        return model.embed(ids, values)
    embeds = None
    for a in reversed(order):
        use_adapter(model, a)
        at = torch.tensor([i for i, n in enumerate(names) if n == a], device=ids.device)
        e = model.embed(ids[at], values[at])
        if embeds is None:
            embeds = e.new_empty(ids.shape + e.shape[-1:])
        embeds[at.to(e.device)] = e
    return embeds


def tuner_layers(model) -> list:
    """peft's LoRA layers in the backbone ([] without peft)."""
    if "peft" not in sys.modules:
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.backbone.modules() if isinstance(m, BaseTunerLayer)]


def lora_rows(layers: list, names: list[str | None]):
    """A context in which every layer of `layers` runs row i with adapter names[i] (nothing to do for one adapter)."""
    if len(set(names)) < 2 or not layers:
        return contextlib.nullcontext()
    return _pass_adapter_names(layers, names)


@contextlib.contextmanager
def _pass_adapter_names(layers: list, names: list[str | None]):
    def pass_names(module, args, kwargs):
        return args, {**kwargs, "adapter_names": names}

    hooks = [m.register_forward_pre_hook(pass_names, with_kwargs=True) for m in layers]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
