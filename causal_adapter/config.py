"""CausalAdapterConfig: every knob of SPEC sections 2-3, validated, JSON round-trippable."""
from __future__ import annotations

import json
import math
import warnings
from dataclasses import asdict, dataclass, field, fields
from typing import Any

#: label of positions without a loss (the transformers convention)
IGNORE_INDEX = -100
#: default lower bound of the scales scale_S / scale_Y (a zero row of W_cls must not give scale 0)
DEFAULT_SCALE_FLOOR = 1e-6
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# peft would save these matrices whole (V x H rows): never allowed as LoRA targets.
FORBIDDEN_LORA_TARGETS = ("embed_tokens", "lm_head")
# Bounds of the initial values held by the float32 heads (see CausalAdapterConfig.validate).
SCALE_INIT_MAX = 1e30
THRESHOLD_INIT_MAX = 1e18
#: most recent numbers of the text the value head may read (`CausalAdapterConfig.recent_values`)
MAX_RECENT_VALUES = 256
#: the most numbers the value head looks back over (`recent_window`): K own values in records of up to 4 numbers
MAX_RECENT_WINDOW = 4 * MAX_RECENT_VALUES
#: the most members, or hidden units, of the value head's nonlinear correction (`value_row_net`)
MAX_ROW_NET = 1024
#: what a series' values may be (`modeling.series.SUPPORTS`, `CausalAdapterConfig.value_series`)
SERIES_SUPPORTS = ("positive", "nonneg", "signed")
#: the scales the value's Cauchy can live on (`CausalAdapterConfig.value_transform`, `modeling.value_transform`)
VALUE_TRANSFORMS = ("identity", "log", "series")
#: the rules of per-row value units that `row_units='auto'` tries (`CausalAdapterConfig.value_row_units`,
#: `modeling.row_units`); "season" is taken when asked for (`--row-units season`): chosen by `auto` on horizon.py's
#: set a, it lost on test (step-1 MAE 1.036 -> 1.058 the best window)
ROW_UNIT_RULES = ("last", "median")
#: the rules a saved head may carry: the per-row rules and "fixed", the per-row head's form (its nonlinear
#: correction and log-width) in the adapter's own units for every row, which `train()` keeps only where the
#: correction beats the linear head in the adapter's units (docs/values.md)
ROW_HEAD_RULES = (*ROW_UNIT_RULES, "season", "fixed")


def check_row_rule(rule: str | None) -> str | None:
    """`rule` itself when it is a rule of ROW_HEAD_RULES or None (the adapter's units), else a ValueError: the one
    check of a per-row units rule (the config's, the head's `set_row_units`)."""
    if rule not in (None, *ROW_HEAD_RULES):
        raise ValueError(f"value_row_units must be one of {ROW_HEAD_RULES} or None, got {rule!r}")
    return rule
#: largest move of loc_Y' (value_scale units) that rounding loc_U to bf16 may cause in a value head run on 16-bit
#: features (the fit's bound under `bf16_safe_head`; above it, a head fitted on float32 features warns under bf16)
BF16_MAX_SHIFT = 0.005

#: what each metric key measures (metric tables, the adapter card)
METRIC_LABELS = {
    "loss": "L = L_cls + lambda L_reg",
    "loss_cls": "L_cls (OvR)",
    "loss_reg": "L_reg (gated Cauchy NLL)",
    "accuracy": "next-token accuracy (argmax P)",
    "num_precision": "<NUM> precision",
    "num_recall": "<NUM> recall",
    "num_f1": "<NUM> F1",
    "perplexity": "perplexity, softmax(loc_S)",
    "value_mae": "value MAE (loc_Y)",
    "value_median_ae": "value median AE (loc_Y)",
    "tokens": "tokens scored",
    "num_targets": "<NUM> targets scored",
    "global_step": "optimizer steps",
    "coverage_50": "coverage of 50% interval",
    "coverage_80": "coverage of 80% interval",
    "coverage_90": "coverage of 90% interval",
    "coverage_95": "coverage of 95% interval",
    "cauchy_coverage_50": "coverage of raw Cauchy 50% interval",
    "cauchy_coverage_90": "coverage of raw Cauchy 90% interval",
    "aci_coverage_50": "coverage of adaptive (ordered rows) 50% interval",
    "aci_coverage_90": "coverage of adaptive (ordered rows) 90% interval",
}


