"""An adapter directory as the rest of the package reads and writes it: the code behind
`CausalModel.save_pretrained` / `from_pretrained` / `load_adapter` (the adapter's tensors and metadata, the
directory written atomically, a saved adapter opened against a base with every compatibility check), the
extra files (the model card, peft's files), every adapter tensor read back (LoRA from peft's file), strict
loading into a model, and saving into a directory that holds other files (a Trainer output directory, an
accelerate state directory). The model is taken as it comes (duck typed): this layer sits below it."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .._version import __version__
from ..config import CausalAdapterConfig
from ..modeling.families import family_name, text_config
from .artifacts import CONFIG_NAME, FORMAT_VERSION, atomic_write_dir, read_adapter_files, write_adapter_files
from .hub import load_base_model, push_to_hub, resolve_adapter_source
from .model_card import MODEL_CARD_NAME, model_card
from .peft_lora import LORA_PREFIX, PEFT_CONFIG_NAME, PEFT_WEIGHTS_NAME, read_peft_lora, write_peft_lora

HEAD_MODULES = ("numeric_embedding", "abduction", "action")  # the adapter's own modules on a CausalModel


# ----------------------------------------------------------------------------- the adapter's tensors
def adapter_state_dict(model, lora: bool = True) -> dict[str, Tensor]:
    """Only the active adapter's tensors: heads, d, b_cls, the <NUM> row, fixed buffers, LoRA (`lora=False`:
    without it, for a wrapper that gathers the LoRA itself: `saving.fsdp`)."""
    state = {}
    for name in HEAD_MODULES:
        for k, v in getattr(model, name).state_dict().items():
            state[f"{name}.{k}"] = v
    if lora and model.causal_config.lora is not None:
        from peft import get_peft_model_state_dict

        tensors = get_peft_model_state_dict(model.backbone, adapter_name=model.active_adapter,
                                            save_embedding_layers=False)
        state.update({LORA_PREFIX + k: v for k, v in tensors.items()})
    return state


def load_adapter_state_dict(model, state: dict[str, Tensor]) -> None:
    """Into the active adapter, strictly: every adapter tensor must be present with its shape; nothing else may be."""
    expected = adapter_state_dict(model)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"adapter tensors do not match this model: missing {missing[:8]}, unexpected {unexpected[:8]}")
    # adapters written before the 1-element scalars (b_reg, b_noise_Y, a scalar threshold) hold them 0-d
    state = {k: t.reshape(1) if t.dim() == 0 and expected[k].shape == (1,) else t for k, t in state.items()}
    for k, v in expected.items():
        if state[k].shape != v.shape:
            raise ValueError(f"adapter tensor {k!r} has shape {tuple(state[k].shape)}, the model expects {tuple(v.shape)}")
    heads = {k: v for k, v in state.items() if not k.startswith(LORA_PREFIX)}
    with torch.no_grad():
        for name in HEAD_MODULES:
            sub = {k[len(name) + 1:]: v for k, v in heads.items() if k.startswith(name + ".")}
            getattr(model, name).load_state_dict(sub, strict=True)
    if model.causal_config.lora is not None:
        from peft import set_peft_model_state_dict

        lora = {k[len(LORA_PREFIX):]: v for k, v in state.items() if k.startswith(LORA_PREFIX)}
        result = set_peft_model_state_dict(model.backbone, lora, adapter_name=model.active_adapter)
        bad = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
        if bad:
            raise ValueError(f"LoRA tensors not found in the backbone: {bad[:8]}")


# ----------------------------------------------------------------------------- save_pretrained
def adapter_metadata(model) -> dict[str, Any]:
    """What causal_adapter_config.json records besides the tensors: the active adapter's config and the base it fits."""
    bc = model.backbone.config
    return {
        "format_version": FORMAT_VERSION,
        "library": "causal_adapter",
        "library_version": __version__,
        "adapter_config": model.causal_config.to_dict(),
        "base_model_name_or_path": getattr(model.backbone, "name_or_path", None) or getattr(bc, "_name_or_path", None),
        "model_type": family_name(model.backbone),
        "hidden_size": text_config(model.backbone).hidden_size,
        "vocab_size": model.vocab_size,
        "num_token_id": model.num_token_id,
        "tie_word_embeddings": bool(getattr(bc, "tie_word_embeddings", False)),
    }


