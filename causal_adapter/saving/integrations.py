"""Fitting the Hugging Face tools users already run (SPEC section 6, last item).

* peft: `CausalModel.save_pretrained` writes our own files (`causal_adapter_config.json`,
  `causal_adapter_model.safetensors`) and, for a LoRA backbone, ALSO a genuine peft LoRA adapter
  (peft's `adapter_config.json` + `adapter_model.safetensors`, the LoRA tensors only):
  `peft.PeftModel.from_pretrained(base, dir)` then gives the LoRA-tuned backbone (no heads), and
  serving stacks that read peft LoRA directories can use it. A frozen-backbone adapter has no
  file under peft's names. `merge_lora` / `disable_lora` back `CausalModel.merge_and_unload`,
  `unload` and `disable_adapter` with peft's own layer methods (`merge`, `get_base_layer`,
  `enable_adapters`).
* transformers.Trainer: `causal_adapter.saving.hf_trainer.CausalTrainer`, a Trainer subclass whose checkpoints are adapter-only
  (`_save` -> `save_pretrained`; `_load_from_checkpoint` / `_load_best_model` read the adapter,
  strictly). Plain `Trainer` saves `state_dict()` of any model that is not a `PreTrainedModel` /
  `PeftModel`, i.e. the whole base (or crashes on tied weights).
* accelerate: `register_accelerate_hooks(accelerator)` makes `save_state` / `load_state` write
  and read the adapter only (`causal_adapter/` inside the state directory), strictly.
* Hub: `resolve_adapter_source` (a local directory or a hub repo id, one-line error offline),
  `push_to_hub`, the model card written by `save_pretrained`, `load_base_model` (a base given as
  a module, a local path or a hub name).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from ..config import METRIC_LABELS
from .artifacts import (
    CONFIG_NAME,
    LEGACY_CONFIG_NAME,
    LEGACY_WEIGHTS_NAME,
    WEIGHTS_NAME,
    atomic_write_dir,
    read_adapter_files,
    resolve_adapter_dir,
    write_adapter_files,
)
from .assets import TINY_NAME, tiny_qwen_from_name

PEFT_CONFIG_NAME = "adapter_config.json"  # peft's file names (peft's schema only)
PEFT_WEIGHTS_NAME = "adapter_model.safetensors"
MODEL_CARD_NAME = "README.md"
ACCELERATE_SUBDIR = "causal_adapter"  # inside an accelerate save_state directory (model index 0)
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


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


# ============================================================================ peft LoRA export
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
        lora = get_peft_model_state_dict(model.backbone, save_embedding_layers=False)
    tensors = {f"base_model.model.{k}": v.detach().contiguous().cpu() for k, v in lora.items()}
    save_file(tensors, str(directory / PEFT_WEIGHTS_NAME), metadata={"format": "pt"})
    peft_lora_config(model).save_pretrained(str(directory))


def write_extra_files(directory: Path, model, metrics: dict | None = None, final_directory: str | None = None,
                      lora_tensors: dict | None = None) -> None:
    """What `save_pretrained` writes besides our two files: the model card and, with LoRA, peft's files.
    final_directory: where the files end up (the card's Usage snippet loads from there); lora_tensors:
    see `write_peft_lora`."""
    card = model_card(model, metrics, final_directory or str(directory))
    (directory / MODEL_CARD_NAME).write_text(card, encoding="utf-8")
    if model.causal_config.lora is not None:
        write_peft_lora(directory, model, lora_tensors)


# ============================================================================ model card
def model_card(model, metrics: dict | None = None, directory: str = "<this directory or repo id>") -> str:
    """A short README.md: base model, adapter configuration, metrics by split when known, and a Usage
    snippet that loads the adapter from `directory` as written."""
    meta = model.adapter_metadata()
    base = meta.get("base_model_name_or_path")
    tiny = base is not None and TINY_NAME.fullmatch(str(base)) is not None
    lora = model.causal_config.lora
    tags = ["causal_adapter", "cauchy", "numbers"] + (["peft", "lora"] if lora is not None else [])
    front = ["---", "library_name: causal_adapter"] + ([f"base_model: {base}"] if base and not tiny else [])
    front += ["tags:"] + [f"- {t}" for t in tags] + ["---", ""]
    where = (f"`{base}`: the embedded random tiny Qwen, rebuilt locally by `causal_adapter.saving.assets."
             "build_tiny_qwen` (no hub repo)") if tiny else (f"[`{base}`](https://huggingface.co/{base})" if base
                                                            else "not recorded (pass it to from_pretrained)")
    lines = [
        f"# Causal adapter for `{base or 'a Qwen model'}`",
        "",
        "Cauchy causal heads (abduction, OvR classification, regression of `<NUM>` values) on a "
        f"{'LoRA-tuned' if lora is not None else 'frozen'} `{meta['model_type']}` backbone, made with "
        f"causal_adapter {meta['library_version']}.",
        "",
        f"- base model: {where} (model_type `{meta['model_type']}`, hidden size {meta['hidden_size']}, "
        f"{meta['vocab_size']} vocabulary rows, tied embeddings: {meta['tie_word_embeddings']})",
        f"- `<NUM>` token id: {meta['num_token_id']}",
        f"- adapter parameters: {model.trainable_at_init:,d} trainable as `get_causal_model` sets them "
        "(a run's `freeze` may have trained fewer)",
    ]
    if lora is not None:
        lines.append(f"- LoRA: r={lora.r}, alpha={lora.alpha}, targets {list(lora.target_modules)}, in peft's "
                     f"files (`{PEFT_CONFIG_NAME}`, `{PEFT_WEIGHTS_NAME}`)")
    lines += ["", "## Configuration", "", "```json", json.dumps(model.causal_config.to_dict(), indent=2, sort_keys=True), "```"]
    lines += _card_metrics(metrics or {})
    lines += ["", "## Usage", "", "```python", "from causal_adapter import CausalModel", "",
              f"model = CausalModel.from_pretrained({base!r}, {directory!r})  # or the hub repo id it was pushed to",
              "```", ""]
    return "\n".join(front + lines)


#: a metric key's prefix -> the split it was measured on (train() logs the validation split as eval_*)
SPLIT_PREFIXES = (("eval_", "validation"), ("validation_", "validation"), ("test_", "test"), ("train_", "train"))


def _card_metrics(metrics: dict) -> list[str]:
    """The card's metrics table: one row per scalar metric with the split it was measured on."""
    rows = []
    for key, v in metrics.items():
        if not (isinstance(v, (int, float, str, bool)) or v is None):
            continue
        split, name = next(((s, key[len(p):]) for p, s in SPLIT_PREFIXES if key.startswith(p)), ("run", key))
        shown = f"{v:.6g}" if isinstance(v, float) else str(v)
        rows.append(f"| {split} | {METRIC_LABELS.get(name, name)} | {shown} |")
    if not rows:
        return []
    return ["", "## Metrics", "", "Measured by the run that saved the adapter. Its calibration map was fitted on "
            "the validation split, so validation coverage is in-sample. Perplexity is that of softmax(loc_S) "
            "over the whole vocabulary (large for a random base).", "", "| split | metric | value |",
            "|---|---|---|", *rows]


# ============================================================================ merge / unload / disable
def merge_lora(model, merge: bool = True, safe_merge: bool = True):
    """Replace every peft LoRA layer of the backbone by its base layer, merged (`merge=True`, peft's
    `merge`) or untouched; the model's config then has no LoRA. In place; returns the model."""
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


# ============================================================================ hub / loading
def _hub_offline() -> bool:
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except ImportError:
        return True


def resolve_adapter_source(source: str | os.PathLike, *, revision: str | None = None, token: str | bool | None = None,
                           cache_dir: str | os.PathLike | None = None, local_files_only: bool = False) -> Path:
    """A local adapter directory, or the snapshot of a hub repo id (``user/name``) downloaded with
    huggingface_hub (our files and the model card only). Offline / unreachable: one-line OSError."""
    path = Path(source)
    if path.exists() or resolve_adapter_dir(path).exists() or not _REPO_ID.match(str(source)):
        return path  # read_adapter_files names a missing directory
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise OSError(f"{str(source)!r} is not a local directory, and loading from the Hub needs huggingface_hub "
                      "(pip install huggingface_hub)") from None
    offline = local_files_only or _hub_offline()
    patterns = [CONFIG_NAME, WEIGHTS_NAME, LEGACY_CONFIG_NAME, LEGACY_WEIGHTS_NAME, MODEL_CARD_NAME]
    try:
        return Path(snapshot_download(str(source), revision=revision, token=token, cache_dir=cache_dir,
                                      allow_patterns=patterns, local_files_only=offline, etag_timeout=10))
    except Exception as e:  # noqa: BLE001 - every hub failure becomes one actionable line
        why = "offline (HF_HUB_OFFLINE=1 or local_files_only) and not in the local cache" if offline else \
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        raise OSError(f"cannot load adapter {str(source)!r}: no such local directory, and the Hugging Face Hub "
                      f"repo could not be fetched ({why}); pass a local adapter directory") from None


def load_base_model(base, meta: dict, *, dtype=None, device_map=None, **kwargs) -> nn.Module:
    """The base model: a module (cast to `dtype` / moved to a single-device `device_map` when given),
    a local path or hub name (AutoModelForCausalLM), or None (the adapter's recorded base)."""
    if base is None:
        base = meta.get("base_model_name_or_path")
        if not base:
            raise ValueError("no base model given and the adapter records none: pass the base model")
    if isinstance(base, nn.Module):
        if kwargs:
            raise TypeError(f"{sorted(kwargs)} apply when the base model is loaded by name, not to a module")
        if isinstance(device_map, dict):
            raise ValueError("a device_map dict applies when the base model is loaded by name; move the module "
                             "yourself or give one device")
        if dtype is not None:
            base = base.to(_as_dtype(dtype))
        if device_map is not None:
            base = base.to(device_map)
        return base
    if not isinstance(base, (str, os.PathLike)):
        raise TypeError(f"base_model must be a *ForCausalLM module, a local path or a hub name, got {type(base).__name__}")
    tiny = None if kwargs or Path(base).exists() else tiny_qwen_from_name(str(base))
    if tiny is not None:  # the embedded default base: rebuilt locally, never looked up on the hub
        return load_base_model(tiny, meta, dtype=dtype, device_map=device_map)
    from transformers import AutoModelForCausalLM

    if _hub_offline() and not Path(base).exists():
        kwargs.setdefault("local_files_only", True)
    try:
        return AutoModelForCausalLM.from_pretrained(str(base), dtype=_as_dtype(dtype) if dtype is not None else "auto",
                                                    device_map=device_map, **kwargs)
    except OSError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise OSError(f"cannot load the base model {str(base)!r} with AutoModelForCausalLM: {first}") from None


def _as_dtype(dtype):
    if isinstance(dtype, str) and dtype != "auto":
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"unknown torch_dtype {dtype!r}")
        return resolved
    return dtype


