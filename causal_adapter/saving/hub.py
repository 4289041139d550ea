"""The Hugging Face Hub and base loading: `resolve_adapter_source` (a local directory or a hub repo id,
one-line error offline), `push_to_hub`, `load_base_model` (a base given as a module, a local path or a
hub name), `check_base` (a base that cannot load, named in one line before any work: the commands' and lm-eval's
check, so that integrations need nothing of the command line)."""
from __future__ import annotations

import os
import re
import tempfile
import threading
from pathlib import Path

import torch
from torch import nn

from .artifacts import CONFIG_NAME, LEGACY_CONFIG_NAME, LEGACY_WEIGHTS_NAME, WEIGHTS_NAME, resolve_adapter_dir
from .assets import tiny_qwen_from_name
from .model_card import MODEL_CARD_NAME

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
#: how long `check_base` waits for the hub's answer about a base that is neither a folder nor cached
HUB_TIMEOUT_S = 10.0
_CHECKED_BASES: set[str] = set()


class BaseSourceError(OSError):
    """A base model that cannot load (`check_base`): a missing folder, a folder that is not a checkpoint, a hub name
    neither cached nor reachable. One line, for the command line and lm-eval's model alike."""


def truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


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


def check_base(base: str | None, flag: str = "--base") -> None:
    """Fail fast, in one line, on a base model that cannot load: a missing folder, a folder that
    is not a checkpoint, a hub name that is neither cached nor reachable (no 50 s of retries)."""
    if base is None or base in _CHECKED_BASES:
        return
    what = f"{flag} {base!r}"
    fix = "give the folder of a saved Qwen checkpoint (config.json + *.safetensors) or a hub name such as Qwen/Qwen2.5-0.5B"
    path = Path(base).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise BaseSourceError(f"{what} is a folder without config.json, not a model checkpoint: {fix}")
        return
    if path.exists():
        raise BaseSourceError(f"{what} is a file, not a model folder: {fix}")
    if base.startswith((".", "/", "~")) or not _HUB_ID.fullmatch(base):  # a path, not a hub id
        raise BaseSourceError(f"{what}: no such folder: {fix}")
    _check_hub(base, what)
    _CHECKED_BASES.add(base)  # a hub name is looked up once per process


def _check_hub(name: str, what: str) -> None:
    try:
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return
    except Exception:  # noqa: BLE001 - an invalid repo id: the lookup below names the problem
        pass
    if truthy("HF_HUB_OFFLINE") or truthy("TRANSFORMERS_OFFLINE"):
        raise BaseSourceError(f"{what} is not a local folder nor in the hub cache, and HF_HUB_OFFLINE is set: "
                       f"download it once with network (hf download {name}) or give a local folder")
    result: dict = {}

    def probe() -> None:
        try:
            from huggingface_hub import HfApi

            HfApi().model_info(name, timeout=HUB_TIMEOUT_S / 2)
        except Exception as e:  # noqa: BLE001 - classified below
            result["error"] = e

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(HUB_TIMEOUT_S)
    err = result.get("error")
    if thread.is_alive():
        err = TimeoutError(f"no answer within {HUB_TIMEOUT_S:.0f} s")
    if err is None:
        return
    kind = type(err).__name__
    if kind == "GatedRepoError":
        raise BaseSourceError(f"{what} is a gated model: accept its licence on huggingface.co and log in (hf auth login)")
    if kind in ("RepositoryNotFoundError", "HFValidationError"):
        raise BaseSourceError(f"{what}: no such model on the Hugging Face hub (or a private one: log in with "
                       f"hf auth login) and no such local folder: check the name or give the folder of a downloaded checkpoint")
    raise BaseSourceError(f"{what} is not a local folder nor in the hub cache, and the hub cannot be reached "
                   f"({kind}): connect to the network, or give the folder of a downloaded checkpoint")
