"""CausalModel: a Qwen backbone (frozen or LoRA through peft) plus the causal heads.

    input_ids, numeric_values --embed + phi(v)--> inputs_embeds --backbone + final norm--> z
    z --AbductionHead--> (loc_U, scale_U) --ActionHead--> OvR scores (loc_S, scale_S), (loc_Y, scale_Y)

One `forward` holds embedding, backbone, heads and loss (what DDP needs).
"""
from __future__ import annotations

import contextlib
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers.utils import ModelOutput

from .._compat import (
    activation_checkpointing_disable,
    activation_checkpointing_enable,
    cache_kwargs,
    output_cache,
)
from .._version import __version__
from ..config import BF16_MAX_SHIFT, IGNORE_INDEX, CausalAdapterConfig
from ..modeling.families import (
    SUPPORTED_MODEL_TYPES,
    check_text_only,
    family_name,
    get_family,
    has_linear_attention,
    is_flash_attention,
    lora_module_pattern,
    resolve_lora_settings,
    text_config,
)
from ..modeling.generation import generate, generate_batched
from ..modeling.heads import (
    AbductionHead,
    ActionHead,
    NumericEmbedding,
    full_precision,
    packed_row_starts,
    recent_values,
)
from ..modeling.intervals import interval
from ..modeling.loss import fused_ovr_loss, gated_regression_loss, num_probability, reference_ovr_loss, total_loss
from ..modeling.prediction import predict_values
from .artifacts import FORMAT_VERSION, atomic_write_dir, write_adapter_files
from .adapter_io import read_adapter_tensors, write_extra_files
from .hub import load_base_model, push_to_hub, resolve_adapter_source
from .peft_lora import LORA_PREFIX, disable_lora, merge_lora
from .quantization import prepare_quantized_for_training


@dataclass
class CausalOutput(ModelOutput):
    """Shapes: B batch, S sequence, C causal size, V vocabulary rows.

    loss, loss_cls, loss_reg: scalars (None without labels). loc_U, scale_U: [B, S, C]
    (scale_U without the exogenous noise; scale_U' = scale_U + |b_noise|). loc_Y, scale_Y: [B, S].
    loc_S, scale_S: [B, S, V], only with `return_scores=True`. hidden_states: z [B, S, H].
    recent: [B, S, K] the raw values of the K most recent numbers the value head read (NaN = none), with
    `recent_values` K > 0.
    """

    loss: Tensor | None = None
    loss_cls: Tensor | None = None
    loss_reg: Tensor | None = None
    loc_U: Tensor | None = None
    scale_U: Tensor | None = None
    loc_Y: Tensor | None = None
    scale_Y: Tensor | None = None
    loc_S: Tensor | None = None
    scale_S: Tensor | None = None
    hidden_states: Tensor | None = None
    recent: Tensor | None = None
    cache: Any = None

    @property
    def past_key_values(self) -> Any:
        """The cache under its name before transformers 5.24 (kept for callers that read it)."""
        return self.cache


def _head_dtype(dtype: torch.dtype, autocast_adapter_dtype: bool = True) -> torch.dtype:
    # Heads keep full precision on a bf16/fp16 backbone (unless asked to keep the base dtype);
    # an fp64 backbone gets fp64 heads.
    if dtype in (torch.float32, torch.float64) or not autocast_adapter_dtype:
        return dtype
    return torch.float32


def check_supported(model: nn.Module) -> None:
    """Raise a ValueError naming the supported families unless `model` is one (causal_adapter.modeling.families)."""
    get_family(model)


def check_unquantized_heads(model: nn.Module) -> None:
    """A quantised base (bitsandbytes 4-bit / 8-bit: QLoRA) is fine in its decoder layers, but W_cls
    (lm_head) and the input embedding must stay full-precision [rows, H] matrices: the OvR scores use
    |W_cls| and the <NUM> row is read and trained from it. Raise a ValueError saying how to load it."""
    H = text_config(model).hidden_size
    for name, module in (("lm_head", model.get_output_embeddings()), ("input embedding", model.get_input_embeddings())):
        W = getattr(module, "weight", None)
        if not (isinstance(W, Tensor) and W.dtype.is_floating_point and W.dim() == 2 and W.shape[1] == H):
            shape = tuple(getattr(W, "shape", ()))
            what = f"{type(module).__name__} with a {getattr(W, 'dtype', None)} weight of shape {shape}"
            raise ValueError(
                f"the base model's {name} is quantised ({what}); causal_adapter needs it full precision "
                f"[rows, {H}] (W_cls is the lm_head weight). Quantise the decoder layers only: "
                "BitsAndBytesConfig(..., llm_int8_skip_modules=['lm_head']) (transformers' default when "
                "llm_int8_skip_modules is not given); embeddings are never quantised by bitsandbytes"
            )