def push_to_hub(model, repo_id: str, *, private: bool | None = None, token: str | bool | None = None,
                revision: str | None = None, commit_message: str = "Upload causal adapter",
                metrics: dict | None = None) -> str:
    """Save the adapter into a temporary directory and upload it (create_repo + upload_folder).
    Returns the commit URL. Offline: one-line OSError before any network call."""
    if _hub_offline():
        raise OSError(f"cannot push to {repo_id!r}: the Hugging Face Hub is offline here (HF_HUB_OFFLINE=1); save "
                      "with save_pretrained(dir) and upload the directory later")
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    with tempfile.TemporaryDirectory() as tmp:
        folder = model.save_pretrained(Path(tmp) / "adapter", metrics=metrics)
        try:
            api.create_repo(repo_id, private=private, exist_ok=True)
            info = api.upload_folder(repo_id=repo_id, folder_path=str(folder), revision=revision,
                                     commit_message=commit_message)
        except Exception as e:  # noqa: BLE001
            raise OSError(f"cannot push to {repo_id!r}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                          ) from None
    return str(getattr(info, "commit_url", info))


# ============================================================================ saving into a shared directory
def save_adapter_into(model, directory: str | os.PathLike, **save_kwargs) -> Path:
    """`model.save_pretrained` into `directory` without replacing what else it holds (a Trainer
    output directory with its checkpoints, an accelerate state directory): the files are written in
    a temporary directory, then each is moved in place (atomic per file; the config, which records
    the weights' sha256, last, so a crash in between is detected on load, never loaded silently)."""
    directory = Path(directory)
    if not directory.is_dir() or not any(directory.iterdir()):
        return model.save_pretrained(directory, **save_kwargs)
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


#: the prefix of the LoRA tensors' names in `CausalModel.adapter_state_dict`
LORA_PREFIX = "lora."
_PEFT_KEY_PREFIX = "base_model.model."


def read_adapter_tensors(directory: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """(metadata, every adapter tensor) of an adapter directory. `save_pretrained` keeps a LoRA adapter's
    LoRA tensors in peft's file only (one copy); directories of earlier versions (LoRA in both files) and
    checkpoints (no peft file) hold them in ours, which is then read as it is."""
    from safetensors.torch import load_file  # safetensors: a dependency of transformers, lazy as in write_peft_lora

    meta, tensors = read_adapter_files(directory)
    if meta.get("adapter_config", {}).get("lora") is None or any(k.startswith(LORA_PREFIX) for k in tensors):
        return meta, tensors
    peft_file = Path(directory) / PEFT_WEIGHTS_NAME
    if not peft_file.is_file():
        raise FileNotFoundError(f"{str(peft_file)!r} is missing: this LoRA adapter keeps its LoRA weights in "
                                "peft's file (save_pretrained writes both)")
    lora = {LORA_PREFIX + k[len(_PEFT_KEY_PREFIX):]: v for k, v in load_file(str(peft_file)).items()
            if k.startswith(_PEFT_KEY_PREFIX) and "lora_" in k}
    return meta, {**tensors, **lora}


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


# ============================================================================ accelerate
def _accelerate_subdir(index: int) -> str:
    return ACCELERATE_SUBDIR if index == 0 else f"{ACCELERATE_SUBDIR}_{index}"


def register_accelerate_hooks(accelerator) -> tuple:
    """Make `accelerator.save_state` / `load_state` write and read every prepared CausalModel as its
    adapter only (``<state dir>/causal_adapter`` for the first prepared model, ``causal_adapter_<i>``
    for the i-th), through accelerate's `register_save_state_pre_hook` / `register_load_state_pre_hook`.
    Other prepared models, optimizers, schedulers, RNG states are saved by accelerate as usual.
    Loading is strict: a state directory without the adapter, or an adapter of another shape, raises.
    Returns the two `RemovableHandle`s."""
    from accelerate.utils import DistributedType

    def causal_positions(models) -> list[int]:
        return [i for i, m in enumerate(models) if unwrap_causal_model(m) is not None]

    def index_of(model) -> int:
        return next(i for i, m in enumerate(accelerator._models) if m is model)

    def save_hook(models, weights, output_dir):
        positions = causal_positions(models)
        if positions and accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
            raise NotImplementedError(
                f"adapter-only save_state under {accelerator.distributed_type} is not supported by these hooks "
                "(accelerate saves the sharded model before any hook runs): save the adapter with "
                "causal_adapter.saving.integrations.save_fsdp_adapter / CausalModel.save_pretrained instead")
        for i in reversed(positions):
            if accelerator.is_main_process:
                inner = unwrap_causal_model(models[i])
                save_adapter_into(inner, Path(output_dir) / _accelerate_subdir(i))
            del weights[i]  # weights[i] is models[i]'s state dict: accelerate must not write it

    def load_hook(models, input_dir):
        for j in reversed(causal_positions(models)):
            path = Path(input_dir) / _accelerate_subdir(index_of(models[j]))
            if not (path / CONFIG_NAME).is_file():
                raise FileNotFoundError(f"{str(path)!r} has no causal adapter ({CONFIG_NAME}): {str(input_dir)!r} "
                                        "was not saved with causal_adapter's accelerate hooks")
            load_adapter_into(unwrap_causal_model(models[j]), path)
            del models[j]

    return accelerator.register_save_state_pre_hook(save_hook), accelerator.register_load_state_pre_hook(load_hook)


# ============================================================================ FSDP (accelerate's FSDP1 / FSDP2, torch's fully_shard)
# The heads stay outside FSDP (replicated on every process, in their own dtype): their parameters are
# used outside their own forward (W_cls-based scores, the fused loss), which FSDP1 units cannot serve,
# and a bf16 base next to fp32 heads in one FSDP1 unit is refused ("Must flatten tensors with uniform
# dtype"). W_cls stays in the root unit, which is unsharded for the whole forward and backward.
# accelerate reads this regex from `fsdp_ignored_modules` (examples/accelerate_configs/fsdp*.yaml).
FSDP_IGNORED_MODULES = "numeric_embedding|abduction|action"


def fsdp_ignored_modules(model) -> list[nn.Module]:
    """The CausalModel's heads, to pass as FSDP1 `ignored_modules` (FSDP2: their parameters as
    `ignored_params`); accelerate selects the same modules from `FSDP_IGNORED_MODULES`."""
    inner = unwrap_causal_model(model)
    return [inner.numeric_embedding, inner.abduction, inner.action]


def average_replicated_grads(model) -> int:
    """After an FSDP wrap that leaves the heads replicated (ignored), average their gradients over the
    processes after each backward (a post-accumulate-grad hook per trainable head parameter), so that
    a plain optimizer step keeps the replicas equal; FSDP reduces the sharded parameters itself.
    Idempotent; call on every process after `accelerator.prepare`. Returns the number of hooked tensors."""
    import torch.distributed as dist

    world = dist.get_world_size()

    def average(p):
        dist.all_reduce(p.grad)
        p.grad.div_(world)

    hooked = 0
    for module in fsdp_ignored_modules(model):
        for p in module.parameters():
            if p.requires_grad and not getattr(p, "_causal_adapter_grad_averaged", False):
                p.register_post_accumulate_grad_hook(average)
                p._causal_adapter_grad_averaged = True
                hooked += 1
    return hooked


def keep_input_dtypes(model) -> None:
    """Stop FSDP's mixed precision from casting the root forward's floating inputs (numeric_values,
    label_values) to the compute dtype: values in bf16 keep 3 significant digits (1234.5 -> 1232).
    The layers still compute in FSDP's param_dtype. FSDP1 root (`cast_root_forward_inputs`) or
    FSDP2 root (`cast_forward_inputs`); anything else is left as it is."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if isinstance(model, FSDP):
        model.mixed_precision = dataclasses.replace(model.mixed_precision, cast_root_forward_inputs=False)
    elif isinstance(model, FSDPModule):
        state = model._get_fsdp_state()
        state._mp_policy = dataclasses.replace(state._mp_policy, cast_forward_inputs=False)


def finish_fsdp_wrap(model) -> None:
    """What a CausalModel needs after `accelerator.prepare` under FSDP (FSDP1 or FSDP2, the heads ignored
    as `FSDP_IGNORED_MODULES` says): head gradients averaged over the processes
    (`average_replicated_grads`) and the values kept in their dtype (`keep_input_dtypes`). Refuses a
    wrap whose heads FSDP manages (a missing `fsdp_ignored_modules`)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor import DTensor

    heads = [p for m in fsdp_ignored_modules(model) for p in m.parameters()]
    ignored = getattr(model, "_ignored_params", set()) if isinstance(model, FSDP) else None  # FSDP1 root
    if any(isinstance(p, DTensor) or (ignored is not None and p not in ignored) for p in heads):
        raise ValueError(f"FSDP manages the adapter heads: set fsdp_ignored_modules: \"{FSDP_IGNORED_MODULES}\" in "
                         "the accelerate config (see examples/accelerate_configs/fsdp.yaml)")
    average_replicated_grads(model)
    keep_input_dtypes(model)


def fully_shard_causal_model(model, **fsdp_kwargs):
    """Shard a CausalModel with torch's FSDP2 `fully_shard` (works on CPU with gloo), as accelerate's
    `fsdp_version: 2` with `fsdp_ignored_modules` does: each decoder layer is its own unit, the root
    unit holds the embeddings / lm_head (W_cls); the heads stay replicated (ignored), their gradients
    averaged over the processes (`average_replicated_grads`). Call on every process after
    `torch.distributed.init_process_group`; returns the model."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.decoder.layers:
        fully_shard(layer, **fsdp_kwargs)
    heads = {p for m in fsdp_ignored_modules(model) for p in m.parameters()}
    fully_shard(model, ignored_params=heads, **fsdp_kwargs)
    finish_fsdp_wrap(model)
    return model


@contextlib.contextmanager
def _whole_parameters(model) -> Iterator[Any]:
    """Inside: the CausalModel in `model` with FSDP1's flat parameters summoned whole (a collective;
    W_cls has its [V, H] shape again). FSDP2 and unwrapped models are yielded as they are."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    fsdp1 = next((m for m in (model, getattr(model, "module", None)) if isinstance(m, FSDP)), None)
    ctx = FSDP.summon_full_params(fsdp1, writeback=False) if fsdp1 is not None else contextlib.nullcontext()
    with ctx:
        yield unwrap_causal_model(model)


def full_adapter_state_dict(model) -> dict:
    """`adapter_state_dict()` of a (possibly FSDP1- or FSDP2-wrapped) CausalModel with every tensor
    whole: FSDP2 DTensors gathered, FSDP1 flat parameters summoned (a collective: call it on every
    process). Tensors are copies."""
    from torch.distributed.tensor import DTensor

    with _whole_parameters(model) as inner:
        state = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                 for k, v in inner.adapter_state_dict().items()}
    if inner.causal_config.lora is not None and not any(k.startswith("lora.") for k in state):
        # peft's get_peft_model_state_dict finds no LoRA layer through FSDP1's wrapped units (measured)
        raise NotImplementedError("saving LoRA from an FSDP1-wrapped model is not supported (peft finds no LoRA "
                                  "tensor through FSDP1's units): use FSDP2 (fsdp2.yaml) or DDP for LoRA")
    return state


def save_fsdp_adapter(model, directory: str | os.PathLike) -> Path:
    """Adapter-only checkpoint of an FSDP-wrapped CausalModel (FSDP1 or FSDP2, accelerate's or torch's):
    the adapter tensors are gathered on every process (collective), the main process writes our two
    files atomically."""
    import torch.distributed as dist


    tensors = full_adapter_state_dict(model)
    with _whole_parameters(model) as inner:  # FSDP1: W_cls (hence vocab_size) is a flat shard outside
        meta = inner.adapter_metadata()
    if dist.get_rank() == 0:
        atomic_write_dir(directory, lambda tmp: write_adapter_files(tmp, meta, tensors))
    dist.barrier()
    return Path(directory)
