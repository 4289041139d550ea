"""peft's view of a LoRA backbone: peft's adapter files (`adapter_config.json` +
`adapter_model.safetensors`, the LoRA tensors only, so `peft.PeftModel.from_pretrained(base, dir)` and
serving stacks that read peft LoRA directories can use them) and peft's layer methods behind
`CausalModel.merge_and_unload`, `unload` and `disable_adapter` (`merge`, `get_base_layer`,
`enable_adapters`). A frozen-backbone adapter has no file under peft's names."""
from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

PEFT_CONFIG_NAME = "adapter_config.json"  # peft's file names (peft's schema only)
PEFT_WEIGHTS_NAME = "adapter_model.safetensors"
#: the prefix of the LoRA tensors' names in `CausalModel.adapter_state_dict`
LORA_PREFIX = "lora."
_PEFT_KEY_PREFIX = "base_model.model."


def _lora_tuner_layers(backbone: nn.Module) -> list[tuple[str, nn.Module]]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [(n, m) for n, m in backbone.named_modules() if isinstance(m, BaseTunerLayer)]


def peft_lora_config(model):
    """The peft `LoraConfig` equivalent to the model's LoRA (task CAUSAL_LM, base = the backbone's name)."""
    from peft import LoraConfig

    s = model.causal_config.lora
    base = getattr(model.backbone, "name_or_path", None) or getattr(model.backbone.config, "_name_or_path", None)
    return LoraConfig(r=s.r, lora_alpha=s.alpha, lora_dropout=s.dropout, target_modules=list(s.target_modules),
                      task_type="CAUSAL_LM", base_model_name_or_path=base or None)


def write_peft_lora(directory: Path, model, lora: dict | None = None) -> None:
    """peft's adapter_config.json + adapter_model.safetensors with the LoRA tensors under peft's key
    names (``base_model.model.<backbone module>.lora_A.weight``), as `PeftModel.save_pretrained` writes them.
    lora: peft's state dict of the backbone already gathered (FSDP), else read from the model."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    if not lora:
        lora = get_peft_model_state_dict(model.backbone, adapter_name=model.active_adapter, save_embedding_layers=False)
    tensors = {f"base_model.model.{k}": v.detach().contiguous().cpu() for k, v in lora.items()}
    save_file(tensors, str(directory / PEFT_WEIGHTS_NAME), metadata={"format": "pt"})
    peft_lora_config(model).save_pretrained(str(directory))


def read_peft_lora(path: Path) -> dict[str, torch.Tensor]:
    """The LoRA tensors of peft's weights file, under `CausalModel.adapter_state_dict`'s names
    (``lora.<backbone module>.lora_A.weight``)."""
    from safetensors.torch import load_file  # safetensors: a dependency of transformers, lazy as in write_peft_lora

    return {LORA_PREFIX + k[len(_PEFT_KEY_PREFIX):]: v for k, v in load_file(str(path)).items()
            if k.startswith(_PEFT_KEY_PREFIX) and "lora_" in k}


def merge_lora(model, merge: bool = True, safe_merge: bool = True):
    """Replace every peft LoRA layer of the backbone by its base layer, merged (`merge=True`, peft's
    `merge`) or untouched; the model's config then has no LoRA. In place; returns the model."""
    if len(model.adapter_names) > 1:
        raise ValueError(f"this CausalModel holds several adapters {model.adapter_names}: delete_adapter the others "
                         f"before {'merging' if merge else 'unloading'} the LoRA of {model.active_adapter!r}")
    if model.causal_config.lora is None:
        raise ValueError("this CausalModel has a frozen backbone (config.lora is None): there is no LoRA to "
                         f"{'merge' if merge else 'unload'}")
    for name, layer in _lora_tuner_layers(model.backbone):
        if merge:
            layer.merge(safe_merge=safe_merge)
        parent_name, _, child = name.rpartition(".")
        parent = model.backbone.get_submodule(parent_name) if parent_name else model.backbone
        setattr(parent, child, layer.get_base_layer())
    if hasattr(model.backbone, "peft_config"):
        del model.backbone.peft_config
    for p in model.backbone.parameters():
        p.requires_grad_(False)
    model.causal_config = dataclasses.replace(model.causal_config, lora=None)
    model.lora_merged = merge
    return model


@contextlib.contextmanager
def disable_lora(model) -> Iterator[None]:
    """Inside: the backbone runs without its LoRA (= the base model); the heads stay. No-op without LoRA."""
    layers = [m for _, m in _lora_tuner_layers(model.backbone)]
    grads = {p: p.requires_grad for m in layers for p in m.parameters()}
    was = [m.disable_adapters for m in layers]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m, disabled in zip(layers, was):
            m.enable_adapters(not disabled)
        for p, g in grads.items():
            p.requires_grad_(g)
