"""The adapter's heads of SPEC section 2 (the third module, the numeric embedding phi, is `numeric_embedding`).

AbductionHead     z -> (loc_U, scale_U): a Cauchy distribution over the individual U.
ActionHead        U -> OvR token scores (loc_S, scale_S) through the SHARED lm_head weight,
                  and a Cauchy regression (loc_Y, scale_Y) for the value of a <NUM>.

All heads compute in `dtype` (float32 for a bf16/fp16 backbone, else the backbone's dtype) with
autocast switched off (`full_precision`): a bf16 autocast region around the model does not reach them.
The shared W_cls is cast per use by chunks of rows, never copied into the adapter.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import check_row_rule
from .cauchy import cauchy_icdf
from .row_net import part_shapes, row_net, PARTS as ROW_NET_PARTS
from . import numeric_embedding, recent_numbers
from .row_transform import row_frame
from .value_transform import ValueMap

# their old home: `recent_numbers`, `numeric_embedding`
recent_values, packed_row_starts = recent_numbers.recent_values, recent_numbers.packed_row_starts
symlog, NumericEmbedding = numeric_embedding.symlog, numeric_embedding.NumericEmbedding

#: principal directions of the training features kept for the out-of-depth width
#: (`training.value_head.warm_start.fit_depth`)
DEPTH_RANK = 64


def full_precision(device: torch.device | str):
    """Context in which the heads and losses run: autocast off on `device`'s type, so that every
    matmul computes in its operands' own dtype (float32 heads stay float32 under a bf16 autocast)."""
    kind = torch.device(device).type
    if not torch.amp.is_autocast_available(kind):  # e.g. meta tensors: no autocast to switch off
        return contextlib.nullcontext()
    return torch.autocast(device_type=kind, enabled=False)


def inverse_softplus(y: float) -> float:
    """x with softplus(x) = y, stable for any y > 0: y + log(-expm1(-y))."""
    return y + math.log(-math.expm1(-y))


class AbductionHead(nn.Module):
    """loc_U = W_loc z + b_loc, scale_U = softplus(W_scale z + b_scale).

    Init (C = H): W_loc = I, b_loc = 0, W_scale = 0, b_scale = softplus^-1(gamma0), so that
    loc_U = z exactly and scale_U = gamma0 everywhere.
    """

    def __init__(self, hidden_size: int, causal_size: int, *, gamma0: float, generator: torch.Generator,
                 dtype: torch.dtype, device: torch.device | None = None):
        super().__init__()
        self.loc = nn.Linear(hidden_size, causal_size, dtype=dtype, device=device)
        self.scale = nn.Linear(hidden_size, causal_size, dtype=dtype, device=device)
        with torch.no_grad():
            if causal_size == hidden_size:
                self.loc.weight.copy_(torch.eye(causal_size, dtype=dtype))
            else:
                bound = math.sqrt(6.0 / (hidden_size + causal_size))
                w = torch.rand(causal_size, hidden_size, generator=generator, dtype=torch.float64)
                self.loc.weight.copy_((2 * w - 1) * bound)
            self.loc.bias.zero_()
            self.scale.weight.zero_()
            self.scale.bias.fill_(inverse_softplus(gamma0))

    def forward(self, z: Tensor) -> tuple[Tensor, Tensor]:
        """[..., H] -> loc_U [..., C], scale_U [..., C] (> 0), on the heads' device (z may come from
        another one when the backbone is split over devices)."""
        z = z.to(self.loc.weight.device, self.loc.weight.dtype)
        # W z, then + b: nn.Linear's fused path on a [B, S, H] input returns a VIEW of a flattened addmm, and
        # loc_U is an output of the model, where FSDP2 hooks its backward (an in-place op on a view output
        # would drop that hook). The sum is a tensor of its own.
        loc_U = F.linear(z, self.loc.weight) + self.loc.bias
        return loc_U, F.softplus(self.scale(z))


