"""vLLM plugin for causal adapters (docs/serve_at_scale.md): `pip install "causal_adapter[vllm]"` puts `register` in
vLLM's `vllm.general_plugins` entry points, which every vLLM process calls; it registers our model classes (built on
vLLM's own Qwen2 / Qwen3 backbones: `models`) and the tokenizer mode `causal_adapter` (`tokenizer`).

`folder` (the exported folder) and `value_ids` import no vLLM: the export command runs without it. Nothing else in
the package imports this one.
"""
from __future__ import annotations

from .folder import ARCHITECTURES, TOKENIZER_MODE


def register() -> None:
    """vLLM's plugin hook: called once per vLLM process (again is harmless: a registration is replaced)."""
    from vllm import ModelRegistry
    from vllm.renderers.registry import RENDERER_REGISTRY
    from vllm.tokenizers.registry import TokenizerRegistry

    for text_cls, values_cls in ARCHITECTURES.values():
        for name in (text_cls, values_cls):  # lazily imported: vLLM inspects the class in a subprocess
            ModelRegistry.register_model(name, f"{__name__}.models:{name}")
    TokenizerRegistry.register(TOKENIZER_MODE, f"{__name__}.tokenizer", "NumberIdsTokenizer")
    RENDERER_REGISTRY.register(TOKENIZER_MODE, "vllm.renderers.hf", "HfRenderer")  # chat templates as for "hf"