def resolve_num_token_id(model: nn.Module, config: CausalAdapterConfig, tokenizer=None) -> int:
    """SPEC 1: config.num_token_id, else len(tokenizer), else the tokenizer found offline at
    model.name_or_path; the id must be a row of the embedding that the tokenizer does not use."""
    rows = model.get_output_embeddings().weight.shape[0]
    if config.num_token_id is not None:
        num_id = config.num_token_id
        source = "config.num_token_id"
    else:
        if tokenizer is None:
            tokenizer = _offline_tokenizer(getattr(model, "name_or_path", None))
        if tokenizer is None:
            raise ValueError(
                "cannot determine the <NUM> token id: pass tokenizer=... to get_causal_model, or set "
                "CausalAdapterConfig(num_token_id=len(tokenizer)) (the first reserved embedding row)"
            )
        num_id = len(tokenizer)
        source = f"len(tokenizer)={num_id}"
        if num_id >= rows:
            raise ValueError(
                f"the model has no reserved embedding row for <NUM>: len(tokenizer)={num_id} >= "
                f"{rows} embedding rows; pass an explicit CausalAdapterConfig(num_token_id=...)"
            )
    if not 0 <= num_id < rows:
        raise ValueError(f"num_token_id={num_id} (from {source}) is outside the model's {rows} embedding rows")
    return num_id


def _offline_tokenizer(name_or_path: str | None):
    if not name_or_path:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
    except Exception:  # not a local dir / not cached: the caller raises the actionable error
        return None


