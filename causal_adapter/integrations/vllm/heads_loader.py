"""Our heads inside a vLLM model: a `CausalModel` on a backbone of meta tensors (the base's architecture, no weights),
its adapter modules (numeric embedding, abduction and action heads) materialised and loaded from the exported folder.

vLLM owns the backbone's real weights (its own Qwen2 / Qwen3 classes); the heads run on its hidden states z and its
lm_head weight, through the very code `generate` and `predict` run (embed, abduction, action, `prediction_rows`).
No vLLM import here.
"""
from __future__ import annotations

import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ...model import get_causal_model
from ...model.causal_model import CausalModel
from ...saving.adapter_io import HEAD_MODULES, adapter_config_for
from ...saving.peft_lora import LORA_PREFIX
from .folder import read_heads


def load_heads(folder: str | os.PathLike, dtype: torch.dtype, device: torch.device | str) -> CausalModel:
    """The adapter of the exported `folder` on a meta backbone built from the folder's config.json in `dtype`; the
    head modules on `device`. Refuses an adapter made for another base (family, hidden size, vocabulary), naming
    both (`adapter_config_for`), and a missing or corrupted heads file (`read_heads`)."""
    meta, tensors = read_heads(folder)
    # a LoRA adapter: vLLM applies its LoRA (OUT/lora, vLLM's LoRA support) to its own backbone; the heads here run
    # on vLLM's hidden states, so they are built without LoRA (older adapters keep LoRA tensors in this file too)
    meta = {**meta, "adapter_config": {**meta["adapter_config"], "lora": None}}
    tensors = {k: v for k, v in tensors.items() if not k.startswith(LORA_PREFIX)}
    config = AutoConfig.from_pretrained(str(folder))
    config.architectures = None  # ours, which transformers does not know; the family's class is built
    with torch.device("meta"):
        backbone = AutoModelForCausalLM.from_config(config, dtype=dtype)
    adapter_cfg = adapter_config_for(backbone, meta, folder)
    model = get_causal_model(backbone, adapter_cfg)
    for name in HEAD_MODULES:  # built on the meta backbone's device: given storage on vLLM's
        getattr(model, name).to_empty(device=device)
    model.load_adapter_state_dict(tensors)
    model.requires_grad_(False)
    return model.eval()
