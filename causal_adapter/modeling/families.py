"""The Qwen causal-LM families the adapter wraps (SPEC 6), and what differs between them.

Everything the adapter needs from a backbone goes through the model's own accessors:
`get_input_embeddings()` (embed), `get_output_embeddings()` (W_cls = lm_head), `get_decoder()`
(the transformer body ending with the final norm: z), `config.get_text_config(decoder=True)`
(H, V, layer types). So one code path serves

* `*ForCausalLM` of every family below, and
* `*ForConditionalGeneration` (vision + language, Qwen3.5 / Qwen3.5-MoE): `get_decoder()` is its
  language model, the adapter feeds it text only (`inputs_embeds`), and images are refused
  (`check_text_only`): the vision tower never runs and is never given LoRA.

The cache is the backbone's own: the decoder creates it on the first call (`use_cache=True`,
no cache given), which for the hybrid families holds the convolution and recurrent states of the
linear-attention layers next to the key/value cache of the full-attention layers.

A family differs from the dense one only in which `nn.Linear` projections LoRA may target by
default (`Family.lora_targets`): the linear-attention projections of the hybrid layers are added.
MoE experts are fused 3-D parameters, not `nn.Linear`: peft reaches them through
`target_parameters` (`EXPERT_LORA_PARAMETERS`), opt-in, because peft gives every expert its own
rank-r factors and rebuilds the full delta of every expert weight at each forward (see docs/families.md).
peft 0.21 also renames, for the model types it converts from transformers v4 (qwen3_moe,
qwen3_next), `gate_proj` / `up_proj` / `down_proj` into those expert parameters: such names are
left out of the defaults and refused when given (`resolve_lora_settings`), so a Qwen3-Next
shared expert gets no LoRA.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

from torch import Tensor, nn

from ..config import DEFAULT_LORA_TARGETS

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")  # dense MLPs and the MoE shared expert
# peft `target_parameters` names of the fused MoE expert weights ([E, 2I, H] and [E, H, I])
EXPERT_LORA_PARAMETERS = ("experts.gate_up_proj", "experts.down_proj")
# inputs of a vision-language checkpoint that the adapter does not take (text in, numbers out)
_VISION_INPUTS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "mm_token_type_ids")


@dataclass(frozen=True)
class Family:
    """One Qwen family. name: the key saved in adapter_config.json (the text model's model_type
    without a `_text` suffix, so a Qwen3.5 text-only and VL checkpoint share it)."""

    name: str
    label: str
    lora_targets: tuple[str, ...]
    hybrid: bool = False
    moe: bool = False


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("qwen2", "Qwen2, Qwen2.5", _ATTENTION + _MLP),
    Family("qwen3", "Qwen3 (dense)", _ATTENTION + _MLP),
    Family("qwen2_moe", "Qwen2-MoE, Qwen1.5-MoE", _ATTENTION + _MLP, moe=True),
    Family("qwen3_moe", "Qwen3-MoE (e.g. Qwen3-30B-A3B)", _ATTENTION + _MLP, moe=True),
    Family("qwen3_next", "Qwen3-Next", _ATTENTION + _MLP + ("in_proj_qkvz", "in_proj_ba", "out_proj"),
           hybrid=True, moe=True),
    Family("qwen3_5", "Qwen3.5 (text or vision-language)",
           _ATTENTION + _MLP + ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"), hybrid=True),
    Family("qwen3_5_moe", "Qwen3.5-MoE (text or vision-language)",
           _ATTENTION + _MLP + ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),
           hybrid=True, moe=True),
)}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def text_config(model: nn.Module):
    """The decoder's config (the model's own for *ForCausalLM, `text_config` for a VL checkpoint)."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def family_name(model: nn.Module) -> str | None:
    """'qwen3_5' for Qwen3_5ForCausalLM (model_type 'qwen3_5_text') and Qwen3_5ForConditionalGeneration."""
    model_type = getattr(text_config(model), "model_type", None)
    if isinstance(model_type, str) and model_type.endswith("_text"):
        model_type = model_type[: -len("_text")]
    return model_type


def get_family(model: nn.Module) -> Family:
    """The model's Family; a clear error for anything else (another architecture, a bare decoder)."""
    name = family_name(model)
    family = FAMILIES.get(name)
    if family is None or not all(hasattr(model, a) for a in ("get_output_embeddings", "get_decoder")) \
            or model.get_output_embeddings() is None:
        outer = getattr(getattr(model, "config", None), "model_type", None)
        raise ValueError(
            f"unsupported base model {type(model).__name__} (model_type={outer!r}); causal_adapter supports the "
            f"*ForCausalLM / *ForConditionalGeneration models of {SUPPORTED_MODEL_TYPES} "
            f"({'; '.join(f.label for f in FAMILIES.values())})"
        )
    return family


def decoder_prefix(model: nn.Module) -> str:
    """Name of `model.get_decoder()` inside `model` ('model' for *ForCausalLM, 'model.language_model' for VL)."""
    decoder = model.get_decoder()
    for name, module in model.named_modules():
        if module is decoder:
            return name
    raise ValueError(f"{type(model).__name__}.get_decoder() is not a submodule of the model")