class CausalModel(nn.Module):
    """The wrapped model. Build it with `get_causal_model` or `CausalModel.from_pretrained`.

    As on a peft `PeftModel`, `model.config` is the base model's `PretrainedConfig` (what transformers,
    accelerate's DeepSpeed integration and TRL read); the adapter's own `CausalAdapterConfig` is
    `model.causal_config`.
    """

    def __init__(self, backbone: nn.Module, config: CausalAdapterConfig, num_token_id: int):
        super().__init__()
        check_supported(backbone)
        check_unquantized_heads(backbone)
        # one layout that trains for a 4-bit base, evaluated or not, on any CPU (saving/quantization.py)
        prepare_quantized_for_training(backbone)
        self.causal_config = config
        self.num_token_id = num_token_id
        self.backbone = backbone
        W = backbone.get_output_embeddings().weight
        H, V = text_config(backbone).hidden_size, W.shape[0]
        C = config.causal_size or H
        if C != H:
            raise ValueError(
                f"causal_size={C} must equal the backbone hidden size {H}: W_cls is the backbone's own "
                "lm_head weight (shared, not copied), which acts on H-dimensional vectors"
            )
        dtype, device = _head_dtype(W.dtype, config.autocast_adapter_dtype), W.device
        gen = torch.Generator().manual_seed(config.seed)  # CPU generator: same init on every device
        for p in backbone.parameters():
            p.requires_grad_(False)
        # Everything random comes from config.seed; the caller's RNG streams are left as they
        # were (module constructors and peft's lora_A init draw from the global RNG).
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            if config.lora is not None:
                self._inject_lora()
            self.numeric_embedding = NumericEmbedding(
                H, learnable=config.learnable_direction, std=config.direction_std, generator=gen, dtype=dtype,
                device=device, norm=config.direction_norm or _median_row_norm(backbone.get_input_embeddings().weight),
            )
            self.abduction = AbductionHead(H, C, gamma0=config.gamma0, generator=gen, dtype=dtype, device=device)
            self.action = ActionHead(
                C, V, num_token_id, W[num_token_id],
                b_noise_init=config.b_noise_init, threshold_init=config.threshold_init,
                threshold_mode=config.threshold_mode, learnable_threshold=config.learnable_threshold,
                train_num_row=config.train_num_row, scale_floor=config.scale_floor,
                generator=gen, dtype=dtype, device=device, regression_scale=config.regression_scale,
                b_noise_Y_init=config.b_noise_Y_init, recent_values=config.recent_values,
            )
        if config.value_loc is not None:
            self.set_value_units(config.value_loc, config.value_scale)
        # the adapter's size as built (print_trainable_parameters now); freezing or loading for inference
        # changes requires_grad later, the card reports this
        self.trainable_at_init = self.get_nb_trainable_parameters()[0]

    def set_value_units(self, value_loc: float, value_scale: float, value_decimals: int | None = None) -> None:
        """Value units of the regression (and of phi's input when `config.standardize_inputs`):
        Y = value_loc + value_scale * Y'. Stored in the config, hence in the saved adapter."""
        if not (math.isfinite(value_loc) and math.isfinite(value_scale) and value_scale > 0):
            raise ValueError(f"value units need a finite value_loc and a finite value_scale > 0, got "
                             f"({value_loc!r}, {value_scale!r})")
        self.causal_config.value_loc, self.causal_config.value_scale = float(value_loc), float(value_scale)
        if value_decimals is not None:
            self.causal_config.value_decimals = int(value_decimals)
        self.action.set_value_units(value_loc, value_scale)

    def value_interval(self, loc_Y: Tensor, scale_Y: Tensor, level: float, *, calibrated: bool = True
                       ) -> tuple[Tensor, Tensor]:
        """(lower, upper) of the central `level` interval of the value, shapes of loc_Y. calibrated=True
        uses the adapter's split-conformal map (`config.value_calibration`) when it has one;
        calibrated=False (or no map) gives the raw Cauchy interval loc_Y -+ tan(pi level / 2) scale_Y."""
        return interval(loc_Y, scale_Y, level, self.causal_config.value_calibration if calibrated else None)

    # ------------------------------------------------------------------ backbone
    def _inject_lora(self) -> None:
        from peft import LoraConfig, inject_adapter_in_model
        from peft.tuners.tuners_utils import cast_adapter_dtype

        s = self.causal_config.lora
        lora_config = LoraConfig(r=s.r, lora_alpha=s.alpha, lora_dropout=s.dropout,
                                 target_modules=lora_module_pattern(self.backbone, list(s.target_modules)),
                                 target_parameters=list(s.target_parameters) or None)
        try:
            torch.manual_seed(self.causal_config.seed)  # peft draws lora_A from the global RNG
            inject_adapter_in_model(lora_config, self.backbone)
        except ValueError as e:  # peft: "Target modules {...} not found in the base model"
            what = f"target_modules {list(s.target_modules)}" + (
                f" / target_parameters {list(s.target_parameters)}" if s.target_parameters else "")
            raise ValueError(f"LoRA {what} do not match the backbone: {e}") from None
        # as peft's get_peft_model: bf16/fp16 LoRA weights become float32 (AdamW, GradScaler need them)
        cast_adapter_dtype(self.backbone, "default", autocast_adapter_dtype=self.causal_config.autocast_adapter_dtype)

    @property
    def config(self):
        """The base model's `PretrainedConfig` (the adapter's config is `causal_config`)."""
        return self.backbone.config

    def add_model_tags(self, tags: str | list[str]) -> None:
        """transformers' model tags (what TRL's trainers add), kept on the base model as on a peft model."""
        self.backbone.add_model_tags(tags)

    @property
    def decoder(self) -> nn.Module:
        """The transformer body (e.g. Qwen3Model, a VL checkpoint's language model): ends with the final norm."""
        return self.backbone.get_decoder()

    @property
    def W_cls(self) -> Tensor:
        """The backbone's lm_head weight [V, H] (tied models: also the input embedding)."""
        return self.backbone.get_output_embeddings().weight

    @property
    def vocab_size(self) -> int:
        # lm_head's out_features: the row count also while FSDP1 holds W_cls as a flat shard (ZeRO-3: its ds_shape)
        W = self.W_cls
        return getattr(self.backbone.get_output_embeddings(), "out_features", None) or getattr(W, "ds_shape", W.shape)[0]

    @property
    def device(self) -> torch.device:
        """The heads' device: lm_head's (W_cls). z, labels and values are moved there."""
        return self.W_cls.device

    @property
    def input_device(self) -> torch.device:
        """The input embedding's device: input_ids, numeric_values and attention_mask go there (with
        `device_map`, the embedding and lm_head may sit on different devices)."""
        return self.backbone.get_input_embeddings().weight.device

    def backbone_needs_grad(self) -> bool:
        """False -> the backbone runs under no_grad (frozen, fixed d): no activations kept."""
        return self.numeric_embedding.direction.requires_grad or any(
            p.requires_grad for p in self.backbone.parameters()
        )

    # ------------------------------------------------------------------ memory
    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: dict | None = None,
                                        **kwargs) -> None:
        """Activation (gradient) checkpointing in the backbone's decoder layers: transformers' own,
        whose default is `use_reentrant=False`. kwargs (e.g. `every_n_layers`, `offload`) go to the
        backbone's method; this is what `transformers.Trainer` calls for `gradient_checkpointing=True`.

        Only a backbone that gets gradients (LoRA, learnable d) keeps activations; a frozen backbone
        with a fixed d runs under no_grad and this changes nothing."""
        backbone = self.backbone
        activation_checkpointing_enable(backbone, activation_checkpointing_kwargs, **kwargs)
        # Reentrant checkpointing gives a segment's LoRA weights no gradient unless the segment's input
        # requires grad; with a frozen embedding and a fixed d it does not. transformers' hook on the
        # embedding output (what peft uses) fixes that; `embed` calls that same module. Some versions
        # install it themselves: one hook is enough.
        if getattr(backbone, "_require_grads_hook", None) is None:
            backbone.enable_input_require_grads()

    def activation_checkpointing_disable(self) -> None:
        """Turn the backbone's activation checkpointing off (the input-grad hook stays: harmless)."""
        activation_checkpointing_disable(self.backbone)

    @property
    def is_activation_checkpointing(self) -> bool:
        return any(getattr(m, "gradient_checkpointing", False) for m in self.backbone.modules())

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None, **kwargs) -> None:
        """peft's / older transformers' name of `activation_checkpointing_enable`."""
        self.activation_checkpointing_enable(gradient_checkpointing_kwargs, **kwargs)

    def gradient_checkpointing_disable(self) -> None:
        self.activation_checkpointing_disable()

    @property
    def is_gradient_checkpointing(self) -> bool:
        return self.is_activation_checkpointing

    # ------------------------------------------------------------------ forward
    def embed(self, input_ids: Tensor, numeric_values: Tensor | None) -> Tensor:
        """e = embed(x) + phi(v): [B, S] -> [B, S, H] in the backbone's dtype. With value units
        set and `standardize_inputs`, phi takes (v - value_loc) / value_scale at <NUM> positions
        (text positions keep v = 0, phi = 0: untouched)."""
        embeds = self.backbone.get_input_embeddings()(input_ids)
        if numeric_values is None:
            return embeds
        if self.causal_config.standardize_inputs and self.causal_config.value_loc is not None:
            wide = torch.promote_types(numeric_values.dtype, torch.float32)
            std = (numeric_values.to(wide) - self.causal_config.value_loc) / self.causal_config.value_scale
            numeric_values = torch.where(input_ids == self.num_token_id, std, torch.zeros_like(std))
        phi = self.numeric_embedding(numeric_values.to(self.numeric_embedding.direction.device))
        return embeds + phi.to(embeds.device, embeds.dtype)  # d sits with the heads, maybe elsewhere

    def check_inputs(self, input_ids: Tensor, numeric_values: Tensor | None, labels: Tensor | None,
                     label_values: Tensor | None, attention_mask: Tensor | None = None,
                     cache: Any = None) -> None:
        """Validate `forward`'s inputs (shapes, dtypes, ids and labels in range); a ValueError names the
        problem. Also used by `generation.generate` on its prompts."""
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(getattr(input_ids, 'shape', ()))}")
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be an integer tensor, got dtype {input_ids.dtype}")
        if input_ids.shape[1] == 0:
            raise ValueError(
                f"input_ids has no positions (shape {tuple(input_ids.shape)}): an empty text encodes to no token; "
                "drop empty texts before batching"
            )
        self._check_placement()
        check_text_only(self.backbone, input_ids)
        emb_device = self.input_device
        for name, t in (("input_ids", input_ids), ("numeric_values", numeric_values), ("labels", labels),
                        ("label_values", label_values), ("attention_mask", attention_mask)):
            # labels and values may also sit with the heads (where the loss moves them)
            if isinstance(t, Tensor) and t.device != emb_device and not (name.startswith("label") and
                                                                        t.device == self.device):
                raise ValueError(f"{name} is on device {t.device} but the model's embedding is on {emb_device}: "
                                 "move the inputs with .to(model.input_device)")
        for name, t in (("numeric_values", numeric_values), ("labels", labels), ("label_values", label_values)):
            if t is not None and t.shape != input_ids.shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)} but input_ids has {tuple(input_ids.shape)}")
        if (attention_mask is not None and cache is None and attention_mask.dim() == 2
                and attention_mask.shape != input_ids.shape):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has "
                             f"{tuple(input_ids.shape)}")
        problems = self._value_problems(input_ids, numeric_values, labels, label_values, attention_mask)
        # one host sync for all of them (each .any() would be one); the details only on failure
        flags = torch.stack([mask.any() for mask, _ in problems]).tolist()
        for (mask, message), bad in zip(problems, flags):
            if bad:
                raise ValueError(message(_first_bad(mask)))

    def _value_problems(self, input_ids: Tensor, numeric_values: Tensor | None, labels: Tensor | None,
                        label_values: Tensor | None, attention_mask: Tensor | None) -> list:
        """[(bad-position mask, index -> error message)] of `check_inputs`' value checks, in order."""
        V, num, ign = self.vocab_size, self.num_token_id, IGNORE_INDEX
        problems = [((input_ids < 0) | (input_ids >= V),
                     lambda i: f"input_ids must be in [0, {V}); got {input_ids[i].item()} at index {i}")]
        for name, t in (("numeric_values", numeric_values), ("label_values", label_values)):
            if t is not None:
                problems.append((~torch.isfinite(t), lambda i, name=name: f"{name} contains NaN or inf (first at index {i})"))
        if numeric_values is not None:
            problems.append(((numeric_values != 0) & (input_ids != num), lambda i: (
                f"numeric_values is non-zero at a position whose token is not <NUM> (id {num}), first at index {i}")))
        if labels is None:
            return problems
        problems.append(((labels != ign) & ((labels < 0) | (labels >= V)), lambda i: (
            f"labels must be -100 or in [0, {V}); got {labels[i].item()} at index {i}")))
        if attention_mask is not None and attention_mask.shape == labels.shape:
            problems.append(((labels != ign) & (attention_mask == 0), lambda i: (
                f"labels has a target ({labels[i].item()}) at index {i} where attention_mask is 0 "
                "(padding): set labels to -100 at padded positions (NumericCollator does)")))
        if label_values is not None:
            problems.append(((label_values != 0) & (labels != ign) & (labels != num), lambda i: (
                f"label_values is non-zero ({label_values[i].item()}) at index {i} whose label "
                f"{labels[i].item()} is not <NUM> (id {num}): label_values must be aligned "
                "with labels (not shifted)")))
        return problems

    def _check_placement(self) -> None:
        """The heads must sit on the device of W_cls and share one dtype (a partial .to() is refused)."""
        W = self.W_cls
        tensors = {"numeric_embedding": self.numeric_embedding.direction, "abduction": self.abduction.loc.weight,
                   "action": self.action.b_cls}
        for name, t in tensors.items():
            if t.device != W.device:
                raise ValueError(f"the adapter's {name} head is on device {t.device} but the backbone's lm_head "
                                 f"(W_cls) is on {W.device}: move the whole CausalModel with .to(device)")
        dtypes = {name: t.dtype for name, t in tensors.items()}
        if len(set(dtypes.values())) > 1:
            raise ValueError(f"the adapter heads have mixed dtypes {dtypes}: cast the whole CausalModel, or none")

    def check_feature_precision(self, z: Tensor) -> None:
        """Warn (once per model) when a value head fitted on float32 features runs on 16-bit ones: `z` [B, S, H]
        16-bit (a bf16 / fp16 base) or computed under 16-bit autocast, while the fit recorded float32 features and
        a bf16 shift above `BF16_MAX_SHIFT` value units (config.value_fit_dtype / value_bf16_shift). Such a head
        reads loc_U differences below bf16's resolution, so its values move by about that shift (an H100 under
        bf16 autocast: test MAE 40x, docs/mixed_precision.md)."""
        cfg = self.causal_config
        if (getattr(self, "_precision_warned", False) or cfg.value_fit_dtype != "float32"
                or not (cfg.value_bf16_shift or 0.0) > BF16_MAX_SHIFT * (cfg.value_scale or 1.0)):
            return
        dev = z.device.type
        half = (torch.bfloat16, torch.float16)
        autocast = torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev) in half
        if z.dtype not in half and not autocast:
            return
        self._precision_warned = True
        where = f"autocast to {torch.get_autocast_dtype(dev)}" if autocast else f"a {z.dtype} base"
        warnings.warn(f"this adapter's value head was fitted on float32 features, and it now runs under {where}: "
                      f"rounding loc_U to 16 bits moves its values by up to {cfg.value_bf16_shift:.4g} "
                      f"(value_scale {cfg.value_scale:.4g}). For values, run the base in float32 without autocast, "
                      "or train with the base in bf16 (the fit then sees the features it will run on; "
                      "docs/mixed_precision.md)", UserWarning, stacklevel=3)

    def forward(
        self,
        input_ids: Tensor,
        numeric_values: Tensor | None = None,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
        label_values: Tensor | None = None,
        *,
        position_ids: Tensor | None = None,
        cache: Any = None,
        use_cache: bool = False,
        past_key_values: Any = None,
        return_scores: bool = False,
        recent_before: Tensor | None = None,
    ) -> CausalOutput:
        """input_ids, numeric_values, attention_mask, labels, label_values: [B, S].

        labels follow transformers: aligned with input_ids (-100 = ignore), shifted inside.
        label_values default to numeric_values (the value of each <NUM> label).
        cache: the backbone's cache (`past_key_values` is its name before transformers 5.24, still taken).
        recent_before: [B, K] the K most recent numbers before input_ids (`heads.recent_values`; a cached
            prefix's), for an adapter whose value head reads them (`recent_values` K > 0); None = none.
        position_ids: [B, S]. Packed rows (`data.packing`): attention_mask None, no cache, position ids that
            restart at 0 where each row begins; transformers then builds the packed-sequence mask (sdpa, eager) or
            runs varlen flash attention, and the value head's recent numbers restart there too.
        """
        if past_key_values is not None:
            if cache is not None:
                raise ValueError("give the cache as `cache` or as `past_key_values`, not both")
            cache = past_key_values
        self.check_inputs(input_ids, numeric_values, labels, label_values, attention_mask, cache)
        if labels is not None and label_values is None:
            label_values = numeric_values
        row_starts = self._packed_row_starts(input_ids, attention_mask, position_ids, cache, use_cache)
        grad_ctx = contextlib.nullcontext() if self.backbone_needs_grad() else torch.no_grad()
        with grad_ctx:
            embeds = self.embed(input_ids, numeric_values)
            if row_starts is not None and embeds.shape[0] > 1 and is_flash_attention(self.decoder):
                # varlen flash attention reads packed rows from the position ids of ONE row only (transformers'
                # `_is_packed_sequence`); with several it would attend across the rows of each: flatten, then unflatten
                B, S = input_ids.shape
                out = self.decoder(inputs_embeds=embeds.reshape(1, B * S, -1),
                                   position_ids=position_ids.expand(B, S).reshape(1, B * S), use_cache=False)
                out.last_hidden_state = out.last_hidden_state.reshape(B, S, -1)
            else:
                out = self.decoder(
                    inputs_embeds=embeds,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    use_cache=use_cache,
                    **cache_kwargs(self.decoder, cache),
                )
        z = out.last_hidden_state
        if not self.training:
            self.check_feature_precision(z)
        # heads and losses in their own dtype whatever autocast the caller runs (bf16 loc_Y near 400 moves in steps of 2)
        with full_precision(z.device):
            loc_U, scale_U = self.abduction(z)
            scale_Up = self.action.noisy_scale(scale_U)
            recent = None
            if self.action.recent_values:
                recent = recent_values(input_ids.to(loc_U.device), None if numeric_values is None
                                       else numeric_values.to(loc_U.device), self.num_token_id,
                                       self.action.recent_values, recent_before,
                                       None if row_starts is None else row_starts.to(loc_U.device))
            loc_Y, scale_Y = self.action.regression(loc_U, scale_Up, recent)
            result = CausalOutput(loc_U=loc_U, scale_U=scale_U, loc_Y=loc_Y, scale_Y=scale_Y, hidden_states=z,
                                  recent=recent, cache=output_cache(out) if use_cache else None)
            if return_scores:
                result.loc_S, result.scale_S = self.action.scores(loc_U, scale_Up, self.W_cls)
            if labels is not None:
                result.loss, result.loss_cls, result.loss_reg = self.loss(loc_U, scale_Up, loc_Y, scale_Y, labels,
                                                                          label_values)
        return result

    def _packed_row_starts(self, input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor | None,
                           cache: Any, use_cache: bool) -> Tensor | None:
        """[B, S] bool, True where a packed row begins, for a packed batch; None for any other input (whose
        forward is then exactly the unpacked one). Packed = what transformers reads as packed rows: no
        attention_mask, 2-D position_ids, no cache (its mask code checks the same three)."""
        if attention_mask is not None or position_ids is None or position_ids.dim() != 2 or cache is not None \
                or use_cache:
            return None
        starts = packed_row_starts(position_ids).expand(input_ids.shape)
        if has_linear_attention(self.decoder) and bool(starts.any()):
            # their recurrent layers would carry one row's state into the next (the varlen kernels need
            # cu_seqlens / seq_idx, which this forward does not pass)
            raise ValueError(f"packed rows are not supported for {family_name(self.backbone)}: its linear-attention "
                             "layers carry their state across rows; train it unpacked (no packing / padding_free)")
        return starts

    def loss(self, loc_U: Tensor, scale_Up: Tensor, loc_Y: Tensor, scale_Y: Tensor, labels: Tensor,
             label_values: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """L = L_cls + lambda L_reg over positions predicting labels[:, 1:] (SPEC 3)."""
        labels = labels.to(loc_U.device)[:, 1:].reshape(-1)  # to the heads' device (device_map splits)
        keep = labels != IGNORE_INDEX  # ignored rows never enter the heads' loss
        labels = labels[keep]
        C = loc_U.shape[-1]
        loc_U = loc_U[:, :-1].reshape(-1, C)[keep]
        scale_Up = scale_Up[:, :-1].reshape(-1, C)[keep]
        loc_Y, scale_Y = loc_Y[:, :-1].reshape(-1)[keep], scale_Y[:, :-1].reshape(-1)[keep]
        if label_values is not None:
            label_values = label_values.to(loc_U.device)
        if label_values is None:
            values = torch.zeros_like(loc_Y)
        elif label_values.dtype == torch.float64 and loc_Y.dtype != torch.float64:
            # float64 targets may exceed the float32 range (1e300): the regression runs in float64
            values = label_values[:, 1:].reshape(-1)[keep]
            loc_Y, scale_Y = loc_Y.double(), scale_Y.double()
        else:
            # at least float32: under bf16 autocast loc_Y is bf16, whose range ends below float32's max
            values = label_values[:, 1:].reshape(-1)[keep].to(torch.promote_types(loc_Y.dtype, torch.float32))
        act = self.action
        ovr = fused_ovr_loss if self.causal_config.fused_loss else reference_ovr_loss
        loss_cls = ovr(loc_U, scale_Up, self.W_cls, act.b_cls, act.thresholds, labels,
                       row_override=act.row_override(), scale_floor=act.scale_floor)
        k = self.num_token_id
        p_num = num_probability(loc_U, scale_Up, act.num_weight(self.W_cls), act.b_cls[k], act.num_threshold(),
                                scale_floor=act.scale_floor)
        loss_reg = gated_regression_loss(loc_Y, scale_Y, values, labels, k, p_num, self.causal_config.alpha)
        loss_reg = loss_reg.to(loss_cls.dtype)
        return total_loss(loss_cls, loss_reg, self.causal_config.reg_weight), loss_cls, loss_reg

    # ------------------------------------------------------------------ parameters
    def adapter_state_dict(self, lora: bool = True) -> dict[str, Tensor]:
        """Only the adapter's tensors: heads, d, b_cls, the <NUM> row, fixed buffers, LoRA (`lora=False`:
        without it, for a wrapper that gathers the LoRA itself: `saving.fsdp`)."""
        state = {}
        for name in ("numeric_embedding", "abduction", "action"):
            for k, v in getattr(self, name).state_dict().items():
                state[f"{name}.{k}"] = v
        if lora and self.causal_config.lora is not None:
            from peft import get_peft_model_state_dict

            tensors = get_peft_model_state_dict(self.backbone, save_embedding_layers=False)
            state.update({LORA_PREFIX + k: v for k, v in tensors.items()})
        return state

    def load_adapter_state_dict(self, state: dict[str, Tensor]) -> None:
        """Strict: every adapter tensor must be present with its shape; nothing else may be."""
        expected = self.adapter_state_dict()
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        if missing or unexpected:
            raise ValueError(f"adapter tensors do not match this model: missing {missing[:8]}, unexpected {unexpected[:8]}")
        # adapters written before the 1-element scalars (b_reg, b_noise_Y, a scalar threshold) hold them 0-d
        state = {k: t.reshape(1) if t.dim() == 0 and expected[k].shape == (1,) else t for k, t in state.items()}
        for k, v in expected.items():
            if state[k].shape != v.shape:
                raise ValueError(f"adapter tensor {k!r} has shape {tuple(state[k].shape)}, the model expects {tuple(v.shape)}")
        heads = {k: v for k, v in state.items() if not k.startswith(LORA_PREFIX)}
        with torch.no_grad():
            for name in ("numeric_embedding", "abduction", "action"):
                sub = {k[len(name) + 1:]: v for k, v in heads.items() if k.startswith(name + ".")}
                getattr(self, name).load_state_dict(sub, strict=True)
        if self.causal_config.lora is not None:
            from peft import set_peft_model_state_dict

            lora = {k[len(LORA_PREFIX):]: v for k, v in state.items() if k.startswith(LORA_PREFIX)}
            result = set_peft_model_state_dict(self.backbone, lora)
            bad = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
            if bad:
                raise ValueError(f"LoRA tensors not found in the backbone: {bad[:8]}")

    def trainable_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.named_parameters() if p.requires_grad]

    def get_nb_trainable_parameters(self) -> tuple[int, int]:
        """(trainable, all) parameter counts; the shared W_cls is counted once."""
        trainable = sum(p.numel() for _, p in self.trainable_parameters())
        total = sum(p.numel() for p in self.parameters())  # parameters() deduplicates tied/shared tensors
        return trainable, total

    def print_trainable_parameters(self) -> None:
        trainable, total = self.get_nb_trainable_parameters()
        print(f"trainable params: {trainable:,d} || all params: {total:,d} || trainable%: {100 * trainable / total:.4f}")

    # ------------------------------------------------------------------ artifacts
    def adapter_metadata(self) -> dict[str, Any]:
        bc = self.backbone.config
        return {
            "format_version": FORMAT_VERSION,
            "library": "causal_adapter",
            "library_version": __version__,
            "adapter_config": self.causal_config.to_dict(),
            "base_model_name_or_path": getattr(self.backbone, "name_or_path", None) or getattr(bc, "_name_or_path", None),
            "model_type": family_name(self.backbone),
            "hidden_size": text_config(self.backbone).hidden_size,
            "vocab_size": self.vocab_size,
            "num_token_id": self.num_token_id,
            "tie_word_embeddings": bool(getattr(bc, "tie_word_embeddings", False)),
        }

    def save_pretrained(self, save_directory: str | os.PathLike, *, metrics: dict | None = None,
                        is_main_process: bool = True, state_dict: dict | None = None,
                        adapter_tensors: dict[str, Tensor] | None = None, **kwargs) -> Path:
        """Write causal_adapter_config.json + causal_adapter_model.safetensors (adapter tensors only),
        a model card (README.md, with `metrics` when given) and, with LoRA, peft's LoRA adapter files,
        atomically. `adapter_tensors`: `adapter_state_dict()` gathered whole, for a sharded model (FSDP:
        `saving.fsdp.full_adapter_state_dict`). `is_main_process=False` writes nothing (transformers' convention); kwargs:
        `safe_serialization=True` only (always safetensors), `push_to_hub=True` + `repo_id=`."""
        if state_dict is not None:
            raise ValueError("save_pretrained writes the adapter's own tensors; a state_dict argument is not supported")
        if not kwargs.pop("safe_serialization", True):
            raise ValueError("causal_adapter always writes safetensors (safe_serialization=False is not supported)")
        push, repo_id = kwargs.pop("push_to_hub", False), kwargs.pop("repo_id", None)
        if kwargs:
            raise TypeError(f"save_pretrained got unexpected arguments {sorted(kwargs)}")
        if not is_main_process:
            return Path(save_directory)
        meta = self.adapter_metadata()
        # with LoRA, its tensors live in peft's adapter_model.safetensors only (write_extra_files): one copy each
        state = adapter_tensors if adapter_tensors is not None else self.adapter_state_dict()
        tensors = {k: v for k, v in state.items() if not k.startswith(LORA_PREFIX)}
        lora = {k[len(LORA_PREFIX):]: v for k, v in state.items() if k.startswith(LORA_PREFIX)}

        def write(tmp: Path) -> None:
            write_adapter_files(tmp, meta, tensors)
            write_extra_files(tmp, self, metrics, final_directory=str(save_directory), lora_tensors=lora)

        path = atomic_write_dir(save_directory, write)
        if push:
            push_to_hub(self, repo_id or Path(save_directory).name, metrics=metrics)
        return path

    @classmethod
    def from_pretrained(cls, base_model: nn.Module | str | os.PathLike | None, adapter_dir: str | os.PathLike,
                        tokenizer=None, *, is_trainable: bool = False, torch_dtype=None, dtype=None, device_map=None,
                        revision: str | None = None, token: str | bool | None = None, cache_dir=None,
                        local_files_only: bool = False, **base_model_kwargs) -> "CausalModel":
        """Attach a saved adapter to `base_model` (an untouched Qwen checkpoint). Refuses a base whose
        model type, hidden size, vocabulary rows or <NUM> id differ from the adapter's, naming both.

        base_model: a *ForCausalLM module, a local path or hub name (AutoModelForCausalLM with
        `torch_dtype`/`dtype`, `device_map` and `base_model_kwargs`), or None (the base recorded in the
        adapter). adapter_dir: a local directory or a hub repo id (`revision`, `token`, `cache_dir`).
        Like peft, the model is loaded for inference (eval mode, no parameter requires grad) unless
        `is_trainable=True` (train mode, the adapter's parameters trainable as `get_causal_model` sets them).
        """
        if torch_dtype is not None and dtype is not None:
            raise ValueError("give torch_dtype or dtype, not both")
        adapter_dir = resolve_adapter_source(adapter_dir, revision=revision, token=token, cache_dir=cache_dir,
                                             local_files_only=local_files_only)
        meta, tensors = read_adapter_tensors(adapter_dir)
        base_model = load_base_model(base_model, meta, dtype=dtype if dtype is not None else torch_dtype,
                                     device_map=device_map, **base_model_kwargs)
        bc = base_model.config
        rows = base_model.get_output_embeddings().weight.shape[0]
        H = text_config(base_model).hidden_size
        for key, base_value in (("model_type", family_name(base_model)), ("hidden_size", H), ("vocab_size", rows)):
            if meta.get(key) != base_value:
                raise ValueError(
                    f"adapter {str(adapter_dir)!r} was made for {key}={meta.get(key)!r}, but the base model has "
                    f"{key}={base_value!r}"
                )
        num_id = meta["num_token_id"]
        if tokenizer is not None and len(tokenizer) != num_id:
            raise ValueError(
                f"adapter {str(adapter_dir)!r} uses num_token_id={num_id}, but this tokenizer's first reserved row "
                f"is len(tokenizer)={len(tokenizer)}: the adapter was made for another tokenizer"
            )
        saved = dict(meta["adapter_config"])
        # adapters written before value units existed: raw units, the seeds' shared scale, unit d
        saved.setdefault("regression_scale", "shared")
        saved.setdefault("direction_norm", 1.0)
        config = CausalAdapterConfig.from_dict({**saved, "num_token_id": num_id})
        model = get_causal_model(base_model, config)
        model.load_adapter_state_dict(tensors)
        if not is_trainable:
            model.requires_grad_(False)
            model.eval()
        return model

    # ------------------------------------------------------------------ generation
    def generate(self, *args, **kwargs):
        """See causal_adapter.modeling.generation.generate (modes: softmax, deterministic, causal)."""
        return generate(self, *args, **kwargs)

    def generate_batched(self, prompts: str | list[str], tokenizer, batch_size: int = 16, **kwargs):
        """`generate` over many text prompts, `batch_size` at a time (sorted by length, left padded): one
        GenerationOutput per prompt, in order, each as generating it alone gives it
        (causal_adapter.modeling.generation.generate_batched)."""
        return generate_batched(self, prompts, tokenizer=tokenizer, batch_size=batch_size, **kwargs)

    def predict_values(self, prompts: str | list[str], tokenizer=None, levels: tuple[float, ...] = (0.5, 0.9),
                       batch_size: int = 16, progress=None) -> list[dict[str, Any]]:
        """The value predicted after each prompt (loc_Y at its last position) with its calibrated
        intervals per level, scale_Y and P(<NUM>); one forward per batch (causal_adapter.modeling.prediction).
        tokenizer=None: the base's own tokenizer, found offline at its name_or_path."""
        if tokenizer is None:
            tokenizer = _offline_tokenizer(getattr(self.backbone, "name_or_path", None))
        return predict_values(self, prompts, tokenizer=tokenizer, levels=levels, batch_size=batch_size,
                              progress=progress)

    # ------------------------------------------------------------------ peft / hub conventions
    def merge_and_unload(self, safe_merge: bool = True) -> "CausalModel":
        """Merge the LoRA weights into the backbone (peft's merge) and drop the LoRA layers: the same
        outputs (float tolerance) from a plain backbone + the heads. In place; returns self (config.lora
        becomes None; save the merged backbone with `model.backbone.save_pretrained` to keep it)."""
        return merge_lora(self, merge=True, safe_merge=safe_merge)

    def unload(self) -> "CausalModel":
        """Drop the LoRA layers without merging: the original base backbone + the heads. In place."""
        return merge_lora(self, merge=False)

    def disable_adapter(self):
        """Context manager: inside, the backbone runs without its LoRA (outputs equal the base's);
        the heads stay. A frozen backbone is the base already (no-op)."""
        return disable_lora(self)

    def push_to_hub(self, repo_id: str, **kwargs) -> str:
        """Upload the adapter (the files of save_pretrained) to the Hub repo `repo_id` (huggingface_hub);
        kwargs: private, token, revision, commit_message, metrics. Offline: one-line OSError."""
        return push_to_hub(self, repo_id, **kwargs)


