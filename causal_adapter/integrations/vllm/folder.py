"""The model folder `causal-adapter export-vllm` writes and the vLLM plugin loads (docs/serve_at_scale.md).

    OUT/config.json              the base's config; `architectures` = our vLLM class of its family (`ARCHITECTURES`),
                                 `causal_adapter_decision` = "softmax" or "deterministic" (the token choice)
    OUT/<every other base file>  symlinks to the base checkpoint's files: weights, index, tokenizer (never copied)
    OUT/causal_adapter/          the adapter's own two files (heads, d, b_cls, calibration: a few MB), copied
    OUT/lora/                    a LoRA adapter only: its LoRA in peft's format (adapter_config.json +
                                 adapter_model.safetensors: the A and B matrices, never a weight of the base), which
                                 vLLM serves with its LoRA support: `--enable-lora --lora-modules NAME=OUT/lora
                                 --max-lora-rank R` (`serve_flags`), the requests naming NAME as their model

vLLM loads the weights it finds at the folder's top level: the heads, one level down, are read by the plugin only.
A LoRA is served, not merged: merging would write a full copy of the base (docs/serve_at_scale.md#a-lora-adapter).
No vLLM import here: the export runs in the project's own environment.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ...saving.adapter_io import read_adapter_tensors
from ...saving.artifacts import CONFIG_NAME, WEIGHTS_NAME, read_adapter_files
from ...saving.peft_lora import LORA_PREFIX, PEFT_CONFIG_NAME, PEFT_WEIGHTS_NAME

HEADS_DIR = "causal_adapter"
#: a LoRA adapter's LoRA, peft's files, for `--lora-modules NAME=OUT/lora`
LORA_DIR = "lora"
#: the values vLLM's `--max-lora-rank` accepts (vllm/config/lora.py MaxLoRARanks, vLLM 0.32)
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
DECISION_KEY = "causal_adapter_decision"
DECISIONS = ("softmax", "deterministic")
#: `vllm serve OUT --tokenizer-mode causal_adapter`: prompt numbers become value ids (`value_ids`)
TOKENIZER_MODE = "causal_adapter"
#: family (the adapter's model_type) -> (text generation class, value class: `--runner pooling`)
ARCHITECTURES = {
    "qwen2": ("CausalAdapterQwen2ForCausalLM", "CausalAdapterQwen2ForValues"),
    "qwen3": ("CausalAdapterQwen3ForCausalLM", "CausalAdapterQwen3ForValues"),
}


def export_folder(adapter_dir: str | os.PathLike, out: str | os.PathLike, base: str | os.PathLike | None = None,
                  decision: str = "softmax", overwrite: bool = False) -> Path:
    """Write the vLLM model folder of a saved adapter at `out` (see the module docstring) and return it. `base`: the
    folder of the base checkpoint (None: the one the adapter records). A ValueError names a family vLLM's plugin has
    no class for, a LoRA on fused expert parameters, a base whose family, hidden size or vocabulary differ from the
    adapter's, or an `out` that holds files (unless `overwrite`). A LoRA adapter also gets OUT/lora (`serve_flags`)."""
    if decision not in DECISIONS:
        raise ValueError(f"decision must be one of {DECISIONS}, got {decision!r}")
    meta, _ = read_adapter_files(adapter_dir)  # checks the files (sha256, finite tensors)
    family = meta.get("model_type")
    if family not in ARCHITECTURES:
        raise ValueError(f"the vLLM plugin has classes for the {' and '.join(sorted(ARCHITECTURES))} families; this "
                         f"adapter's base is {family!r}: serve it with `causal-adapter serve`")
    lora = meta["adapter_config"].get("lora")
    if lora is not None and lora.get("target_parameters"):
        raise ValueError(f"this adapter's LoRA is on fused expert parameters {lora['target_parameters']}, which the "
                         "vLLM export does not write (docs/serve_at_scale.md#a-lora-adapter): serve it with "
                         "`causal-adapter serve`")
    base_dir = Path(base if base is not None else meta.get("base_model_name_or_path") or "")
    base_config = _base_config(base_dir)
    check_base_config(base_config, meta, str(adapter_dir))
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise ValueError(f"{str(out)!r} holds files: give an empty or new folder, or pass --overwrite")
        shutil.rmtree(out)
    (out / HEADS_DIR).mkdir(parents=True)
    for f in sorted(base_dir.iterdir()):
        if f.is_file() and f.name != "config.json":
            os.symlink(f.resolve(), out / f.name)  # the base stays where it is, untouched
    config = {**base_config, "architectures": [ARCHITECTURES[family][0]], DECISION_KEY: decision}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    src = Path(adapter_dir)
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        shutil.copyfile(src / name, out / HEADS_DIR / name)
    if lora is not None:
        write_lora(src, out / LORA_DIR, base_dir)
    return out