def peft_expert_renames(model: nn.Module, target_modules: list[str]) -> list[str]:
    """The names in `target_modules` that peft itself turns into `target_parameters` of the fused MoE
    experts for this model type (its transformers v4 -> v5 conversion: on qwen3_moe / qwen3_next,
    `gate_proj` / `up_proj` / `down_proj` mean the experts, and a dense or shared-expert MLP of that
    name cannot be targeted). Asked of peft's own conversion, on a throw-away LoraConfig."""
    from peft import LoraConfig
    from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers

    renamed = []
    for name in target_modules:
        probe = LoraConfig(target_modules=[name])
        try:
            convert_peft_config_for_transformers(probe, model=model, conversions=None)
        except ValueError:  # half of a fused pair (gate_proj without up_proj): converted too
            renamed.append(name)
            continue
        if name not in set(probe.target_modules or ()):
            renamed.append(name)
    return renamed


def default_lora_targets(model: nn.Module) -> list[str]:
    """The family's default LoRA `target_modules` that exist in this model and that peft applies as
    named (attention, dense/shared-expert MLP, linear-attention projections; never embeddings or lm_head)."""
    # a Linear that peft already wrapped (another adapter's LoRA) counts under its own name, not "base_layer"
    present = {n.removesuffix(".base_layer").rsplit(".", 1)[-1] for n, m in model.get_decoder().named_modules()
               if isinstance(m, nn.Linear)}
    targets = [t for t in get_family(model).lora_targets if t in present]
    renamed = set(peft_expert_renames(model, targets))
    return [t for t in targets if t not in renamed]


def resolve_lora_settings(model: nn.Module, config):
    """`config` with the default `lora.target_modules` (config.DEFAULT_LORA_TARGETS) replaced by the
    family's defaults for `model` (a copy; `config` itself when nothing changes). Refuses names that
    peft would silently turn into MoE expert targets."""
    if config.lora is None:
        return config
    if list(config.lora.target_modules) == list(DEFAULT_LORA_TARGETS):
        targets = default_lora_targets(model)
        if targets != list(config.lora.target_modules):
            config = replace(config, lora=replace(config.lora, target_modules=targets))
    renamed = peft_expert_renames(model, list(config.lora.target_modules))
    if renamed:
        raise ValueError(
            f"LoRA target_modules {renamed} on {family_name(model)}: peft maps these names to the fused MoE experts "
            f"of this model type, not to a dense or shared-expert MLP; to train the experts pass "
            f"target_parameters={list(EXPERT_LORA_PARAMETERS)} instead (a shared-expert MLP cannot be targeted "
            "by name here)"
        )
    return config


def lora_module_pattern(model: nn.Module, target_modules: list[str]) -> str:
    """A peft `target_modules` regex: modules named `target_modules` inside the decoder only (a VL
    checkpoint's vision tower never gets LoRA)."""
    prefix = decoder_prefix(model)
    names = "|".join(re.escape(t) for t in target_modules)
    return rf"{re.escape(prefix)}\.(.*\.)?({names})" if prefix else rf"(.*\.)?({names})"


def check_text_only(model: nn.Module, input_ids: Tensor) -> None:
    """A vision-language backbone is fed text only: image / video placeholder tokens in
    input_ids [B, S] are refused (a *ForCausalLM passes untouched)."""
    config = getattr(model, "config", None)
    if config is None or text_config(model) is config:
        return
    special = {k: getattr(config, k, None) for k in ("image_token_id", "video_token_id")}
    for key, token in special.items():
        if isinstance(token, int) and bool((input_ids == token).any()):
            raise ValueError(
                f"input_ids contain {key}={token}: causal_adapter feeds the language model of "
                f"{type(model).__name__} text only (images and videos are not supported); remove the "
                "image/video placeholders"
            )


def check_no_vision_inputs(inputs) -> None:
    """Refuse a dict of inputs (e.g. a processor's output) that carries images or videos (see `check_text_only`)."""
    found = [k for k in _VISION_INPUTS if k in inputs]
    if found:
        raise ValueError(f"the inputs hold {found}: causal_adapter takes text only (input_ids, numeric_values, "
                         "attention_mask); images and videos are not supported")


def is_flash_attention(model: nn.Module) -> bool:
    """Whether `model` (a decoder or a whole checkpoint) runs a flash-attention implementation ("flash_attention_2",
    a kernels-hub flash kernel, ...): packed rows then need one flattened row (varlen flash reads them so)."""
    return "flash" in str(getattr(text_config(model), "_attn_implementation", None) or "")


def has_linear_attention(model: nn.Module) -> bool:
    """Whether `model`'s decoder has linear-attention (recurrent) layers: Qwen3-Next, Qwen3.5."""
    return "linear_attention" in (getattr(text_config(model), "layer_types", None) or ())
