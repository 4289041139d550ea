"""CausalModel: a Qwen backbone (frozen or LoRA through peft) plus the causal heads.

    input_ids, numeric_values --embed + phi(v)--> inputs_embeds --backbone + final norm--> z
    z --AbductionHead--> (loc_U, scale_U) --ActionHead--> OvR scores (loc_S, scale_S), (loc_Y, scale_Y)

One `forward` holds embedding, backbone, heads and loss (what DDP needs). Several adapters may share the
backbone (peft's `load_adapter` / `set_adapter`: `model.adapters`); the attributes `causal_config`,
`numeric_embedding`, `abduction`, `action` are always the active adapter's. Saving and loading live in
`saving.adapter_io`; the checks on the base and on the inputs in `model.checks`.
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
from ..config import IGNORE_INDEX, CausalAdapterConfig
from ..modeling.families import (
    family_name,
    has_linear_attention,
    is_flash_attention,
    lora_module_pattern,
    resolve_lora_settings,
    text_config,
)
from ..modeling.generation import generate, generate_batched
from ..modeling.heads import AbductionHead, ActionHead, full_precision
from ..modeling.numeric_embedding import NumericEmbedding
from ..modeling.recent_numbers import packed_row_starts, recent_values
from ..modeling.intervals import interval
from ..modeling.loss import fused_ovr_loss, gated_regression_loss, num_probability, reference_ovr_loss, total_loss
from ..modeling.horizon import predict_horizon
from ..modeling.prediction import predict_values
from ..modeling.series import series_log_rows
from ..modeling.value_transform import ValueMap, value_map_of
from ..saving import adapter_io
from ..saving.hub import push_to_hub
from ..saving.peft_lora import disable_lora, merge_lora
from ..saving.quantization import prepare_quantized_for_training
from . import adapters
from .checks import (
    check_feature_precision,
    check_inputs,
    check_placement,
    check_supported,
    check_unquantized_heads,
    offline_tokenizer,
    resolve_num_token_id,
)


@dataclass
class CausalOutput(ModelOutput):
    """Shapes: B batch, S sequence, C causal size, V vocabulary rows.

    loss, loss_cls, loss_reg: scalars (None without labels). loc_U, scale_U: [B, S, C]
    (scale_U without the exogenous noise; scale_U' = scale_U + |b_noise|). loc_Y, scale_Y: [B, S].
    loc_S, scale_S: [B, S, V], only with `return_scores=True`. hidden_states: z [B, S, H].
    recent: [B, S, K] the raw values of the K most recent numbers the value head read (NaN = none), with
    `recent_values` K > 0. value_log: [B, S] bool, a "series" head's positions on log y (loc_Y, scale_Y there are
    on log y; `modeling.value_transform`), None for any other head.
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
    value_log: Tensor | None = None

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


