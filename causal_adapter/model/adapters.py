"""Several adapters on one base, with peft's names (`load_adapter`, `set_adapter`, `delete_adapter`,
`active_adapter`).

The active adapter's parts are the CausalModel's own attributes (`causal_config`, `numeric_embedding`,
`abduction`, `action`), so the forward, the losses, saving and training see one adapter as before. The
others are parked in `model.parked_adapters[name]` (registered modules: they move with `.to()`, frozen while
parked) with their configs in `model._parked_configs`. LoRA goes through peft's multi-adapter layers: each
adapter's LoRA is a peft adapter of the same name in the shared backbone, and `set_adapter` makes peft run that
one only (a frozen-backbone adapter: none). So N adapters cost one base plus N adapters' tensors.
"""
from __future__ import annotations

import os
import re

from torch import nn

from ..modeling.families import resolve_lora_settings
from ..saving import adapter_io
from ..saving.adapter_io import HEAD_MODULES

DEFAULT_ADAPTER = "default"  # peft's name of the first adapter
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_\-:@+]*")


def check_adapter_name(name: str) -> None:
    """A name peft can key modules by (no dots, no spaces)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"adapter name {name!r}: use letters, digits and _ - : @ + (no dots or spaces), "
                         "starting with a letter, digit or _")


def _lora_params(model, name: str) -> list[nn.Parameter]:
    """The parameters of peft adapter `name` in the backbone (lora_A.<name>.weight, ...)."""
    return [p for n, p in model.backbone.named_parameters() if f".{name}." in f".{n}." and "lora_" in n]


def _set_peft_active(model, name: str, trainable: bool) -> None:
    """peft's layers run adapter `name` only (an adapter without LoRA: none of them); its LoRA trainable or not."""
    from peft.functional import set_adapter
    from peft.tuners.tuners_utils import BaseTunerLayer

    if any(isinstance(m, BaseTunerLayer) for m in model.backbone.modules()):
        set_adapter(model.backbone, name, inference_mode=not trainable)


def _park_active(model) -> None:
    """Move the active adapter's heads and config aside (frozen, their trainable flags kept on the modules as
    `_trainable`), leaving no active adapter: the caller activates another one next."""
    name = model.active_adapter
    heads = nn.ModuleDict({k: getattr(model, k) for k in HEAD_MODULES})
    heads._trainable = {n: p.requires_grad for n, p in heads.named_parameters()}
    heads._lora_trainable = any(p.requires_grad for p in _lora_params(model, name))
    heads.requires_grad_(False)
    for k in HEAD_MODULES:
        delattr(model, k)
    model.parked_adapters[name] = heads
    model._parked_configs[name] = model.causal_config


def _activate_parked(model, name: str) -> None:
    heads = model.parked_adapters[name]
    del model.parked_adapters[name]
    for n, p in heads.named_parameters():
        p.requires_grad_(heads._trainable.get(n, False))
    for k in HEAD_MODULES:
        module = heads[k]
        module.train(model.training)
        setattr(model, k, module)
    model.causal_config = model._parked_configs.pop(name)
    model._active_adapter = name
    _set_peft_active(model, name, heads._lora_trainable)


def _check_loaded(model, name: str) -> None:
    if name not in model.adapter_names:
        raise ValueError(f"no adapter named {name!r} is loaded; loaded: {model.adapter_names}")


def set_adapter(model, name: str) -> None:
    """`CausalModel.set_adapter`."""
    _check_loaded(model, name)
    if name == model.active_adapter:
        return
    _park_active(model)
    _activate_parked(model, name)


def load_adapter(model, adapter_dir: str | os.PathLike, name: str, tokenizer=None, *, is_trainable: bool = False,
                 **hub_kwargs) -> None:
    """`CausalModel.load_adapter`: read and check the adapter, build its heads (and LoRA) as the active adapter for
    a moment, load its tensors, park it, and reactivate the adapter that was active. On failure nothing changes."""
    check_adapter_name(name)
    if name in model.adapter_names:
        raise ValueError(f"an adapter named {name!r} is already loaded: delete_adapter({name!r}) first, or pick "
                         "another name")
    _, config, tensors = adapter_io.open_adapter(model.backbone, adapter_dir, tokenizer,
                                                 num_token_id=model.num_token_id, **hub_kwargs)
    config = resolve_lora_settings(model.backbone, config)  # saved configs hold resolved targets: kept as they are
    previous = model.active_adapter
    lora_was = {p: p.requires_grad for p in model.backbone.parameters()}
    _park_active(model)
    try:
        model.add_adapter_heads(config, name)
        model.load_adapter_state_dict(tensors)
        if not is_trainable:
            for k in HEAD_MODULES:
                getattr(model, k).requires_grad_(False)
            for p in _lora_params(model, name):
                p.requires_grad_(False)
    except BaseException:
        _drop_active(model)
        _activate_parked(model, previous)
        for p, g in lora_was.items():
            p.requires_grad_(g)
        raise
    _park_active(model)
    _activate_parked(model, previous)


def _drop_active(model) -> None:
    """Remove the active adapter entirely (heads, config, LoRA); leaves no active adapter."""
    name = model.active_adapter
    for k in HEAD_MODULES:
        if hasattr(model, k):
            delattr(model, k)
    _delete_lora(model, name)
    model._adapter_order.remove(name)


def _delete_lora(model, name: str) -> None:
    from peft.functional import delete_adapter
    from peft.tuners.tuners_utils import BaseTunerLayer

    if any(isinstance(m, BaseTunerLayer) and name in getattr(m, "lora_A", {}) for m in model.backbone.modules()):
        delete_adapter(model.backbone, name, prefix="lora_")
    getattr(model.backbone, "peft_config", {}).pop(name, None)


def delete_adapter(model, name: str) -> None:
    """`CausalModel.delete_adapter`."""
    _check_loaded(model, name)
    if len(model.adapter_names) == 1:
        raise ValueError(f"{name!r} is the only adapter of this model: it cannot be deleted (load another first)")
    if name == model.active_adapter:
        _drop_active(model)
        _activate_parked(model, model.adapter_names[0])
        return
    del model.parked_adapters[name]
    model._parked_configs.pop(name)
    model._adapter_order.remove(name)
    _delete_lora(model, name)
    heads_active = model.active_adapter
    _set_peft_active(model, heads_active, any(p.requires_grad for p in _lora_params(model, heads_active)))