def save_adapter(model, save_directory: str | os.PathLike, *, metrics: dict | None = None,
                 is_main_process: bool = True, state_dict: dict | None = None,
                 adapter_tensors: dict[str, Tensor] | None = None, **kwargs) -> Path:
    """`CausalModel.save_pretrained` (see there): the active adapter's files, written atomically."""
    if state_dict is not None:
        raise ValueError("save_pretrained writes the adapter's own tensors; a state_dict argument is not supported")
    if not kwargs.pop("safe_serialization", True):
        raise ValueError("causal_adapter always writes safetensors (safe_serialization=False is not supported)")
    push, repo_id = kwargs.pop("push_to_hub", False), kwargs.pop("repo_id", None)
    if kwargs:
        raise TypeError(f"save_pretrained got unexpected arguments {sorted(kwargs)}")
    if not is_main_process:
        return Path(save_directory)
    meta = adapter_metadata(model)
    # with LoRA, its tensors live in peft's adapter_model.safetensors only (write_extra_files): one copy each
    state = adapter_tensors if adapter_tensors is not None else adapter_state_dict(model)
    tensors = {k: v for k, v in state.items() if not k.startswith(LORA_PREFIX)}
    lora = {k[len(LORA_PREFIX):]: v for k, v in state.items() if k.startswith(LORA_PREFIX)}

    def write(tmp: Path) -> None:
        write_adapter_files(tmp, meta, tensors)
        write_extra_files(tmp, model, metrics, final_directory=str(save_directory), lora_tensors=lora)

    path = atomic_write_dir(save_directory, write)
    if push:
        push_to_hub(model, repo_id or Path(save_directory).name, metrics=metrics)
    return path


# ----------------------------------------------------------------------------- from_pretrained / load_adapter
def adapter_config_for(base_model: nn.Module, meta: dict, adapter_dir: str | os.PathLike, tokenizer=None, *,
                       num_token_id: int | None = None) -> CausalAdapterConfig:
    """The config of a saved adapter (its metadata `meta`, read from `adapter_dir`) that fits `base_model`:
    refuses one whose model type, hidden size, vocabulary rows or <NUM> id (`tokenizer`: len(tokenizer);
    `num_token_id`: the id the adapters already on the base use) differ, naming both sides."""
    rows = base_model.get_output_embeddings().weight.shape[0]
    H = text_config(base_model).hidden_size
    for key, base_value in (("model_type", family_name(base_model)), ("hidden_size", H), ("vocab_size", rows)):
        if meta.get(key) != base_value:
            raise ValueError(
                f"adapter {str(adapter_dir)!r} was made for {key}={meta.get(key)!r}, but the base model has "
                f"{key}={base_value!r}"
            )
    num_id = meta["num_token_id"]
    if tokenizer is not None and len(tokenizer) != num_id:
        raise ValueError(
            f"adapter {str(adapter_dir)!r} uses num_token_id={num_id}, but this tokenizer's first reserved row "
            f"is len(tokenizer)={len(tokenizer)}: the adapter was made for another tokenizer"
        )
    if num_token_id is not None and num_token_id != num_id:
        raise ValueError(f"adapter {str(adapter_dir)!r} uses num_token_id={num_id}, but the adapters already on "
                         f"this base use {num_token_id}: it was made for another tokenizer")
    saved = dict(meta["adapter_config"])
    # adapters written before value units existed: raw units, the seeds' shared scale, unit d
    saved.setdefault("regression_scale", "shared")
    saved.setdefault("direction_norm", 1.0)
    return CausalAdapterConfig.from_dict({**saved, "num_token_id": num_id})