class CausalModel(nn.Module):
    """The wrapped model. Build it with `get_causal_model` or `CausalModel.from_pretrained`.

    As on a peft `PeftModel`, `model.config` is the base model's `PretrainedConfig` (what transformers,
    accelerate's DeepSpeed integration and TRL read); the adapter's own `CausalAdapterConfig` is
    `model.causal_config`.
    """

    def __init__(self, backbone: nn.Module, config: CausalAdapterConfig, num_token_id: int,
                 adapter_name: str = adapters.DEFAULT_ADAPTER):
        super().__init__()
        check_supported(backbone)
        check_unquantized_heads(backbone)
        # one layout that trains for a 4-bit base, evaluated or not, on any CPU (saving/quantization.py)
        prepare_quantized_for_training(backbone)
        self.num_token_id = num_token_id
        self.backbone = backbone
        for p in backbone.parameters():
            p.requires_grad_(False)
        # adapters loaded but not active (`load_adapter`): registered, so they move with the model (.to, dtype)
        self.parked_adapters = nn.ModuleDict()
        self._parked_configs: dict[str, CausalAdapterConfig] = {}
        self._adapter_order: list[str] = []
        self.add_adapter_heads(config, adapter_name)
        # the adapter's size as built (print_trainable_parameters now); freezing or loading for inference
        # changes requires_grad later, the card reports this
        self.trainable_at_init = self.get_nb_trainable_parameters()[0]

    def add_adapter_heads(self, config: CausalAdapterConfig, adapter_name: str) -> None:
        """Build a fresh adapter (heads initialised from `config.seed`: at init the model is the base) and make it
        the active one under `adapter_name`, its LoRA injected through peft when `config.lora` is set. The adapter
        active before must be parked first (`model.adapters`)."""
        adapters.check_adapter_name(adapter_name)
        backbone = self.backbone
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
        self.causal_config = config
        self._active_adapter = adapter_name
        self._adapter_order.append(adapter_name)
        num_token_id = self.num_token_id
        # Everything random comes from config.seed; the caller's RNG streams are left as they
        # were (module constructors and peft's lora_A init draw from the global RNG).
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            if config.lora is not None:
                self._inject_lora(adapter_name)
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
                recent_window=config.recent_window,
                row_net_members=config.value_row_net, row_net_hidden=config.value_row_net_hidden,
                row_scale=config.value_row_scale,
            )
        self.action.set_value_map(value_map_of(config))
        if config.value_loc is not None:
            self.set_value_units(config.value_loc, config.value_scale)
        else:  # a head on log y may have its units there without value units (set_value_transform alone)
            self._set_head_units()
        self.action.set_row_units(config.value_row_units, config.value_width_power)

    def set_value_units(self, value_loc: float, value_scale: float, value_decimals: int | None = None) -> None:
        """Value units of the regression (and of phi's input when `config.standardize_inputs`):
        Y = value_loc + value_scale * Y'. Stored in the config, hence in the saved adapter."""
        if not (math.isfinite(value_loc) and math.isfinite(value_scale) and value_scale > 0):
            raise ValueError(f"value units need a finite value_loc and a finite value_scale > 0, got "
                             f"({value_loc!r}, {value_scale!r})")
        self.causal_config.value_loc, self.causal_config.value_scale = float(value_loc), float(value_scale)
        if value_decimals is not None:
            self.causal_config.value_decimals = int(value_decimals)
        self._set_head_units()

    def set_value_transform(self, transform: str, log_units: tuple[float, float] | None = None,
                            positive: bool | None = None, value_range: tuple[float, float] | None = None) -> None:
        """The scale the value's Cauchy lives on (`modeling.value_transform`: "identity", "log" or "series"), the
        head's units on log y [loc, scale] under "log" (and "series", for its rows there), whether the quantity is positive and the training values' [min, max]
        (`config.value_range`; None: as they are). Stored in the config, hence in the saved adapter."""
        cfg = self.causal_config
        if transform == "log" and log_units is None:
            raise ValueError("value_transform 'log' needs the head's units on log y (log_units)")
        cfg.value_transform = transform
        keep_log = transform in ("log", "series") and log_units is not None  # "series": for its rows on log y
        cfg.value_log_units = [float(log_units[0]), float(log_units[1])] if keep_log else None
        if positive is not None:
            cfg.value_positive = bool(positive)
        if value_range is not None:
            cfg.value_range = [float(value_range[0]), float(value_range[1])]
            cfg.validate()
        self.action.set_value_map(value_map_of(cfg))
        self._set_head_units()

    def _set_head_units(self) -> None:
        """The head's units: the value's (value_loc, value_scale), or under "log" those on log y."""
        cfg = self.causal_config
        if cfg.value_transform == "log" and cfg.value_log_units is not None:
            self.action.set_head_units(*cfg.value_log_units)
        elif cfg.value_loc is not None:
            self.action.set_head_units(cfg.value_loc, cfg.value_scale,
                                       cfg.value_log_units if cfg.value_transform == "series" else None)

    @property
    def value_map(self) -> ValueMap:
        """The scale of the value head's Cauchy (`modeling.value_transform.ValueMap`): `value_map.to_value(loc_Y)`
        is the point value (the median)."""
        return self.action.value_map

    def set_row_units(self, rule: str | None, width_power: float = 0.0) -> None:
        """Per-row value units by `rule` ("last", "median", "season"; `modeling.row_units`) or None (the adapter's units),
        the width's exponent `width_power` (`row_units.row_width`). Stored in the config, hence in the saved
        adapter."""
        self.action.set_row_units(rule, width_power)
        self.causal_config.value_row_units = rule
        self.causal_config.value_width_power = float(width_power) if rule is not None else 0.0

    def value_interval(self, loc_Y: Tensor, scale_Y: Tensor, level: float, *, calibrated: bool = True,
                       value_map: ValueMap | None = None) -> tuple[Tensor, Tensor]:
        """(lower, upper) of the central `level` interval of the value, shapes of loc_Y. calibrated=True
        uses the adapter's split-conformal map (`config.value_calibration`) when it has one;
        calibrated=False (or no map) gives the raw Cauchy interval loc_Y -+ tan(pi level / 2) scale_Y; either mapped
        to the value by `value_map` (exp of the log interval under "log"; default the adapter's, a "series" head's
        rows: `ValueMap.rows`)."""
        return interval(loc_Y, scale_Y, level, self.causal_config.value_calibration if calibrated else None,
                        value_map or self.value_map)

    # ------------------------------------------------------------------ backbone
    def _inject_lora(self, adapter_name: str) -> None:
        from peft import LoraConfig, inject_adapter_in_model
        from peft.tuners.tuners_utils import cast_adapter_dtype

        s = self.causal_config.lora
        lora_config = LoraConfig(r=s.r, lora_alpha=s.alpha, lora_dropout=s.dropout,
                                 target_modules=lora_module_pattern(self.backbone, list(s.target_modules)),
                                 target_parameters=list(s.target_parameters) or None)
        try:
            torch.manual_seed(self.causal_config.seed)  # peft draws lora_A from the global RNG
            with warnings.catch_warnings():  # a second LoRA on the backbone is what load_adapter means to do
                warnings.filterwarnings("ignore", message=".*multiple adapters.*")
                inject_adapter_in_model(lora_config, self.backbone, adapter_name=adapter_name)
        except ValueError as e:  # peft: "Target modules {...} not found in the base model"
            what = f"target_modules {list(s.target_modules)}" + (
                f" / target_parameters {list(s.target_parameters)}" if s.target_parameters else "")
            raise ValueError(f"LoRA {what} do not match the backbone: {e}") from None
        # as peft's get_peft_model: bf16/fp16 LoRA weights become float32 (AdamW, GradScaler need them)
        cast_adapter_dtype(self.backbone, adapter_name, autocast_adapter_dtype=self.causal_config.autocast_adapter_dtype)

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
        problem (`model.checks.check_inputs`). Also used by `generation.generate` on its prompts."""
        check_inputs(self, input_ids, numeric_values, labels, label_values, attention_mask, cache)

    def _check_placement(self) -> None:
        check_placement(self)

    def check_feature_precision(self, z: Tensor) -> None:
        """Warn once when a value head fitted on float32 features runs on 16-bit ones (`model.checks`)."""
        check_feature_precision(self, z)

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
        value_log: Tensor | None = None,
    ) -> CausalOutput:
        """input_ids, numeric_values, attention_mask, labels, label_values: [B, S].

        labels follow transformers: aligned with input_ids (-100 = ignore), shifted inside.
        label_values default to numeric_values (the value of each <NUM> label).
        cache: the backbone's cache (`past_key_values` is its name before transformers 5.24, still taken).
        recent_before: [B, W] the W most recent numbers before input_ids (`recent_numbers.recent_values`; a cached
            prefix's; W = `recent_window`), for an adapter whose value head reads them (`recent_values` K > 0);
            None = none.
        value_log: [B] or [B, S] bool, a "series" head's rows on log y (`modeling.value_transform`): None = from
            each row's text and the adapter's `value_series` (`series.series_log_rows`); needed with a cache, whose
            prefix this forward does not see.
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
                                       self.action.recent_window, recent_before,
                                       None if row_starts is None else row_starts.to(loc_U.device))
            log_rows = self.log_rows(input_ids, numeric_values, attention_mask, row_starts, cache, value_log)
            loc_Y, scale_Y = self.action.regression(loc_U, scale_Up, recent,
                                                    None if log_rows is None else log_rows.to(loc_U.device))
            result = CausalOutput(loc_U=loc_U, scale_U=scale_U, loc_Y=loc_Y, scale_Y=scale_Y, hidden_states=z,
                                  recent=recent, cache=output_cache(out) if use_cache else None, value_log=log_rows)
            if return_scores:
                result.loc_S, result.scale_S = self.action.scores(loc_U, scale_Up, self.W_cls)
            if labels is not None:
                result.loss, result.loss_cls, result.loss_reg = self.loss(loc_U, scale_Up, loc_Y, scale_Y, labels,
                                                                          label_values, log_rows)
        return result

    def log_rows(self, input_ids: Tensor, numeric_values: Tensor | None, attention_mask: Tensor | None,
                 row_starts: Tensor | None, cache: Any, value_log: Tensor | None) -> Tensor | None:
        """[B, S] bool: a "series" head's positions on log y (`forward`'s value_log); None for any other head."""
        if not self.action.value_map.series:
            return None
        if value_log is not None:
            value_log = value_log.bool()
            return value_log.unsqueeze(-1).expand(input_ids.shape) if value_log.dim() == 1 else value_log
        if cache is not None and cache.get_seq_length() > 0:
            raise ValueError("a 'series' value head needs value_log (the rows on log y) for a cached step: the "
                             "rows' text before it is not in input_ids")
        return series_log_rows(input_ids.cpu(), None if numeric_values is None else numeric_values.cpu(),
                               self.num_token_id, self.causal_config.value_series,
                               None if attention_mask is None else attention_mask.cpu(),
                               None if row_starts is None else row_starts.cpu())

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
             label_values: Tensor | None, log_rows: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
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
        offset = None
        if act.value_map.log:  # the Cauchy lives on log y (a value <= 0 there: the smallest positive float's log)
            values = values.clamp_min(torch.finfo(values.dtype).tiny).log()
            offset = values  # NLL(y) = NLL(log y) + log y
        elif log_rows is not None:  # a "series" head: the rows of a positive series on log y, the others on y
            on_log = log_rows.to(values.device)[:, :-1].reshape(-1)[keep]
            logs = values.clamp_min(torch.finfo(values.dtype).tiny).log()
            values, offset = torch.where(on_log, logs, values), torch.where(on_log, logs, torch.zeros_like(logs))
        loss_reg = gated_regression_loss(loc_Y, scale_Y, values, labels, k, p_num, self.causal_config.alpha, offset)
        loss_reg = loss_reg.to(loss_cls.dtype)
        return total_loss(loss_cls, loss_reg, self.causal_config.reg_weight), loss_cls, loss_reg

    # ------------------------------------------------------------------ parameters
    def adapter_state_dict(self, lora: bool = True) -> dict[str, Tensor]:
        """Only the active adapter's tensors: heads, d, b_cls, the <NUM> row, fixed buffers, LoRA (`lora=False`:
        without it, for a wrapper that gathers the LoRA itself: `saving.fsdp`)."""
        return adapter_io.adapter_state_dict(self, lora)

    def load_adapter_state_dict(self, state: dict[str, Tensor]) -> None:
        """Into the active adapter. Strict: every adapter tensor must be present with its shape; nothing else may be."""
        adapter_io.load_adapter_state_dict(self, state)

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
        return adapter_io.adapter_metadata(self)

    def save_pretrained(self, save_directory: str | os.PathLike, *, metrics: dict | None = None,
                        is_main_process: bool = True, state_dict: dict | None = None,
                        adapter_tensors: dict[str, Tensor] | None = None, **kwargs) -> Path:
        """Write the active adapter: causal_adapter_config.json + causal_adapter_model.safetensors (adapter tensors
        only), a model card (README.md, with `metrics` when given) and, with LoRA, peft's LoRA adapter files,
        atomically (`saving.adapter_io.save_adapter`). `adapter_tensors`: `adapter_state_dict()` gathered whole, for
        a sharded model (FSDP: `saving.fsdp.full_adapter_state_dict`). `is_main_process=False` writes nothing
        (transformers' convention); kwargs: `safe_serialization=True` only (always safetensors), `push_to_hub=True`
        + `repo_id=`."""
        return adapter_io.save_adapter(self, save_directory, metrics=metrics, is_main_process=is_main_process,
                                       state_dict=state_dict, adapter_tensors=adapter_tensors, **kwargs)

    @classmethod
    def from_pretrained(cls, base_model: nn.Module | str | os.PathLike | None, adapter_dir: str | os.PathLike,
                        tokenizer=None, *, adapter_name: str = adapters.DEFAULT_ADAPTER, is_trainable: bool = False,
                        **kwargs) -> "CausalModel":
        """Attach a saved adapter to `base_model` (an untouched Qwen checkpoint), under the name `adapter_name`
        (peft's; more adapters join with `load_adapter`). Refuses a base whose model type, hidden size,
        vocabulary rows or <NUM> id differ from the adapter's, naming both.

        base_model: a *ForCausalLM module, a local path or hub name (AutoModelForCausalLM with
        `torch_dtype`/`dtype`, `device_map` and further kwargs), or None (the base recorded in the
        adapter). adapter_dir: a local directory or a hub repo id (`revision`, `token`, `cache_dir`,
        `local_files_only`). Like peft, the model is loaded for inference (eval mode, no parameter requires grad)
        unless `is_trainable=True` (train mode, the adapter's parameters trainable as `get_causal_model` sets them).
        """
        base_model, config, tensors = adapter_io.open_adapter(base_model, adapter_dir, tokenizer, **kwargs)
        model = get_causal_model(base_model, config, adapter_name=adapter_name)
        model.load_adapter_state_dict(tensors)
        if not is_trainable:
            model.requires_grad_(False)
            model.eval()
        return model

    # ------------------------------------------------------------------ several adapters (peft's names)
    def load_adapter(self, adapter_dir: str | os.PathLike, adapter_name: str, tokenizer=None, *,
                     is_trainable: bool = False, **hub_kwargs) -> None:
        """Load another saved adapter onto this model's base under `adapter_name`, with the checks of
        `from_pretrained` (and the <NUM> id of the adapters already loaded). The active adapter stays active:
        `set_adapter(adapter_name)` switches. Its heads, number layout, value-head fit and calibration come with
        it; its LoRA (if any) joins the backbone through peft's multi-adapter layers: the base is shared, each
        adapter costs its own tensors. hub_kwargs: `revision`, `token`, `cache_dir`, `local_files_only`."""
        adapters.load_adapter(self, adapter_dir, adapter_name, tokenizer, is_trainable=is_trainable, **hub_kwargs)

    def set_adapter(self, adapter_name: str) -> None:
        """Make a loaded adapter the active one: its heads, config and LoRA run from now on (peft's name)."""
        adapters.set_adapter(self, adapter_name)

    def delete_adapter(self, adapter_name: str) -> None:
        """Drop a loaded adapter and free its tensors. Deleting the active one activates the first other
        adapter; the last one cannot be deleted."""
        adapters.delete_adapter(self, adapter_name)

    @property
    def active_adapter(self) -> str:
        """The name of the adapter that runs (peft's; "default" unless named otherwise)."""
        return self._active_adapter

    @property
    def active_adapters(self) -> list[str]:
        return [self._active_adapter]

    @property
    def adapter_names(self) -> list[str]:
        """Every loaded adapter's name, in load order."""
        return list(self._adapter_order)

    @property
    def causal_configs(self) -> dict[str, CausalAdapterConfig]:
        """Every loaded adapter's config by name (as peft's `peft_config`); `causal_config` is the active one's."""
        return {n: self.causal_config if n == self._active_adapter else self._parked_configs[n]
                for n in self._adapter_order}

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
            tokenizer = offline_tokenizer(getattr(self.backbone, "name_or_path", None))
        return predict_values(self, prompts, tokenizer=tokenizer, levels=levels, batch_size=batch_size,
                              progress=progress)

    def predict_horizon(self, prompts: str | list[str], tokenizer=None, horizon: int = 1, paths: int = 100,
                        levels: tuple[float, ...] | None = (0.5, 0.9), continuations=None, seed: int | None = 0,
                        batch_size: int = 16, individual: str | None = None, progress=None) -> list[dict[str, Any]]:
        """The next `horizon` values after each prompt, each with its intervals: `predict_values`' row of each prompt
        with ``horizon``, H dicts ``{"step", "value", "lower_50", "upper_50", ...}``. Step 1 is `predict_values`'
        row exactly; steps >= 2 the deterministic path (each value fed back) with intervals from `paths` causal
        sampling paths sharing the prompt's one prefill, calibrated per step on validation (`train()`).
        `continuations`: per prompt, the H - 1 texts written before values 2..H (known future labels), or None (the
        model writes them). tokenizer=None: the base's own, offline (causal_adapter.modeling.horizon)."""
        if tokenizer is None:
            tokenizer = offline_tokenizer(getattr(self.backbone, "name_or_path", None))
        return predict_horizon(self, prompts, tokenizer=tokenizer, horizon=horizon, paths=paths, levels=levels,
                               continuations=continuations, seed=seed, batch_size=batch_size, individual=individual,
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


def get_causal_model(qwen_model: nn.Module, config: CausalAdapterConfig | None = None, *,
                     tokenizer=None, adapter_name: str = adapters.DEFAULT_ADAPTER) -> CausalModel:
    """Wrap a Qwen `*ForCausalLM` of any family in `causal_adapter.modeling.families` (dense, MoE, hybrid
    linear attention; any dtype, tied or untied) or the language model of a Qwen3.5
    `*ForConditionalGeneration` (text only) with the causal heads.

    The backbone is frozen (or gets LoRA through peft when `config.lora` is set; the default
    `target_modules` become the family's defaults). `adapter_name`: peft's name of this adapter. At return, `loc_S` equals the base model's
    logits for every position and every vocabulary row.
    """
    config = config or CausalAdapterConfig()
    check_supported(qwen_model)
    check_unquantized_heads(qwen_model)
    config = resolve_lora_settings(qwen_model, config)
    num_id = resolve_num_token_id(qwen_model, config, tokenizer)
    return CausalModel(qwen_model, config, num_id, adapter_name)