class ActionHead(nn.Module):
    """Classification and regression from U ~ Cauchy(loc_U, scale_U').

    scale_U' = scale_U + |b_noise|
    loc_S = W_cls loc_U + b_cls, scale_S = max(|W_cls| scale_U', scale_floor)   (all V rows)
    loc_Y' = w_reg . loc_U + w_recent . r + b_reg, scale_Y' = |b_noise_Y| ("independent") or |w_reg| . scale_U' ("shared")
        or |b_noise_Y| exp(w_scale_Y . loc_U) depth(loc_U) ("per_row", `per_row_scale`)
    loc_Y = head_loc + head_scale * loc_Y', scale_Y = max(head_scale * scale_Y', scale_floor)

    Y' is the value in standardised units; (head_loc, head_scale) are the head's units, plain floats
    (`set_head_units`), (0, 1) = raw units: the config's (value_loc, value_scale), or under a log head its
    `value_log_units` (on log y).

    r [..., K]: the K most recent numbers of the text (`recent_values`), standardised the same way,
    clamped to `recent_range` (their range in training widened by its width on each side) and 0 where the
    text has fewer numbers. The value itself reaches the head there, exactly, beside the features that
    carry it through the backbone (in bf16 residuals, after a log-compressing phi); w_recent is a fitted
    buffer (the closed-form fits set it), zero from the start. K = 0: the SPEC's head alone.

    Per-row units (`row_rule`, a rule of `modeling.row_units`; None = the adapter's units above): each row
    takes m_row, s_row from its own same-kind numbers, r is those numbers in (m_row, s_row) units, and
    loc_Y = m_row + s_row (w_reg . loc_U + w_recent . r + b_reg + net(x)),
    scale_Y = s_row |b_noise_Y| (c_row / s_row)^a exp(w_row_scale . x)
    (`row_units.row_width`; a = `row_width_power`; net: the mean of `row_net_members` small MLPs on r and the
    window's shape, `modeling.row_net`, zero unless fitted; x those MLPs' inputs; w_row_scale . x, with
    `row_scale`, a fitted log-width clamped to its range on the rows it was fitted on, 0 unless fitted). w_reg is
    0 unless the fit kept loc_U (what the row's words say) in row units; with w_reg = 0 a context multiplied by c
    gives values and widths multiplied by c (loc_U's phi inputs are in the adapter's units). In causal sampling the
    value reads the sampled u where it reads loc_U. Rows with too few numbers keep the adapter's units.

    Every location and scale is on the head's scale `value_map` (`value_transform`: the value, or log y).

    W_cls is the backbone's lm_head weight, passed in at call time (shared, not a submodule:
    it must not be saved or counted twice). Its <NUM> row is replaced by `num_row`, a
    trained copy (one row), when `train_num_row` is set.
    """

    def __init__(self, causal_size: int, vocab_size: int, num_token_id: int, w_num_init: Tensor, *,
                 b_noise_init: float, threshold_init: float, threshold_mode: str, learnable_threshold: bool,
                 train_num_row: bool, scale_floor: float, generator: torch.Generator,
                 dtype: torch.dtype, device: torch.device | None = None, regression_scale: str = "independent",
                 b_noise_Y_init: float = 1.0, recent_values: int = 0, row_net_members: int = 0,
                 row_net_hidden: int = 0, row_scale: bool = False, recent_window: int | None = None):
        super().__init__()
        self.num_token_id = num_token_id
        self.scale_floor = scale_floor
        self.head_loc, self.head_scale = 0.0, 1.0
        self.head_log_units: tuple[float, float] | None = None  # a "series" head's units on log y (`set_head_units`)
        kw = dict(dtype=dtype, device=device)
        self.b_noise = nn.Parameter(torch.full((causal_size,), float(b_noise_init), **kw))
        self.b_cls = nn.Parameter(torch.zeros(vocab_size, **kw))
        # a scalar threshold (and b_reg, b_noise_Y) is a 1-element vector, not a 0-d tensor: FSDP refuses 0-d
        # parameters; each use reshapes it to 0-d, so the broadcasting is that of a scalar
        thresholds = torch.full((vocab_size if threshold_mode == "vector" else 1,), float(threshold_init), **kw)
        if learnable_threshold:
            self.thresholds = nn.Parameter(thresholds)
        else:
            self.register_buffer("thresholds", thresholds)
        if train_num_row:
            self.num_row = nn.Parameter(w_num_init.detach().to(**kw).clone())
        else:
            self.num_row = None
        w_reg = torch.randn(causal_size, generator=generator, dtype=torch.float64) / math.sqrt(causal_size)
        self.w_reg = nn.Parameter(w_reg.to(**kw))
        self.b_reg = nn.Parameter(torch.zeros(1, **kw))
        if regression_scale in ("independent", "per_row"):
            self.b_noise_Y = nn.Parameter(torch.full((1,), float(b_noise_Y_init), **kw))
        else:
            self.b_noise_Y = None
        self.w_scale_Y = None
        if regression_scale == "per_row":  # starts as the independent scale: w_scale_Y = 0, depth factor 1
            self.w_scale_Y = nn.Parameter(torch.zeros(causal_size, **kw))
            rank = min(causal_size, DEPTH_RANK)
            for name, shape in (("mean", (causal_size,)), ("basis", (rank, causal_size)), ("weight", (rank,)),
                                ("resid", (1,))):
                self.register_buffer(f"depth_{name}", torch.zeros(shape, **kw))
            self.register_buffer("depth_ref", torch.ones(1, **kw))
            # w_scale_Y . loc_U is clamped to its range on the training rows: a linear log-scale must not
            # extrapolate (to a 1e-13 width) where the head never trained; the depth factor widens there
            self.register_buffer("log_scale_range", torch.tensor([-30.0, 30.0], **kw))

        self.recent_values = recent_values
        # the numbers the head looks back over (W >= K): per-row units take K values of the row's own kind from them
        self.recent_window = int(recent_window or recent_values)
        self.row_rule: str | None = None  # the per-row units' rule (`set_row_units`), None = the adapter's units
        self.row_width_power = 0.0  # the width's exponent a in per-row units (`row_units.row_width`)
        self._value_map = ValueMap()  # the scale the value's Cauchy lives on (`set_value_map`, `value_map`)
        if recent_values:
            self.register_buffer("w_recent", torch.zeros(recent_values, **kw))
            self.register_buffer("recent_range", torch.tensor([[-1e6], [1e6]], **kw).repeat(1, recent_values))
        # the per-row units' nonlinear correction (`row_net`): fitted buffers, zero (adding 0) until then
        self.row_net_members = row_net_members if recent_values and row_net_hidden else 0
        if self.row_net_members:
            for name, shape in part_shapes(row_net_members, row_net_hidden, 2 * recent_values + 2).items():
                self.register_buffer(f"row_net_{name}", torch.zeros(shape, **kw))
        # the per-row units' log-width on the same inputs (`row_regression`): zero, a factor of 1, until fitted
        self.row_scale = bool(row_scale and recent_values)
        if self.row_scale:
            self.register_buffer("w_row_scale", torch.zeros(2 * recent_values + 2, **kw))
            self.register_buffer("row_log_scale_range", torch.zeros(2, **kw))

    def set_head_units(self, head_loc: float, head_scale: float, log_units: tuple[float, float] | None = None
                       ) -> None:
        """The head's units: T(Y) = head_loc + head_scale * Y' (floats; (0, 1) = raw units), on the head's scale
        (`value_map`: the value, or log y); `log_units`: a "series" head's on log y, for its rows there."""
        self.head_loc, self.head_scale = float(head_loc), float(head_scale)
        self.head_log_units = None if log_units is None else (float(log_units[0]), float(log_units[1]))

    # The head's units were once called value_loc / value_scale, the config's names for the adapter's value units
    # (which a log head's are not): the old names still work, with a FutureWarning.
    def set_value_units(self, value_loc: float, value_scale: float) -> None:
        """Deprecated: `set_head_units`."""
        warnings.warn("ActionHead.set_value_units is now set_head_units", FutureWarning, stacklevel=2)
        self.set_head_units(value_loc, value_scale)

    @property
    def value_loc(self) -> float:
        """Deprecated: `head_loc`."""
        warnings.warn("ActionHead.value_loc is now head_loc", FutureWarning, stacklevel=2)
        return self.head_loc

    @property
    def value_scale(self) -> float:
        """Deprecated: `head_scale`."""
        warnings.warn("ActionHead.value_scale is now head_scale", FutureWarning, stacklevel=2)
        return self.head_scale

    def set_value_map(self, value_map: ValueMap) -> None:
        """The scale the value's Cauchy lives on (`value_transform.ValueMap`): loc_Y, scale_Y and the head's units
        are on T(y), and the head reads the recent numbers as T(numbers) (`head_loc` / `head_scale` are the
        head's units on that scale)."""
        self._value_map = value_map

    @property
    def value_map(self) -> ValueMap:
        """The value's map (`set_value_map`); in per-row units ("last", "median", "season") without a log head's bounds: they are
        absolute and a per-row head is scale-equivariant (a row times c gives values times c, at any c)."""
        vm = self._value_map
        if self.row_rule in (None, "fixed") or vm.bounds is None:  # "fixed": the adapter's units for every row
            return vm
        return dataclasses.replace(vm, bounds=None)

    def set_row_units(self, rule: str | None, width_power: float = 0.0) -> None:
        """Per-row units by `rule` (`config.ROW_UNIT_RULES`), or None for the adapter's units; needs recent values.
        `width_power`: a of the width s (c / s)^a (`row_units.row_width`)."""
        check_row_rule(rule)  # an unknown rule fails here, not at the first forward
        if rule is not None and (not self.recent_values or self.b_noise_Y is None):
            raise ValueError("per-row value units read the row's recent numbers and scale a width of the value's "
                             "own: set recent_values > 0 and regression_scale 'per_row' or 'independent'")
        self.row_rule = rule
        self.row_width_power = float(width_power)

    def units(self, recent: Tensor | None, like: Tensor, log_rows: Tensor | None = None
              ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
        """Per-row units (`row_rule` set): (m [...], s [...], r [..., K], width unit [...], x [..., 2 K + 2] or
        None) for raw recent values [..., K]: the value units of each row, the numbers the head reads in them (0
        where none), the unit of the value's width (`row_units.row_width`), in `like`'s dtype, and the inputs of
        the nonlinear correction and the log-width (`row_net.net_inputs`, r clamped to `recent_range`; None
        without either) in the heads' dtype. The transform is `row_transform.row_frame`, the fit's own. `log_rows`
        [...] bool: a "series" head's rows on log y (`value_transform`)."""
        if recent is None:
            raise ValueError(f"this adapter's value head reads the {self.recent_values} most recent numbers of the "
                             "text: pass their values (`recent_numbers.recent_values`)")
        if log_rows is not None:
            log_rows = per_position(log_rows, recent)
        frame = row_frame(recent, self.row_rule, *self.fallback_units(log_rows, recent), self.log_space(log_rows),
                          keep=self.recent_values)
        width = frame.width(self.row_width_power)
        x = frame.inputs(self.recent_range).to(self.b_reg.dtype) if self.row_net_members or self.row_scale else None
        return (frame.loc.to(like.dtype), frame.scale.to(like.dtype), frame.r.to(like.dtype), width.to(like.dtype),
                x)

    def log_space(self, log_rows: Tensor | None) -> bool | Tensor:
        """Whether (or, per row [...], where) the head reads and writes log y: a log head everywhere, a "series"
        head at `log_rows` (None: nowhere)."""
        if self.value_map.series and log_rows is not None:
            return log_rows.bool()
        return self.value_map.log

    def fallback_units(self, log_rows: Tensor | None, like: Tensor) -> tuple[float | Tensor, float | Tensor]:
        """The units of a row without its own (too few numbers): the head's, on log y for a "series" head's rows
        there (`head_log_units`), [...] per row then."""
        if not self.value_map.series or log_rows is None or self.head_log_units is None:
            return self.head_loc, self.head_scale
        rows = log_rows.to(like.device).bool()
        return (torch.where(rows, self.head_log_units[0], self.head_loc).double(),
                torch.where(rows, self.head_log_units[1], self.head_scale).double())

    def row_log_scale(self, x: Tensor) -> Tensor:
        """x [..., 2 K + 2] (`units`) -> [...] w_row_scale . x clamped to `row_log_scale_range` (with `row_scale`)."""
        lo, hi = self.row_log_scale_range.unbind()
        return torch.minimum(torch.maximum(x @ self.w_row_scale, lo), hi)

    def per_row_log_scale(self) -> tuple[Tensor, Tensor] | None:
        """The fitted per-row part of the width in use, (weights, clamp range): w_row_scale in per-row units,
        w_scale_Y in the adapter's; None without one. Multiplying both by a keeps an exact Cauchy with that part
        raised to the power a (`training.value_head.calibration.calibrate_regression_scale`)."""
        if self.row_rule is not None:
            return (self.w_row_scale, self.row_log_scale_range) if self.row_scale else None
        return None if self.w_scale_Y is None else (self.w_scale_Y, self.log_scale_range)

    def row_net_parts(self) -> dict[str, Tensor]:
        """The nonlinear correction's weights (`row_net.PARTS`; empty without it)."""
        return {k: getattr(self, f"row_net_{k}") for k in ROW_NET_PARTS} if self.row_net_members else {}

    def from_standard(self, y_std: Tensor) -> Tensor:
        """Standardised Y' -> the head's scale (T(y): the value itself, or log y; `value_map.to_value` then gives
        the value): a location or a sampled value."""
        return self.head_loc + self.head_scale * y_std

    def noisy_scale(self, scale_U: Tensor) -> Tensor:
        """scale_U' = scale_U + |b_noise|."""
        return scale_U + self.b_noise.abs()

    def row_override(self) -> tuple[Tensor, Tensor] | None:
        """(indices [1], rows [1, C]) replacing W_cls's <NUM> row, or None when it is not trained."""
        if self.num_row is None:
            return None
        idx = torch.tensor([self.num_token_id], device=self.num_row.device)
        return idx, self.num_row.unsqueeze(0)

    def num_threshold(self) -> Tensor:
        """C_<NUM>, 0-d."""
        return self.thresholds.reshape(()) if self.thresholds.numel() == 1 else self.thresholds[self.num_token_id]

    def threshold_scores(self) -> Tensor:
        """The thresholds as scores broadcast against: 0-d (scalar mode) or [V]."""
        return self.thresholds.reshape(()) if self.thresholds.numel() == 1 else self.thresholds

    def num_weight(self, W_cls: Tensor) -> Tensor:
        """The <NUM> row of the effective W_cls, [C]."""
        return self.num_row if self.num_row is not None else W_cls[self.num_token_id].to(self.b_cls.dtype)

    def effective_rows(self, ids: Tensor, W_cls: Tensor) -> Tensor:
        """Rows `ids` [n] of the effective W_cls, [n, C] in the heads' dtype: the <NUM> row is `num_row`
        when it is trained."""
        W = W_cls.index_select(0, ids).to(self.b_cls.dtype)
        if self.num_row is not None:
            W = torch.where((ids == self.num_token_id).unsqueeze(-1), self.num_row.unsqueeze(0), W)
        return W

    def override_num_column(self, scores: Tensor, x: Tensor, *, scale: bool = False,
                            ids: Tensor | None = None) -> Tensor:
        """`scores` [..., n] = x @ W_cls.T (+ b_cls for a location) with the <NUM> column computed from
        `num_row` instead: x @ num_row + b_cls[<NUM>] for a location (x = loc_U or a sampled u),
        x @ |num_row| for a scale (``scale=True``, x = scale_U'). The one place of the <NUM>-row
        override outside the fused loss (`row_override`).

        Args:
            scores: the scores of the rows `ids` of W_cls (the last dimension).
            x: [..., C], what `scores` were computed from.
            scale: scale scores (|num_row|, no bias) instead of location scores.
            ids: the vocabulary row of each column of `scores`; None = all V rows, in order.

        Returns `scores` itself when `num_row` is not trained or <NUM> is not among `ids`, else a new
        tensor (out of place: autograd-safe)."""
        if self.num_row is None:
            return scores
        k = self.num_token_id
        if ids is None:
            col = _idx(k, scores)
        else:
            col = (ids == k).nonzero()[:1, 0]
            if not col.numel():
                return scores
        value = x @ self.num_row.abs() if scale else x @ self.num_row + self.b_cls[k]
        return scores.index_copy(-1, col, value.unsqueeze(-1))

    def set_depth(self, stats: dict) -> None:
        """Load out-of-depth statistics (`training.value_head.warm_start.fit_depth`: tensors mean, basis, weight,
        resid, ref) into the depth buffers."""
        with torch.no_grad():
            for name in ("mean", "basis", "weight", "resid", "ref"):
                buf = getattr(self, f"depth_{name}")
                buf.copy_(getattr(stats, name).to(dtype=buf.dtype, device=buf.device))

    def depth_factor(self, loc_U: Tensor) -> Tensor:
        """[..., C] -> [...] sqrt(max(1, d2 / ref)): 1 where loc_U looks like the training <NUM> positions'
        features, growing with the (regularised) Mahalanobis distance d2 from them (`fit_depth`):
        a linear head's error grows linearly with that distance."""
        x = loc_U - self.depth_mean
        d2 = (x * x).sum(-1) * self.depth_resid.reshape(()) + (x @ self.depth_basis.T).square() @ self.depth_weight
        return (d2 / self.depth_ref.reshape(())).clamp_min(1.0).sqrt()

    def per_row_scale(self, loc_U: Tensor) -> Tensor:
        """scale_Y' [...] = |b_noise_Y| exp(w_scale_Y . loc_U) depth_factor(loc_U) (standardised units)."""
        lo, hi = self.log_scale_range.unbind()
        log_s = torch.minimum(torch.maximum(loc_U @ self.w_scale_Y, lo), hi)
        return self.b_noise_Y.abs().reshape(()) * log_s.exp() * self.depth_factor(loc_U)

    def standardized_recent(self, recent: Tensor) -> Tensor:
        """Raw recent values [..., K] (NaN = none) -> r [..., K] in recent's dtype: on the head's scale (T(numbers):
        `value_map`), standardised, 0 where none. Unclamped (the fits read it so, in float64)."""
        recent = recent[..., :self.recent_values]  # the adapter's units read the K most recent numbers of any kind
        return torch.nan_to_num((self.value_map.to_head(recent) - self.head_loc) / self.head_scale, nan=0.0)

    def recent_term(self, recent: Tensor | None, like: Tensor, r: Tensor | None = None) -> Tensor:
        """w_recent . r [...], r clamped to `recent_range`; 0 (a scalar) without recent values (K = 0). `r`: the
        numbers already in the head's units (`units`); else the recent values in the adapter's."""
        if not self.recent_values:
            return like.new_zeros(())
        if r is None:
            if recent is None:
                raise ValueError(f"this adapter's value head reads the {self.recent_values} most recent numbers of "
                                 "the text: pass their values (`recent_numbers.recent_values`)")
            r = self.standardized_recent(recent.to(self.b_reg.dtype))
        lo, hi = self.recent_range
        return torch.minimum(torch.maximum(r.to(self.b_reg.dtype), lo), hi) @ self.w_recent

    def row_regression(self, recent: Tensor | None, like: Tensor, loc_U: Tensor | None = None,
                       log_rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Per-row units: loc_Y, scale_Y [...] (on the head's scale) from the row's own numbers and, with `loc_U`
        [..., C] (or a sampled u), w_reg . loc_U in the row's units (what the row's words say; w_reg = 0 when the
        fit did not keep it); `log_rows` [...]: a "series" head's rows on log y."""
        loc, scale, r, width, x = self.units(recent, like, log_rows)
        y_std = self.recent_term(None, like, r) + self.b_reg.reshape(())
        if loc_U is not None:
            y_std = y_std + (loc_U.to(self.w_reg.dtype) @ self.w_reg).to(y_std.dtype)
        if self.row_net_members:
            y_std = y_std + row_net(x, self.row_net_parts())
        if self.row_scale:
            width = width * self.row_log_scale(x).exp().to(width.dtype)
        return loc + scale * y_std, (width * self.b_noise_Y.abs().reshape(())).clamp_min(self.scale_floor)

    def regression(self, loc_U: Tensor, scale_Up: Tensor, recent: Tensor | None = None,
                   log_rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """loc_U, scale_U' [..., C], recent [..., K] (raw values, NaN = none; with K > 0) -> loc_Y [...],
        scale_Y [...] on the head's scale (`value_map`; a "series" head's `log_rows` [...] on log y)."""
        if self.row_rule is not None:
            return self.row_regression(recent, loc_U[..., 0], loc_U, log_rows)
        loc_Y = self.from_standard(loc_U @ self.w_reg + self.recent_term(recent, loc_U) + self.b_reg.reshape(()))
        if self.w_scale_Y is not None:
            scale_Y = self.per_row_scale(loc_U)
        elif self.b_noise_Y is not None:
            scale_Y = self.b_noise_Y.abs().reshape(()).expand(loc_Y.shape)
        else:
            scale_Y = scale_Up @ self.w_reg.abs()
        return loc_Y, (self.head_scale * scale_Y).clamp_min(self.scale_floor)

    def scores(self, loc_U: Tensor, scale_Up: Tensor, W_cls: Tensor) -> tuple[Tensor, Tensor]:
        """Full-vocabulary scores: [..., C] -> loc_S, scale_S [..., V]. Materialises [..., V]:
        only for inference on few positions or when asked; training uses the fused loss."""
        loc_S = self.override_num_column(linear_in_dtype(loc_U, W_cls) + self.b_cls, loc_U)
        scale_S = self.override_num_column(linear_in_dtype(scale_Up, W_cls.abs()), scale_Up, scale=True)
        return loc_S, scale_S.clamp_min(self.scale_floor)

    def decision_scores(self, u: Tensor, W_cls: Tensor) -> Tensor:
        """Noise-free token scores for a sampled individual u [..., C]: (W_cls u + b_cls - C_k) [..., V] (its value:
        `individual_value`)."""
        s = self.override_num_column(linear_in_dtype(u, W_cls) + self.b_cls, u)
        return s - self.threshold_scores()

    def individual_value(self, loc_Y: Tensor, scale_Y: Tensor, eps: Tensor, scale_Up: Tensor) -> Tensor:
        """The value an individual u = loc_U + scale_U' tan(pi (eps - 1/2)) writes, on the head's scale: the head's
        own Cauchy(loc_Y, scale_Y) [...] at the quantile u gives it (`individual_draw`; eps, scale_U' [..., C]), so
        repeated draws spread as the head's interval does (SPEC 4, causal)."""
        t = individual_draw(self, eps, scale_Up)
        return loc_Y + scale_Y * t.to(loc_Y.dtype)


def per_position(log_rows: Tensor, recent: Tensor) -> Tensor:
    """A "series" head's flags against recent [n, ..., K]: one per position [n, ...], or one per row [n] (or [n, 1])
    spread over the row's positions."""
    log_rows = log_rows.to(recent.device).bool()
    if log_rows.numel() == recent[..., 0].numel():
        return log_rows.reshape(recent.shape[:-1])
    rows = log_rows.reshape(recent.shape[0])
    return rows.reshape((-1,) + (1,) * (recent.dim() - 2)).expand(recent.shape[:-1])


def individual_draw(act: ActionHead, eps: Tensor, scale_Up: Tensor) -> Tensor:
    """[...] the standard Cauchy deviate w_reg . (u - loc_U) / (|w_reg| . scale_U') of individuals u = loc_U + scale_U'
    tan(pi (eps - 1/2)) (eps, scale_U' [..., C]): the head is linear in u through w_reg, so this is where u puts the
    value in the head's own Cauchy. With w_reg = 0 (a head on the row's numbers alone) the first coordinate's deviate
    draws the width (else every draw would be loc_Y). loc_Y at u itself is 27,000x scale_Y wide on a trained adapter."""
    w = act.w_reg.to(scale_Up.dtype)
    deviates = cauchy_icdf(eps.to(scale_Up.dtype))
    dev = scale_Up * deviates  # u - loc_U
    den = scale_Up @ w.abs()
    return torch.where(den > 0, (dev @ w) / den.clamp_min(torch.finfo(den.dtype).tiny), deviates[..., 0])


def _idx(k: int, like: Tensor) -> Tensor:
    return torch.tensor([k], device=like.device)


#: rows of a lower-precision W cast to x's dtype at a time in `linear_in_dtype` (a few MB)
LINEAR_CHUNK_ROWS = 4096


def linear_in_dtype(x: Tensor, W: Tensor) -> Tensor:
    """x @ W.T in x's dtype, [..., H] x [V, H] -> [..., V]. A lower-precision W (bf16) is cast up
    by chunks of LINEAR_CHUNK_ROWS rows: the product is as accurate as x's dtype (casting x down
    to bf16 instead makes loc_S bf16-precise: ~3e-3 relative, measured in docs/mixed_precision.md)
    and no V x H copy of W is made."""
    if W.dtype == x.dtype:
        return F.linear(x, W)
    V = W.shape[0]
    if V <= LINEAR_CHUNK_ROWS:
        return F.linear(x, W.to(x.dtype))
    out = x.new_empty(*x.shape[:-1], V)
    for c in range(0, V, LINEAR_CHUNK_ROWS):
        out[..., c:c + LINEAR_CHUNK_ROWS] = F.linear(x, W[c:c + LINEAR_CHUNK_ROWS].to(x.dtype))
    return out