def _median_row_norm(weight: Tensor) -> float:
    """Median L2 norm of the embedding rows (reserved all-zero rows do not pull it to 0)."""
    w = weight.detach()
    if w.is_meta:  # shapes only (size computations): any norm will do
        return 1.0
    norms = torch.cat([w[i:i + 16384].float().norm(dim=1) for i in range(0, w.shape[0], 16384)])  # no V x H copy
    norms = norms[norms > 0]
    return float(norms.median()) if norms.numel() else 1.0


def _first_bad(mask: Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])


def get_causal_model(qwen_model: nn.Module, config: CausalAdapterConfig | None = None, *,
                     tokenizer=None) -> CausalModel:
    """Wrap a Qwen `*ForCausalLM` of any family in `causal_adapter.modeling.families` (dense, MoE, hybrid
    linear attention; any dtype, tied or untied) or the language model of a Qwen3.5
    `*ForConditionalGeneration` (text only) with the causal heads.

    The backbone is frozen (or gets LoRA through peft when `config.lora` is set; the default
    `target_modules` become the family's defaults). At return, `loc_S` equals the base model's
    logits for every position and every vocabulary row.
    """
    config = config or CausalAdapterConfig()
    check_supported(qwen_model)
    check_unquantized_heads(qwen_model)
    config = resolve_lora_settings(qwen_model, config)
    num_id = resolve_num_token_id(qwen_model, config, tokenizer)
    return CausalModel(qwen_model, config, num_id)
