"""An adapter directory as the rest of the package reads and writes it: the extra files of
`save_pretrained` (the model card, peft's files), every adapter tensor read back (LoRA from peft's
file), strict loading into a model, and saving into a directory that holds other files (a Trainer
output directory, an accelerate state directory)."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from .artifacts import CONFIG_NAME, read_adapter_files
from .model_card import MODEL_CARD_NAME, model_card
from .peft_lora import LORA_PREFIX, PEFT_CONFIG_NAME, PEFT_WEIGHTS_NAME, read_peft_lora, write_peft_lora


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
    model.load_adapter_state_dict(tensors)
    return meta
