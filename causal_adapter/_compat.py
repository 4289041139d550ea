"""Every switch on a dependency's version lives here (SPEC 6: supported versions are tested, not
assumed). Layer 0: imports nothing of the package.

transformers 5.24 renamed the cache keyword of every decoder forward and model output from
`past_key_values` (and `cache_params`) to `cache`; the old name still works there but warns
(`FutureWarning`, removal announced for 5.40). The check is on the callee's own signature, not on
the version number, so a family or a remote-code model that renames later (or never) gets the
name it takes.

transformers 5.24 also renamed `gradient_checkpointing_enable` / `_disable` to
`activation_checkpointing_enable` / `_disable` (the old names warn).
"""
from __future__ import annotations

import inspect
from typing import Any

from torch import nn

NEW_CACHE_NAME = "cache"  # transformers >= 5.24
OLD_CACHE_NAMES = ("past_key_values", "cache_params")  # transformers < 5.24


def cache_keyword(module: nn.Module) -> str:
    """The keyword `module.forward` takes its cache under: "cache" (transformers >= 5.24) or the
    old name it declares ("past_key_values" by default)."""
    return _cache_keyword_of(type(module))


_KEYWORDS: dict[type, str] = {}


def _cache_keyword_of(cls: type) -> str:
    if cls not in _KEYWORDS:
        params = inspect.signature(cls.forward).parameters
        names = [n for n in (NEW_CACHE_NAME, *OLD_CACHE_NAMES) if n in params]
        _KEYWORDS[cls] = names[0] if names else OLD_CACHE_NAMES[0]
    return _KEYWORDS[cls]


def cache_kwargs(module: nn.Module, cache: Any) -> dict[str, Any]:
    """{name: cache} to pass to `module(...)` under the name its forward takes."""
    return {cache_keyword(module): cache}


def output_cache(output: Any) -> Any:
    """The cache a decoder returned (`output.cache` on transformers >= 5.24, `past_key_values`
    before), read without touching the deprecated name."""
    for name in (NEW_CACHE_NAME, *OLD_CACHE_NAMES):
        if name in output.__dataclass_fields__:
            return getattr(output, name)
    return None


def activation_checkpointing_enable(model: nn.Module, kwargs: dict | None = None, **extra: Any) -> None:
    """Turn on a transformers model's activation checkpointing under the name its version has."""
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.24
    (enable or model.gradient_checkpointing_enable)(kwargs, **extra)


def activation_checkpointing_disable(model: nn.Module) -> None:
    disable = getattr(model, "activation_checkpointing_disable", None)  # transformers >= 5.24
    (disable or model.gradient_checkpointing_disable)()
