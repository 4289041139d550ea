"""Adapter-only artifacts (SPEC section 5): atomic directory writes and the two files.

An adapter directory holds
    causal_adapter_config.json        the CausalAdapterConfig + base-model facts + library version
    causal_adapter_model.safetensors  the adapter's tensors only (heads, d, b_cls, <NUM> row, LoRA)
and, written by `CausalModel.save_pretrained` (not by training checkpoints): README.md (a model
card) and, for a LoRA backbone, a genuine peft LoRA adapter (peft's adapter_config.json +
adapter_model.safetensors: the LoRA tensors only, loadable by `peft.PeftModel.from_pretrained`).
Directories written before 0.2 named our own files adapter_config.json / adapter_model.safetensors
(peft's names, not peft's schema); they are still read (LEGACY_*).

Atomicity: everything is written into a fresh temporary directory next to the target and
fsynced; the temporary directory then takes the target's place in one step (Linux
renameat2(RENAME_EXCHANGE) swaps the two directories atomically; elsewhere the old
directory is moved aside first and restored by the loader if a crash hits in between).
A crash at any point leaves either the previous complete adapter or the new one.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

CONFIG_NAME = "causal_adapter_config.json"
WEIGHTS_NAME = "causal_adapter_model.safetensors"
# our files before 0.2: peft's file names with our schema (read, never written)
LEGACY_CONFIG_NAME = "adapter_config.json"
LEGACY_WEIGHTS_NAME = "adapter_model.safetensors"
FORMAT_VERSION = 1  # bumped on an incompatible change of the adapter layout
_ASIDE_SUFFIX = ".previous"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two directories (Linux renameat2 RENAME_EXCHANGE). False if unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    AT_FDCWD, RENAME_EXCHANGE = -100, 2
    rc = renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE)
    if rc != 0:
        err = ctypes.get_errno()
        if err in (22, 38, 95):  # EINVAL / ENOSYS / EOPNOTSUPP: filesystem cannot exchange
            return False
        raise OSError(err, os.strerror(err), f"{a} <-> {b}")
    return True


def atomic_write_dir(target: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Call `write(tmp_dir)` to fill a fresh directory, then put it in place of `target` atomically."""
    target = Path(target).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp_dirs(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-", dir=target.parent))
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; an adapter is as readable as any directory
        write(tmp)
        for f in tmp.iterdir():
            if not f.is_file():  # a subdirectory (accelerate's FSDP state): its writer synced its own files
                continue
            os.chmod(f, 0o666 & ~_umask())  # safetensors and mkstemp write 0600: files get the umask's permissions
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(tmp)
        try:
            os.rename(tmp, target)  # target absent (or an empty dir): plain atomic rename
        except OSError:
            if not _exchange(tmp, target):
                aside = target.with_name(target.name + _ASIDE_SUFFIX)
                shutil.rmtree(aside, ignore_errors=True)
                os.rename(target, aside)
                os.rename(tmp, target)
                shutil.rmtree(aside, ignore_errors=True)
        _fsync_dir(target.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # after an exchange it holds the previous version
    return target


def atomic_write_file(target: str | os.PathLike, write: Callable[[object], None]) -> Path:
    """Call `write(fh)` on a text file (UTF-8) next to `target`, fsync it, then rename it onto `target`:
    a crash leaves the previous file or the new one, never half of one."""
    target = Path(target).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600: the file gets the umask's permissions
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _remove_stale_tmp_dirs(target: Path) -> None:
    """Temporary directories left by a killed writer (its pid is gone) are removed."""
    for tmp in target.parent.glob(f".{target.name}.tmp-*"):
        pid = tmp.name[len(f".{target.name}.tmp-"):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def resolve_adapter_dir(path: str | os.PathLike) -> Path:
    """The directory to load from; recovers a save interrupted on a filesystem without exchange."""
    path = Path(path)
    aside = path.with_name(path.name + _ASIDE_SUFFIX)
    if not path.exists() and aside.is_dir():
        return aside
    return path


def _check_finite(tensors: dict[str, torch.Tensor], what: str) -> None:
    for k, v in tensors.items():
        if v.dtype.is_floating_point and not bool(torch.isfinite(v).all()):
            raise ValueError(f"{what}: adapter tensor {k!r} contains NaN or inf ({int((~torch.isfinite(v)).sum())} "
                             f"of {v.numel()} entries); a diverged model is never written or loaded")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_adapter_files(directory: Path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Write the two adapter files into `directory` (no atomicity here; see atomic_write_dir).
    Refuses non-finite tensors; records the weights file's sha256 in the config (checked on load)."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    _check_finite(tensors, "refusing to save the adapter")
    save_file(tensors, str(directory / WEIGHTS_NAME), metadata={"format": "pt", "causal_adapter": str(FORMAT_VERSION)})
    config = {**config, "weights_sha256": _sha256(directory / WEIGHTS_NAME)}
    (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _adapter_file_paths(directory: Path) -> tuple[Path, Path]:
    """Our config and weights files in `directory`; the pre-0.2 names when only they are there and
    hold our schema. A peft adapter (peft's schema under peft's name, no file of ours) is named as such."""
    cfg_path, w_path = directory / CONFIG_NAME, directory / WEIGHTS_NAME
    legacy = directory / LEGACY_CONFIG_NAME
    if cfg_path.is_file() or not legacy.is_file():
        return cfg_path, w_path
    try:
        meta = json.loads(legacy.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, OSError):
        return legacy, directory / LEGACY_WEIGHTS_NAME  # ours or nothing: the reader names the JSON error
    if isinstance(meta, dict) and "peft_type" in meta and meta.get("library") != "causal_adapter":
        raise FileNotFoundError(
            f"{str(cfg_path)!r} is missing: {str(directory)!r} holds a peft {meta.get('peft_type')} adapter, not a "
            "causal_adapter one (load it with peft.PeftModel.from_pretrained(base_model, directory))")
    return legacy, directory / LEGACY_WEIGHTS_NAME


def read_adapter_files(directory: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read and sanity-check an adapter directory; errors name the file and the problem."""
    directory = resolve_adapter_dir(directory)
    if directory.is_file():
        raise NotADirectoryError(f"{str(directory)!r} is a file: an adapter is the directory that holds "
                                 f"{CONFIG_NAME} and {WEIGHTS_NAME}: give {str(directory.parent)!r}")
    cfg_path, w_path = _adapter_file_paths(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"adapter directory {str(directory)!r} does not exist")
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{str(cfg_path)!r} is missing: {str(directory)!r} is not a causal_adapter adapter")
    if not w_path.is_file():
        raise FileNotFoundError(f"{str(w_path)!r} is missing")
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(cfg_path)!r} is not valid JSON: {e}") from None
    version = config.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ValueError(
            f"{str(cfg_path)!r} has format_version={version!r}; this causal_adapter reads format "
            f"{FORMAT_VERSION} or older (written by version {config.get('library_version')!r}): upgrade causal_adapter"
        )
    digest = config.get("weights_sha256")
    if digest is not None and _sha256(w_path) != digest:
        raise ValueError(f"{str(w_path)!r} is truncated or corrupted: its sha256 differs from the one recorded "
                         f"in {str(cfg_path)!r} when it was saved")
    try:
        tensors = load_file(str(w_path))
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{str(w_path)!r} is truncated or corrupted: {e}") from None
    _check_finite(tensors, f"{str(w_path)!r}")
    return config, tensors