def open_adapter(base_model: nn.Module | str | os.PathLike | None, adapter_dir: str | os.PathLike, tokenizer=None, *,
                 num_token_id: int | None = None, torch_dtype=None, dtype=None, device_map=None,
                 revision: str | None = None, token: str | bool | None = None, cache_dir=None,
                 local_files_only: bool = False, **base_model_kwargs
                 ) -> tuple[nn.Module, CausalAdapterConfig, dict[str, Tensor]]:
    """The reading part of `CausalModel.from_pretrained` and `load_adapter`: (base model, adapter config, adapter
    tensors). `base_model` given as a path / name / None is loaded (see from_pretrained); `adapter_dir` is a local
    directory or a hub repo id; the adapter is checked against the base (`adapter_config_for`). Reads safetensors
    and json only (nothing is unpickled)."""
    if torch_dtype is not None and dtype is not None:
        raise ValueError("give torch_dtype or dtype, not both")
    adapter_dir = resolve_adapter_source(adapter_dir, revision=revision, token=token, cache_dir=cache_dir,
                                         local_files_only=local_files_only)
    meta, tensors = read_adapter_tensors(adapter_dir)
    base_model = load_base_model(base_model, meta, dtype=dtype if dtype is not None else torch_dtype,
                                 device_map=device_map, **base_model_kwargs)
    config = adapter_config_for(base_model, meta, adapter_dir, tokenizer, num_token_id=num_token_id)
    return base_model, config, tensors


def write_extra_files(directory: Path, model, metrics: dict | None = None, final_directory: str | None = None,
                      lora_tensors: dict | None = None) -> None:
    """What `save_pretrained` writes besides our two files: the model card and, with LoRA, peft's files.
    final_directory: where the files end up (the card's Usage snippet loads from there); lora_tensors:
    see `write_peft_lora`."""
    card = model_card(model, metrics, final_directory or str(directory))
    (directory / MODEL_CARD_NAME).write_text(card, encoding="utf-8")
    if model.causal_config.lora is not None:
        write_peft_lora(directory, model, lora_tensors)


def save_adapter_into(model, directory: str | os.PathLike, **save_kwargs) -> Path:
    """`model.save_pretrained` into `directory` without replacing what else it holds (a Trainer
    output directory with its checkpoints, an accelerate state directory): the files are written in
    a temporary directory, then each is moved in place (atomic per file; the config, which records
    the weights' sha256, last, so a crash in between is detected on load, never loaded silently).
    The directory itself is never replaced, even when empty: other processes may be writing into it
    at the same time (Trainer's FSDP shards in checkpoint-N)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".causal_adapter.tmp-", dir=directory))
    try:
        model.save_pretrained(tmp / "a", **save_kwargs)
        names = sorted(p.name for p in (tmp / "a").iterdir())
        if PEFT_CONFIG_NAME not in names:  # a peft view of an earlier LoRA save must not outlive it
            for stale in (PEFT_CONFIG_NAME, PEFT_WEIGHTS_NAME):
                if (directory / CONFIG_NAME).is_file():
                    (directory / stale).unlink(missing_ok=True)
        for name in sorted(names, key=lambda n: n == CONFIG_NAME):
            os.replace(tmp / "a" / name, directory / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def read_adapter_tensors(directory: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """(metadata, every adapter tensor) of an adapter directory. `save_pretrained` keeps a LoRA adapter's
    LoRA tensors in peft's file only (one copy); directories of earlier versions (LoRA in both files) and
    checkpoints (no peft file) hold them in ours, which is then read as it is."""
    meta, tensors = read_adapter_files(directory)
    if meta.get("adapter_config", {}).get("lora") is None or any(k.startswith(LORA_PREFIX) for k in tensors):
        return meta, tensors
    peft_file = Path(directory) / PEFT_WEIGHTS_NAME
    if not peft_file.is_file():
        raise FileNotFoundError(f"{str(peft_file)!r} is missing: this LoRA adapter keeps its LoRA weights in "
                                "peft's file (save_pretrained writes both)")
    return meta, {**tensors, **read_peft_lora(peft_file)}


def load_adapter_into(model, directory: str | os.PathLike) -> dict:
    """Read an adapter directory (a checkpoint) into `model`, strictly (every adapter tensor present
    with its shape; num_token_id and vocabulary rows equal). Returns the adapter's metadata."""
    meta, tensors = read_adapter_tensors(directory)
    for key, ours in (("num_token_id", model.num_token_id), ("vocab_size", model.vocab_size)):
        if meta.get(key) != ours:
            raise ValueError(f"checkpoint {str(directory)!r} was made for {key}={meta.get(key)!r}; this model has "
                             f"{key}={ours!r}")
    load_adapter_state_dict(model, tensors)
    return meta