@dataclass
class LoraSettings:
    """LoRA on the backbone through peft (`None` in CausalAdapterConfig.lora = frozen backbone).

    target_modules: `nn.Linear` names inside the decoder; the default list stands for the family's
    defaults (`causal_adapter.modeling.families`: attention, dense/shared-expert MLP and, in hybrid models,
    the linear-attention projections), resolved when the model is wrapped.
    target_parameters: fused parameters for peft's `target_parameters`, e.g. the MoE experts
    `families.EXPERT_LORA_PARAMETERS` (opt-in: costly, see docs/families.md).
    """

    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_LORA_TARGETS))
    target_parameters: list[str] = field(default_factory=list)

    def validate(self) -> None:
        if not isinstance(self.r, int) or self.r <= 0:
            raise ValueError(f"lora.r must be a positive integer, got {self.r!r}")
        if not self.alpha > 0:
            raise ValueError(f"lora.alpha must be > 0, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout!r}")
        if not self.target_modules:
            raise ValueError("lora.target_modules is empty; give module names such as ['q_proj', 'v_proj']")
        bad = [t for t in [*self.target_modules, *self.target_parameters] if any(f in t for f in FORBIDDEN_LORA_TARGETS)]
        if bad:
            raise ValueError(
                f"lora.target_modules {bad} would make peft save the full V x H matrices; "
                "the <NUM> row of W_cls is trained by the adapter itself (train_num_row=True)"
            )