def write_lora(adapter_dir: Path, directory: Path, base_dir: Path) -> None:
    """The adapter's LoRA as peft's adapter folder (what `PeftModel.save_pretrained` and `peft_lora.write_peft_lora`
    write) at `directory`, read from the saved adapter: its peft file, or its own weights file in a checkpoint or an
    adapter of an earlier version (`read_adapter_tensors`). Only the LoRA tensors: a few MB, never a weight of the
    base."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    meta, tensors = read_adapter_tensors(adapter_dir)
    lora = {"base_model.model." + k[len(LORA_PREFIX):]: v.contiguous() for k, v in tensors.items()
            if k.startswith(LORA_PREFIX)}
    if not lora:
        raise ValueError(f"adapter {str(adapter_dir)!r} records a LoRA but holds no LoRA tensor")
    s = meta["adapter_config"]["lora"]
    directory.mkdir(parents=True)
    save_file(lora, str(directory / PEFT_WEIGHTS_NAME), metadata={"format": "pt"})
    LoraConfig(r=s["r"], lora_alpha=s["alpha"], lora_dropout=s.get("dropout", 0.0),
               target_modules=list(s["target_modules"]), task_type="CAUSAL_LM",
               base_model_name_or_path=str(base_dir.resolve())).save_pretrained(str(directory))


def lora_rank(folder: str | os.PathLike) -> int | None:
    """The LoRA rank r of an exported folder (None: no LoRA, a frozen backbone)."""
    config = Path(folder) / LORA_DIR / PEFT_CONFIG_NAME
    return json.loads(config.read_text())["r"] if config.is_file() else None


def serve_flags(folder: str | os.PathLike, name: str = "causal-lora") -> list[str]:
    """vLLM's flags that serve the LoRA of an exported folder as the model `name` (none for a frozen backbone):
    --enable-lora, --lora-modules name=FOLDER/lora, and --max-lora-rank, the smallest value vLLM accepts >= r."""
    r = lora_rank(folder)
    if r is None:
        return []
    fits = [m for m in MAX_LORA_RANKS if m >= r]
    if not fits:
        raise ValueError(f"LoRA rank {r} is above vLLM's largest --max-lora-rank {MAX_LORA_RANKS[-1]}")
    path = (Path(folder) / LORA_DIR).resolve()
    return ["--enable-lora", "--lora-modules", f"{name}={path}", "--max-lora-rank", str(fits[0])]


def _base_config(base_dir: Path) -> dict:
    if not str(base_dir) or not (base_dir / "config.json").is_file():
        raise ValueError(f"base {str(base_dir)!r} is not a local checkpoint folder (config.json + *.safetensors): "
                         "give it with --base")
    if not any(base_dir.glob("*.safetensors")):
        raise ValueError(f"base {str(base_dir)!r} holds no *.safetensors weights (vLLM loads safetensors)")
    return json.loads((base_dir / "config.json").read_text())


def check_base_config(config: dict, meta: dict, adapter: str) -> None:
    """Refuse a base (its config.json as a dict) the adapter was not made for: family, hidden size, vocabulary rows,
    naming both sides (as `CausalModel.from_pretrained` does on a loaded base)."""
    text = config.get("text_config") or config
    for key, base_value in (("model_type", config.get("model_type")), ("hidden_size", text.get("hidden_size")),
                            ("vocab_size", text.get("vocab_size"))):
        if meta.get(key) != base_value:
            raise ValueError(f"adapter {adapter!r} was made for {key}={meta.get(key)!r}, but the base model has "
                             f"{key}={base_value!r}")


def read_heads(folder: str | os.PathLike) -> tuple[dict, dict]:
    """(metadata, tensors) of the adapter in an exported folder; errors name a missing or corrupted file."""
    return read_adapter_files(Path(folder) / HEADS_DIR)


def decision_of(config) -> str:
    """The folder's token choice (a PretrainedConfig or dict): "softmax" (greedy = argmax loc_S) or "deterministic"
    (argmax of the OvR probability)."""
    d = config.get(DECISION_KEY, "softmax") if isinstance(config, dict) else getattr(config, DECISION_KEY, "softmax")
    if d not in DECISIONS:
        raise ValueError(f"{DECISION_KEY} must be one of {DECISIONS}, got {d!r}")
    return d
