"""The adapters a server holds, by name, on ONE base (`CausalModel`'s multi-adapter API), and the checks of
runtime loading.

    model, registry = load_adapters(base, tokenizer, {"sunspots": "runs/a/adapter", "nile": "runs/b/adapter"})
    path = runtime_path(root, "b/adapter")    # RequestError 403 outside the root (symlinks and .. resolved)

Adapters are read as `CausalModel.from_pretrained` reads them: json and safetensors files, never a pickle.
The registry is read by the request handlers (names, listing) and changed by the worker only (load/unload).
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..model import CausalModel
from .scheduler import RequestError


@dataclass
class Entry:
    name: str
    path: str
    created: int
    value_decimals: int | None = None  # the adapter's (`CausalAdapterConfig.value_decimals`): /v1/models reports it


class Registry:
    """name -> Entry of the adapters loaded on the model, plus what /v1/models reports about the base."""

    def __init__(self, base_name: str | None, max_model_len: int | None):
        self.base_name, self.max_model_len = base_name, max_model_len
        self._entries: dict[str, Entry] = {}
        self._lock = threading.Lock()

    def add(self, name: str, path: str | os.PathLike, value_decimals: int | None = None) -> None:
        with self._lock:
            self._entries[name] = Entry(name, str(path), int(time.time()), value_decimals)

    def remove(self, name: str) -> None:
        with self._lock:
            self._entries.pop(name, None)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def entries(self) -> list[Entry]:
        with self._lock:
            return list(self._entries.values())

    def __contains__(self, name: str) -> bool:
        with self._lock:
            return name in self._entries

    def check(self, name: str) -> None:
        """RequestError 404 (OpenAI's model_not_found) for a name no adapter has."""
        if name not in self:
            raise RequestError(404, f"The model {name!r} does not exist: the adapters served are "
                                    f"{', '.join(self.names()) or 'none'}", param="model", code="model_not_found")


def load_adapters(base, tokenizer, adapters: dict[str, str | os.PathLike]) -> CausalModel:
    """One CausalModel on `base` holding every adapter of `adapters` (name -> directory), the first one active.
    A directory that does not fit the base (or the others) raises a ValueError: from_pretrained's message,
    prefixed with the adapter's name."""
    model = None
    for name, path in adapters.items():
        try:
            if model is None:
                model = CausalModel.from_pretrained(base, path, tokenizer=tokenizer, adapter_name=name)
            else:
                model.load_adapter(path, name, tokenizer=tokenizer)
        except (OSError, ValueError) as e:
            raise ValueError(f"adapter {name!r} ({str(path)!r}): {e}") from e
    if model is None:
        raise ValueError("no adapter to serve: give --adapter NAME=DIR")
    model.requires_grad_(False)
    return model.eval()


def runtime_path(root: str | os.PathLike, lora_path: str) -> Path:
    """The adapter directory `lora_path` (relative paths are read from `root`), resolved (symlinks, ``..``), after two
    checks, each refusing with a 403 that names it: the directory check (the directory itself resolves under `root`)
    and the file check (every file and folder in it, at any depth, resolves under `root`: a file that is a link out
    of the root is refused even when its directory is inside). A path that is not a directory is a 400."""
    root = Path(root).resolve()
    path = (root / Path(lora_path).expanduser()).resolve()  # an absolute lora_path replaces root
    if not _under(path, root):
        raise RequestError(403, f"lora_path {lora_path!r} resolves to {str(path)!r}, outside the directory the server "
                                f"may load adapters from (directory check: the adapter directory must lie under "
                                f"--runtime-adapter-root {str(root)!r})",
                           type="permission_error", param="lora_path", code="path_not_allowed")
    if not path.is_dir():
        raise RequestError(400, f"lora_path {lora_path!r}: no such adapter directory under the runtime root "
                                "(an adapter is a directory with causal_adapter_config.json and "
                                "causal_adapter_model.safetensors)", param="lora_path")
    for folder, dirs, files in os.walk(path):  # links are not followed: each one is checked where it points
        for name in sorted(dirs + files):
            entry = Path(folder) / name
            target = entry.resolve()
            if not _under(target, root):
                raise RequestError(403, f"lora_path {lora_path!r}: {str(entry.relative_to(path))!r} is a link to "
                                        f"{str(target)!r}, outside --runtime-adapter-root {str(root)!r} (file check: "
                                        "every file of the adapter must lie under the root)",
                                   type="permission_error", param="lora_path", code="path_not_allowed")
    return path


def _under(path: Path, root: Path) -> bool:
    return path == root or root in path.parents