@dataclass
class CausalAdapterConfig:
    """Configuration of the causal adapter (SPEC sections 2-3; notation C, gamma0, alpha, lambda).

    causal_size: C, the size of U (None = hidden size H, which gives the exact identity init).
    gamma0: initial scale_U (softplus(b_scale) = gamma0).
    b_noise_init: initial value of every entry of b_noise (exogenous noise, scale_U' = scale_U + |b_noise|).
    threshold_init: OvR threshold C_k (init value); threshold_mode "scalar" (one C) or "vector" (one per row).
    learnable_threshold: thresholds are trained parameters instead of fixed buffers.
    learnable_direction: the numeric-embedding direction d trains (forces backprop through the backbone).
    direction_std: std of the Gaussian draw of d before normalisation.
    train_num_row: the <NUM> row of W_cls trains (saved as one row, never the matrix).
    alpha: gate floor: gate_i = m_i * (alpha + (1 - alpha) * P_num_i).
    reg_weight: lambda in L = L_cls + lambda * L_reg.
    num_token_id: explicit <NUM> id (None = first reserved row, len(tokenizer)).
    lora: LoraSettings (or a dict of them) for a LoRA-tuned backbone; None = frozen backbone.
    scale_floor: lower bound of scale_S (a zero row of W_cls must not give scale 0).
    fused_loss: use the chunked fused OvR loss (False = the reference formula, for debugging).
    seed: seed of every random initialisation in the adapter (d, w_reg, Xavier when C != H).
    direction_norm: norm of d (None = the median row norm of the input embedding, so that phi(v)
        is on the scale of a token embedding and the backbone's RMSNorm does not flatten it;
        1.0 = the seeds' unit vector).
    value_loc, value_scale: value units. The regression predicts Y' and the value is
        Y = value_loc + value_scale * Y' (an exact Cauchy map of loc and scale); `train()` fits
        them on the training targets (median, IQR / 1.349) when None. None = raw units (0, 1).
    standardize_inputs: phi takes (v - value_loc) / value_scale at <NUM> positions (text
        positions stay untouched), once the value units are set.
    regression_scale: "per_row" (scale_Y' = |b_noise_Y| exp(w_scale_Y . loc_U) x an out-of-depth factor that
        grows with the distance of loc_U from the training <NUM> positions' features: a width per row,
        docs/values.md), "independent" (scale_Y' = |b_noise_Y|, the value's own exogenous noise: the
        regression NLL sets the width alone) or "shared" (the seeds' scale_Y' = |w_reg| . scale_U',
        which the OvR loss over ~V negative rows drives with scale_U' and which a least-squares
        warm start of w_reg makes O(1e3) units wide at gamma0 = 10).
    b_noise_Y_init: initial |b_noise_Y| (standardised value units).
    value_decimals: decimals of a generated value's text (None = 6 significant digits); `train()`
        sets it to the most decimals seen in the training targets.
    autocast_adapter_dtype: on a bf16/fp16 base, the adapter's weights (heads and LoRA) are float32,
        as peft's `get_peft_model(autocast_adapter_dtype=True)` does (optimizer updates and the
        GradScaler need them); False keeps the base's dtype (half the adapter memory, bf16-precise
        heads). Saved tensors have this dtype. Adapters written before this field load as True.
    value_transform: the scale the value's Cauchy lives on (`modeling.value_transform`): "identity" (the value),
        "log" (log y, for a positive quantity: the point value exp(loc_Y), the intervals exp of the log ones) or
        "series" (log y for the rows of a series that `value_series` records as positive, the value for the others:
        one file mixing series of any support; needs per-row units, `value_row_units`).
        `train()` chooses it on validation (`TrainConfig.value_transform`). Adapters written before the field load
        as "identity".
    value_log_units: under "log", the head's units [loc, scale] on log y (value_loc / value_scale stay in the
        value's own units: phi's input and the identity head read those).
    value_positive: training saw only positive values of the quantity: no value or interval bound below 0 (under
        "identity" they are floored at 0, under "log" positive by construction).
    value_range: [min, max] of the training values, set by `train()`. Under "log" the head writes within that range
        on log y widened by its width on each side (`modeling.value_transform.log_bounds`): a position it was never
        fitted at writes the nearest bound, not an exp that overflows. None (adapters written before the field): the
        dtype's limit alone.
    value_series: the series the training and validation files held (`modeling.series`): {key: {"support":
        "positive" | "nonneg" | "signed", "rows": values seen, "name": its title as training read it, "scale": its
        width factor (absent: 1)}}, set by `train()`. A positive or nonneg series never gets a value or a bound
        below 0, whatever the others hold. None (adapters written before the field): the adapter-wide
        `value_positive` alone.
    value_calibration: the split-conformal calibration map of the value intervals
        (`causal_adapter.modeling.intervals`: {"n": n, "scores": sorted |y - loc_Y| / scale_Y on validation});
        None = the raw Cauchy intervals.
    horizon_calibration: the per-step maps of a horizon's intervals (`causal_adapter.modeling.horizon`):
        {"individual": "path" or "step" (u drawn once per path or afresh at each step), "paths": N (paths per
        validation row), "steps": [the map of step 2, of step 3, ...] (each as `value_calibration`, on scores
        |y - value| / the paths' spread)}, fitted by `train()` on validation rows whose completion holds several
        values; None = uncalibrated horizons beyond step 1.
    number_prefix_id: the whitespace token written before most numbers of the training completions (Qwen's
        ``" "`` in ``"food expenditure: 1033.57"`` = ``':' ' ' <NUM>``), set by `train()`; None = no layout rule.
        The value head is fitted only at the positions that precede a ``<NUM>`` in training, so generation writes
        this token before a ``<NUM>`` chosen after any token not in `number_contexts`, and `predict_values`
        appends it to such a prompt: the value is always read where training fitted it (docs/predict.md).
    number_contexts: the token ids that precede a ``<NUM>`` of the training completions (the prefix first);
        None with `number_prefix_id`.
    recent_values: K, the most recent numbers of the text that the value head reads directly beside loc_U
        (loc_Y' = w_reg . loc_U + w_recent . r + b_reg, r their standardised values; `modeling.heads`); w_recent
        is set by the closed-form fits of `train()` (0 before). 0 = the SPEC's head on loc_U alone. Adapters
        written before this field load as 0.
    recent_window: how many of the text's most recent numbers the head looks back over to find its K values:
        with per-row units, K counts the values of the row's own series (a ``2016-07: 31.7`` record holds three
        numbers, so K own values need 3 K numbers; `modeling.row_units.same_role`), the adapter's units read the
        K most recent numbers of any kind. None = K (adapters written before this field: K numbers of any kind).
        `train()` sets K x `row_units.MAX_PERIOD`.
    value_row_units: per-row value units (`causal_adapter.modeling.row_units`): "last" or "median", the rule that
        takes a location and a scale from each row's own numbers: those of the predicted kind when the row's
        numbers come in records of 2 to 4 (a year and a value; year, month, value: `row_units.row_period`), else
        all of them (ids, years and title numbers then stay in), so that one head serves values of every scale;
        the head then reads those numbers in the row's
        units and not loc_U. None = the adapter's units (value_loc, value_scale) for every row. `train()` chooses
        on validation (`TrainConfig.row_units`). Needs `recent_values` > 0. Adapters written before this field
        load as None.
    value_width_power: in per-row units, the exponent a of the value's width s |b_noise_Y| (c / s)^a, c the
        window's mean |second difference| (`row_units.row_width`); 0 = the width follows s alone (adapters
        written before the field). `train()` chooses it on validation.
    value_row_net, value_row_net_hidden: in per-row units, the members and hidden width of the value head's
        nonlinear correction (`modeling.row_net`: the mean of that many two-layer MLPs on the row's numbers and
        its window's shape, added to the linear head); its weights are buffers that `train()` fits and keeps
        only when it beats the linear head on validation (else they stay 0). 0 = no such buffers (adapters
        written before these fields).
    value_row_scale: in per-row units, a log-width of each row from the same inputs: the width above times
        exp(w_row_scale . x), clamped to its range on the rows it was fitted on (buffers that `train()` fits on
        the validation rows' residuals, `training.value_head.row_head.add_row_scale`; 0 until then, and where a constant
        width predicts them as well). False = no such buffers (adapters written before this field).
    value_fit_dtype, value_bf16_shift: set by `train()`'s closed-form fit of the value head: the dtype of the
        backbone features it was fitted on ("float32", "bfloat16", "float16") and the largest move of loc_Y (value
        units, on the training rows) if loc_U were rounded to bf16. A head fitted on float32 features whose shift
        exceeds `BF16_MAX_SHIFT` value_scale units warns when it runs on 16-bit features (a bf16 base, or bf16 /
        fp16 autocast): its values then move by about that much (docs/mixed_precision.md). None: not recorded.
    """

    causal_size: int | None = None
    gamma0: float = 10.0
    b_noise_init: float = 0.1
    threshold_init: float = 100.0
    threshold_mode: str = "scalar"
    learnable_threshold: bool = False
    learnable_direction: bool = False
    direction_std: float = 0.02
    train_num_row: bool = True
    alpha: float = 0.0
    reg_weight: float = 1.0
    num_token_id: int | None = None
    lora: LoraSettings | dict | None = None
    scale_floor: float = DEFAULT_SCALE_FLOOR
    fused_loss: bool = True
    seed: int = 0
    direction_norm: float | None = None
    value_loc: float | None = None
    value_scale: float | None = None
    standardize_inputs: bool = True
    regression_scale: str = "per_row"
    b_noise_Y_init: float = 1.0
    value_decimals: int | None = None
    value_calibration: dict | None = None
    autocast_adapter_dtype: bool = True
    number_prefix_id: int | None = None
    number_contexts: list[int] | None = None
    recent_values: int = 0
    recent_window: int | None = None
    value_row_units: str | None = None
    value_width_power: float = 0.0
    value_row_net: int = 0
    value_row_net_hidden: int = 0
    value_row_scale: bool = False
    value_fit_dtype: str | None = None
    value_bf16_shift: float | None = None
    value_transform: str = "identity"
    value_log_units: list[float] | None = None
    value_positive: bool = False
    value_range: list[float] | None = None
    value_series: dict | None = None
    horizon_calibration: dict | None = None

    def __post_init__(self) -> None:
        if isinstance(self.lora, dict):
            self.lora = LoraSettings(**self.lora)
        self.validate()

    def validate(self) -> None:
        def finite(name: str) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
            return float(v)

        if self.causal_size is not None and (not isinstance(self.causal_size, int) or self.causal_size <= 0):
            raise ValueError(f"causal_size must be a positive integer or None, got {self.causal_size!r}")
        if finite("gamma0") <= 0:
            raise ValueError(f"gamma0 must be > 0 (it is the initial Cauchy scale), got {self.gamma0!r}")
        if abs(finite("threshold_init")) > THRESHOLD_INIT_MAX:
            raise ValueError(f"threshold_init must be at most {THRESHOLD_INIT_MAX:g} in magnitude (such thresholds put "
                             f"every P_k at 0 or 1, and the eager loss kernel squares z = loc_S - C in float32), got {self.threshold_init!r}")
        for name in ("gamma0", "b_noise_init"):  # scale_S sums H terms |W_kc| scale_c in float32: keep headroom
            if abs(finite(name)) > SCALE_INIT_MAX:
                raise ValueError(f"{name} must be at most {SCALE_INIT_MAX:g} in magnitude (scale_S = |W_cls| scale_U' "
                                 f"sums H such terms in float32), got {getattr(self, name)!r}")
        if self.threshold_mode not in ("scalar", "vector"):
            raise ValueError(f"threshold_mode must be 'scalar' or 'vector', got {self.threshold_mode!r}")
        if finite("direction_std") <= 0:
            raise ValueError(f"direction_std must be > 0, got {self.direction_std!r}")
        if not 0.0 <= finite("alpha") <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha!r}")
        if finite("reg_weight") < 0:
            raise ValueError(f"reg_weight (lambda) must be >= 0, got {self.reg_weight!r}")
        if not 0 < finite("scale_floor") < 1:
            raise ValueError(f"scale_floor must be in (0, 1), got {self.scale_floor!r}")
        if self.num_token_id is not None and (not isinstance(self.num_token_id, int) or self.num_token_id < 0):
            raise ValueError(f"num_token_id must be a non-negative integer or None, got {self.num_token_id!r}")
        for name in ("direction_norm", "value_scale"):
            if getattr(self, name) is not None and not finite(name) > 0:
                raise ValueError(f"{name} must be > 0 or None, got {getattr(self, name)!r}")
        if self.value_loc is not None:
            finite("value_loc")
        if (self.value_loc is None) != (self.value_scale is None):
            raise ValueError(f"set value_loc and value_scale together (got value_loc={self.value_loc!r}, "
                             f"value_scale={self.value_scale!r})")
        if self.regression_scale not in ("per_row", "independent", "shared"):
            raise ValueError(f"regression_scale must be 'per_row', 'independent' or 'shared', got "
                             f"{self.regression_scale!r}")
        if not 0 <= finite("b_noise_Y_init") <= SCALE_INIT_MAX:
            raise ValueError(f"b_noise_Y_init must be in [0, {SCALE_INIT_MAX:g}], got {self.b_noise_Y_init!r}")
        if self.value_decimals is not None and (isinstance(self.value_decimals, bool)
                                                or not isinstance(self.value_decimals, int)
                                                or not 0 <= self.value_decimals <= 12):
            raise ValueError(f"value_decimals must be an integer in [0, 12] or None, got {self.value_decimals!r}")
        if self.value_calibration is not None:
            _validate_calibration(self.value_calibration)
        if self.horizon_calibration is not None:
            _validate_horizon_calibration(self.horizon_calibration)
        if self.number_prefix_id is not None:
            ctx = self.number_contexts
            if (isinstance(self.number_prefix_id, bool) or not isinstance(self.number_prefix_id, int)
                    or self.number_prefix_id < 0 or not isinstance(ctx, list) or self.number_prefix_id not in ctx
                    or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ctx)):
                raise ValueError(f"number_prefix_id must be a token id listed in number_contexts (a list of token ids), "
                                 f"got {self.number_prefix_id!r} and {str(ctx)[:80]}")
        elif self.number_contexts is not None:
            raise ValueError("number_contexts needs number_prefix_id")
        if (isinstance(self.recent_values, bool) or not isinstance(self.recent_values, int)
                or not 0 <= self.recent_values <= MAX_RECENT_VALUES):
            raise ValueError(f"recent_values must be an integer in [0, {MAX_RECENT_VALUES}], got {self.recent_values!r}")
        if self.recent_window is not None and (
                isinstance(self.recent_window, bool) or not isinstance(self.recent_window, int)
                or not self.recent_values <= self.recent_window <= MAX_RECENT_WINDOW):
            raise ValueError(f"recent_window must be None or an integer in [recent_values = {self.recent_values}, "
                             f"{MAX_RECENT_WINDOW}], got {self.recent_window!r}")
        check_row_rule(self.value_row_units)
        if isinstance(self.value_width_power, bool) or not isinstance(self.value_width_power, (int, float)) \
                or not 0.0 <= self.value_width_power <= 1.0:
            raise ValueError(f"value_width_power must be a number in [0, 1], got {self.value_width_power!r}")
        if self.value_row_units is not None and (not self.recent_values or self.regression_scale == "shared"):
            raise ValueError("value_row_units reads the row's recent numbers and scales the value's own width: it "
                             "needs recent_values > 0 and regression_scale 'per_row' or 'independent'")
        for name in ("value_row_net", "value_row_net_hidden"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_ROW_NET:
                raise ValueError(f"{name} must be an integer in [0, {MAX_ROW_NET}], got {v!r}")
        if self.value_row_net and not (self.value_row_net_hidden and self.recent_values):
            raise ValueError("value_row_net reads the row's recent numbers: it needs recent_values > 0 and "
                             "value_row_net_hidden > 0")
        if not isinstance(self.value_row_scale, bool):
            raise ValueError(f"value_row_scale must be True or False, got {self.value_row_scale!r}")
        if self.value_row_scale and not self.recent_values:
            raise ValueError("value_row_scale reads the row's recent numbers: it needs recent_values > 0")
        if self.value_fit_dtype not in (None, "float32", "bfloat16", "float16", "float64"):
            raise ValueError(f"value_fit_dtype must be a float dtype name or None, got {self.value_fit_dtype!r}")
        if self.value_bf16_shift is not None and not finite("value_bf16_shift") >= 0:
            raise ValueError(f"value_bf16_shift must be >= 0 or None, got {self.value_bf16_shift!r}")
        if self.value_transform not in VALUE_TRANSFORMS:
            raise ValueError(f"value_transform must be one of {VALUE_TRANSFORMS}, got {self.value_transform!r}")
        if self.value_log_units is not None and not (
                isinstance(self.value_log_units, (list, tuple)) and len(self.value_log_units) == 2
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                        for v in self.value_log_units) and self.value_log_units[1] > 0):
            raise ValueError(f"value_log_units must be [loc, scale > 0] (finite) or None, got {self.value_log_units!r}")
        if self.value_transform == "log" and self.value_loc is not None and self.value_log_units is None:
            raise ValueError("value_transform 'log' needs value_log_units, the head's units on log y")
        if not isinstance(self.value_positive, bool):
            raise ValueError(f"value_positive must be a bool, got {self.value_positive!r}")
        if self.value_range is not None:
            r = self.value_range
            if (not isinstance(r, (list, tuple)) or len(r) != 2
                    or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in r)
                    or r[0] > r[1]):
                raise ValueError(f"value_range must be [min, max] of finite numbers with min <= max, got {r!r}")
            self.value_range = [float(r[0]), float(r[1])]
        if self.value_series is not None:
            _validate_series(self.value_series)
        if not isinstance(self.autocast_adapter_dtype, bool):
            raise ValueError(f"autocast_adapter_dtype must be True or False, got {self.autocast_adapter_dtype!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.lora is not None:
            if not isinstance(self.lora, LoraSettings):
                raise ValueError(f"lora must be None, a dict or LoraSettings, got {type(self.lora).__name__}")
            self.lora.validate()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CausalAdapterConfig":
        data = _renamed_fields(data)
        if "recent_values" not in data:  # written before the field existed: the head without it
            data = {**data, "recent_values": 0}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown CausalAdapterConfig fields {unknown}; known: {sorted(known)}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "CausalAdapterConfig":
        return cls.from_dict(json.loads(text))


# Config fields renamed since adapters were first written: old key -> new key. `from_dict` (and so
# `from_pretrained`) still reads the old keys, with a FutureWarning; they will stop loading in a later release.
RENAMED_FIELDS = {
    "value_row_width": "value_width_power",
    "value_row_net_width": "value_row_net_hidden",
}


def _renamed_fields(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with each old key of `RENAMED_FIELDS` under its new name (a FutureWarning per old key)."""
    old = [key for key in RENAMED_FIELDS if key in data]
    if not old:
        return data
    data = dict(data)
    for key in old:
        new = RENAMED_FIELDS[key]
        if new in data:
            raise ValueError(f"CausalAdapterConfig has both {key!r} (its old name) and {new!r}: keep only {new!r}")
        warnings.warn(f"CausalAdapterConfig field {key!r} is now {new!r}; the old name will stop loading in a "
                      "later release (save the adapter again to write the new name)", FutureWarning, stacklevel=3)
        data[new] = data.pop(key)
    return data


def _validate_series(table: Any) -> None:
    """{key: {"support": one of SERIES_SUPPORTS, "rows": int >= 0, "name": str, "scale": finite > 0 (optional), "ar":
    {"coef": 2..8 finite numbers, "mix": in [0, 1]} (optional, `modeling.series_ar`)}}."""
    if not isinstance(table, dict):
        raise ValueError(f"value_series must be a dict of series, got {type(table).__name__}")
    for key, entry in table.items():
        ok = (isinstance(key, str) and isinstance(entry, dict) and entry.get("support") in SERIES_SUPPORTS
              and set(entry) <= {"support", "rows", "name", "scale", "ar"} and _valid_ar(entry.get("ar"))
              and isinstance(entry.get("rows", 0), int) and isinstance(entry.get("name", ""), str))
        scale = entry.get("scale", 1.0) if isinstance(entry, dict) else None
        if not ok or isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (
                math.isfinite(scale) and scale > 0):
            raise ValueError(f"value_series[{key!r}] must be {{'support': one of {SERIES_SUPPORTS}, 'rows': n, "
                             f"'name': title, 'scale': > 0, 'ar': {{'coef', 'mix'}}}}, got {str(entry)[:120]}")


def _valid_ar(ar: Any) -> bool:
    if ar is None:
        return True
    coef, mix = (ar.get("coef"), ar.get("mix")) if isinstance(ar, dict) and set(ar) == {"coef", "mix"} else (0, -1)
    numbers = isinstance(coef, list) and 2 <= len(coef) <= 8 and all(
        isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) for c in coef)
    return numbers and isinstance(mix, (int, float)) and not isinstance(mix, bool) and 0 <= mix <= 1


def _validate_horizon_calibration(calibration: Any) -> None:
    """{"individual": "path" | "step", "paths": N, "steps": [one `value_calibration` map per step 2..H + 1]}."""
    ok = (isinstance(calibration, dict) and calibration.get("individual") in ("path", "step")
          and isinstance(calibration.get("steps"), list) and calibration["steps"]
          and isinstance(calibration.get("paths"), int) and calibration["paths"] > 0)
    if not ok:
        raise ValueError("horizon_calibration must be {'individual': 'path' or 'step', 'paths': N, 'steps': [maps of "
                         f"steps 2, 3, ...]}}, got {str(calibration)[:120]}")
    for step in calibration["steps"]:
        _validate_calibration(step)


def _validate_calibration(calibration: Any) -> None:
    bad = ValueError(f"value_calibration must be {{'n': count, 'scores': sorted finite non-negative floats}}, "
                     f"got {str(calibration)[:120]}")
    if not isinstance(calibration, dict) or set(calibration) != {"n", "scores"}:
        raise bad
    n, scores = calibration["n"], calibration["scores"]
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0 or not isinstance(scores, list) or not scores:
        raise bad
    if len(scores) > n or any(isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s < 0
                              for s in scores) or any(a > b for a, b in zip(scores, scores[1:])):
        raise bad
