"""The deterministic mode's scorer: argmax_k P_k over the OvR probabilities of the whole vocabulary,
exact, with candidate pruning (`OvRScorer`, used by `generation.generate`).

Cost of the deterministic mode. P needs scale_S = |W_cls| scale_U' over all V rows: a second
V x H product per token (plus |W_cls| itself, a V x H temporary, if taken naively). The argmax
avoids it exactly: with per-row norms ||W_k||_1, ||W_k||_2 (one pass over W_cls, cached across
calls while the weight is unchanged),
scale_S_k lies in [lo_k, hi_k] (min/max and Cauchy-Schwarz bounds, widened by a rounding
margin), which bounds t_k = (loc_S_k - C_k) / scale_S_k; only the rows whose upper bound
reaches the best lower bound (usually a handful) get their exact scale_S_k, and the argmax
over them is the argmax over all V (``ovr_pruning=True``). A cheaper test first keeps only the rows that can
pass at all (a bar from a few rows, then z_k against the bar times a bound linear in the norms: three elementwise
passes over [B, V] instead of about ten; `_candidates`). The bounds are tight when scale_U'
is nearly uniform over its C dimensions (as at initialisation, W_scale = 0); when it is uneven
(coefficient of variation over ~5%, less for nearly flat logits) more than V/8 rows survive and the full
product is computed: by chunks of |W_cls| through one reused buffer (no V x H temporary; costs
about one more V x H product per token), or from a copy of |W_cls| kept for the call
(``cache_abs_weight=True``: V x H extra memory, in W_cls's dtype, i.e. half of it for bf16).

Where a bfloat16 product is fast (`fast_bf16_product`: a CPU with native bf16 matrix instructions; a float32 W_cls
through a cached bf16 copy, V x H x 2 bytes), loc_S itself starts from one: W_cls loc_U in bfloat16
(`approx_loc_scores`), whose error is bounded per entry (`_approx_error`: the roundings of both operands and of the
result, and the float32 accumulation), so the pruning keeps every row that the exact float32 product could make the
argmax. The bar's rows and the rows kept get their float32 loc_S (`_exact_loc`); the argmax and its P come from those.
On the CPU here the product at 32 rows takes 5 ms in bfloat16 against 25 ms in float32 (docs/serving.md).
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import Tensor

from .cauchy import ovr_probability
from .heads import linear_in_dtype

_ABS_CHUNK_ROWS = 2048  # rows of |W_cls| per chunk (a few MB: stays in cache, reused buffer)
# id(W_cls) -> (weakref to it, (version, data_ptr, dtype, shape), norms [2, V]); a few entries
_NORM_CACHE: dict[int, tuple] = {}
_BF16_CACHE: dict[int, tuple] = {}  # id(W_cls) -> (weakref, key, its bfloat16 copy): float32 weights on a CPU
_U_BF16 = 2.0 ** -8  # unit roundoff of bfloat16 (8 significand bits)


def fast_bf16_product(W: Tensor) -> bool:
    """Whether the bfloat16 product with W (bf16 or float32) is cheap and accumulates in float32 here: a CPU whose
    oneDNN has native bf16 instructions. Not on CUDA yet: cuBLAS may reduce in bf16
    (`allow_bf16_reduced_precision_reduction`), which `OvRScorer._approx_error` does not bound, and it is unmeasured."""
    if W.dtype not in (torch.bfloat16, torch.float32) or W.device.type != "cpu":
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without oneDNN
        return False


def _cached(cache: dict, W: Tensor, make) -> Tensor:
    """make(W), kept across calls for the same, unmodified weight (keyed on its version counter); a few entries."""
    key = (W._version, W.data_ptr(), W.dtype, tuple(W.shape))
    hit = cache.get(id(W))
    if hit is not None and hit[0]() is W and hit[1] == key:
        return hit[2]
    value = make(W)
    for stale in [i for i, e in cache.items() if e[0]() is None] + list(cache)[:-3]:
        cache.pop(stale, None)
    cache[id(W)] = (weakref.ref(W), key, value)
    return value


class OvRScorer:
    """The action head's token scores at one position per row, with per-call caches (row norms,
    optional |W_cls|): the deterministic mode's exact argmax_k P_k with candidate pruning, and
    the probability of a chosen row.

    Args:
        model: the `CausalModel` (its action head and shared W_cls).
        ovr_pruning: prune the rows that cannot hold the argmax (exact; module docstring).
        cache_abs_weight: keep a copy of |W_cls| for the call instead of chunking through a buffer.
    """

    _TOP_Z = 8  # rows per batch row whose bounds set the bar before the prefilter (`_candidates`)

    def __init__(self, model, *, ovr_pruning: bool, cache_abs_weight: bool):
        self.model = model
        self.action = model.action
        self.W_cls = model.W_cls
        self.V, self.H = self.W_cls.shape
        self.num_token_id = model.num_token_id
        self.num_row = self.action.num_row
        self.thresholds = self.action.threshold_scores()  # 0-d (scalar mode) or [V]
        self.scale_floor = self.action.scale_floor
        self.dtype = self.action.b_cls.dtype
        self.ovr_pruning = ovr_pruning
        self.cache_abs_weight = cache_abs_weight
        # loc_S from a bfloat16 product for the pruning (module docstring): float32 heads only
        self.approximate = ovr_pruning and self.dtype == torch.float32 and fast_bf16_product(self.W_cls)
        self._approx_offset: Tensor | None = None
        self._abs_W: Tensor | None = None
        self._buf: Tensor | None = None
        self._norms: Tensor | None = None
        self._rho: float | None = None  # median ||W_k||_2 / ||W_k||_1
        self._extremes: Tensor | None = None  # rows of the smallest and largest ||W_k||_1
        # rounding margin of a computed scale_S_k = sum_j |W_kj| s_j (positive terms: relative error
        # <= H * unit roundoff per accumulation; bf16/fp16 weights also round s and the result)
        acc = torch.float64 if self.dtype == torch.float64 else torch.float32
        delta = self.H * torch.finfo(acc).eps
        if self.W_cls.dtype not in (torch.float32, torch.float64):
            delta += 2 * torch.finfo(self.W_cls.dtype).eps
        self.delta = delta + 1e-6 if acc == torch.float32 else delta + 1e-12

    # -- scores of all rows ------------------------------------------------------------
    def loc_scores(self, loc_U: Tensor) -> Tensor:
        """loc_S = W_cls loc_U + b_cls over all V rows (the <NUM> row from num_row): [B, C] -> [B, V]."""
        return self.action.override_num_column(linear_in_dtype(loc_U, self.W_cls) + self.action.b_cls, loc_U)

    def approx_vocab(self, loc_U: Tensor) -> Tensor:
        """W_cls loc_U from a bfloat16 product (bf16 operands, float32 accumulation, a bf16 result), in loc_U's
        dtype: [B, C] -> [B, V]. Its error: `_approx_error`."""
        W = self.W_cls
        if W.dtype != torch.bfloat16:
            W = _cached(_BF16_CACHE, W, lambda w: w.to(torch.bfloat16))
        return F.linear(loc_U.to(torch.bfloat16), W).to(loc_U.dtype)

    def approx_loc_scores(self, loc_U: Tensor) -> Tensor:
        """loc_S over all V rows from `approx_vocab` (the <NUM> column exact, from num_row): [B, C] -> [B, V]."""
        return self.action.override_num_column(self.approx_vocab(loc_U) + self.action.b_cls, loc_U)

    def _approx_error(self, loc_U: Tensor, loc_S: Tensor) -> Tensor:
        """[B, V] bounds of |loc_S~ - loc_S| for loc_S~ from `approx_loc_scores` (eos-masked entries: 0), against
        any float32 product. Rounding x and W to bf16 errs by at most 2u |W_kj x_j| a term (u = 2^-8), the float32
        sums by H 2^-24 sum_j |W_kj x_j| for each product, and sum_j |W_kj x_j| <= ||W_k||_1 max_j |x_j|; the bf16
        result by u/(1-u) of itself; adding b_cls and subtracting C by 2^-24 of their sizes. Each widened a little."""
        u = _U_BF16
        c1 = (2 * u + u * u + self.H * torch.finfo(torch.float32).eps) * 1.01
        beta = u * 1.02 + 2.0 ** -20
        if self._approx_offset is None:  # beta |b_k| + 2^-20 (|b_k| + |C_k|), [V]
            b = self.action.b_cls.detach().abs()
            # (+ 1e-30: bf16 dot products flush subnormal terms, each below 2^-126)
            self._approx_offset = b * (beta + 2.0 ** -20) + 2.0 ** -20 * self.thresholds.detach().abs() + 1e-30
        err = loc_S.abs().nan_to_num_(posinf=0.0).mul_(beta)  # a masked (-inf) entry stays -inf: no bound needed
        err.addcmul_(loc_U.abs().amax(-1, keepdim=True).mul_(c1), self._row_norms()[:1])
        return err.add_(self._approx_offset)

    def _exact_loc(self, loc_U: Tensor, idx: Tensor | None, masked: Tensor) -> Tensor:
        """The float32 loc_S of the rows idx (None: all), -inf where `masked` (loc_S~) is: [B, C] -> [B, n]."""
        if idx is None:
            loc = self.loc_scores(loc_U)
        else:  # idx may repeat a row (the bar's rows): effective_rows puts num_row at every <NUM> among them
            loc = F.linear(loc_U, self.action.effective_rows(idx, self.W_cls)) + self.action.b_cls.index_select(0, idx)
            masked = masked.index_select(1, idx)
        return torch.where(torch.isneginf(masked), masked, loc)

    def abs_scores(self, scale_Up: Tensor, idx: Tensor | None = None) -> Tensor:
        """scale_S = max(|W_cls| scale_U', floor) for the rows `idx` (None = all): [B, C] -> [B, n]."""
        if idx is not None:
            out = linear_in_dtype(scale_Up, self.W_cls.index_select(0, idx).abs())
        elif self.cache_abs_weight:
            if self._abs_W is None:
                self._abs_W = self.W_cls.abs()
            out = linear_in_dtype(scale_Up, self._abs_W)
        else:  # by chunks of rows through one reused buffer: no V x H temporary, no page faults
            out = scale_Up.new_empty(scale_Up.shape[0], self.V)
            if self._buf is None:
                self._buf = torch.empty(min(_ABS_CHUNK_ROWS, self.V), self.H, dtype=self.W_cls.dtype,
                                        device=self.W_cls.device)
            for c in range(0, self.V, _ABS_CHUNK_ROWS):
                n = min(_ABS_CHUNK_ROWS, self.V - c)
                out[:, c:c + n] = linear_in_dtype(scale_Up, torch.abs(self.W_cls[c:c + n], out=self._buf[:n]))
        out = self.action.override_num_column(out, scale_Up, scale=True, ids=idx)
        return out.clamp_min(self.scale_floor)

    def _thresholds_at(self, idx: Tensor | None) -> Tensor:
        """C_k for the rows `idx` (None = all; a scalar threshold as it is)."""
        if idx is None or self.thresholds.dim() == 0:
            return self.thresholds
        return self.thresholds.index_select(0, idx)

    # -- one row per batch element ---------------------------------------------------
    def row_probability(self, ids: Tensor, loc_S_rows: Tensor, scale_Up: Tensor) -> Tensor:
        """P of the row ids[b] for each b, given its loc_S: [B]."""
        W = self.action.effective_rows(ids, self.W_cls)
        scale = (scale_Up * W.abs()).sum(-1).clamp_min(self.scale_floor)
        return ovr_probability(loc_S_rows, scale, self._thresholds_at(ids))

    def row_locations(self, loc_U: Tensor, ids: Tensor) -> Tensor:
        """loc_S of the row ids[b] for each b: [B]."""
        W = self.action.effective_rows(ids, self.W_cls)
        return (loc_U * W).sum(-1) + self.action.b_cls.index_select(0, ids)

    # -- deterministic: argmax_k P_k -------------------------------------------------
    def _row_norms(self) -> Tensor:
        """[2, V]: ||W_k||_1 and ||W_k||_2 of every row of the effective W_cls. One pass over W_cls,
        cached across calls for the same, unmodified weight (keyed on its version counter)."""
        if self._norms is None:
            norms = _cached(_NORM_CACHE, self.W_cls, _norms_of).to(self.dtype, copy=True)
            if self.num_row is not None:
                r = self.num_row.detach()
                norms[0, self.num_token_id], norms[1, self.num_token_id] = r.abs().sum(), r.norm()
            self._norms = norms
        return self._norms

    def _bound_coefficients(self, scale_Up: Tensor) -> tuple[Tensor, Tensor]:
        """[B, 2] each: scale_S_k of batch row b lies in [coef_lo[b] . (||W_k||_1, ||W_k||_2), coef_hi[b] . (...)]
        (then the floor), per batch row the tighter of two bounds: min/max  s_min ||W_k||_1 <= . <= s_max ||W_k||_1,
        and Cauchy-Schwarz  |sum_j |W_kj| (s_j - s_mean)| <= ||W_k||_2 ||s - s_mean||_2; widened by 3 delta for the
        rounding of the computed scale_S, of the norms and of the bounds themselves."""
        norms = self._row_norms()
        s = scale_Up
        s_mean = s.mean(-1, keepdim=True)
        s_min = s.amin(-1, keepdim=True)
        s_max = s.amax(-1, keepdim=True)
        r = (s - s_mean).norm(dim=-1, keepdim=True)
        if self._rho is None:
            self._rho = float((norms[1] / norms[0].clamp_min(1e-30)).median())
        d2 = 3 * self.delta
        zero = torch.zeros_like(r)
        cs_lo = r * self._rho < s_mean - s_min
        cs_hi = r * self._rho < s_max - s_mean
        coef_lo = torch.where(cs_lo, torch.cat([s_mean * (1 - d2), -r * (1 + d2)], 1),
                              torch.cat([s_min * (1 - d2), zero], 1))
        coef_hi = torch.where(cs_hi, torch.cat([s_mean * (1 + d2), r * (1 + d2)], 1),
                              torch.cat([s_max * (1 + d2), zero], 1))
        return coef_lo, coef_hi

    def _t_bounds(self, z: Tensor, norms: Tensor, coef_lo: Tensor, coef_hi: Tensor) -> tuple[Tensor, Tensor]:
        """(t_lo, t_hi) [B, n]: t_k = z_k / scale_S_k lies between them, for the n rows whose z [B, n] and norms
        [2, n] are given. t is monotone in scale_S, so it lies between z_k / lo_k and z_k / hi_k."""
        lo = (coef_lo @ norms).clamp_min_(self.scale_floor)
        hi = (coef_hi @ norms).clamp_min_(self.scale_floor)
        q_lo = z / lo
        q_hi = torch.div(z, hi, out=hi)
        return torch.minimum(q_lo, q_hi), torch.maximum(q_lo, q_hi, out=q_lo)

    def _candidates(self, z: Tensor, scale_Up: Tensor, exact=None, z_up: Tensor | None = None) -> Tensor | None:
        """Rows that can hold argmax_k t_k, t_k = z_k / scale_S_k (union over the batch), or None
        when the bounds leave more than V/8 of them. exact: None (z is exact), or z from a bfloat16 product, z_up
        [B, V] its upper bounds and exact(idx) [B, n] the float32 z of the rows idx (the bar's and the kept rows').

        A row k can hold it only if its upper bound t_hi_k reaches bar = max_k t_lo_k (`_t_bounds`). Bounding every
        row takes about ten passes over [B, V]; two cheaper steps first keep the rows that can pass at all:
        1. a bar from a few rows (t_lo is a lower bound of max t wherever it is taken): each batch row's largest z,
           and the _TOP_Z rows of largest and of smallest ||W_k||_1 (where t peaks when z barely varies);
        2. t_hi_k >= bar needs z_k >= bar lo_k (bar >= 0) or z_k >= bar hi_k (bar < 0), the bounds being linear in
           the row norms: three elementwise passes and a maximum over the batch, made a few ulps looser.
        Only the rows that pass get both bounds.
        """
        norms = self._row_norms()
        coef_lo, coef_hi = self._bound_coefficients(scale_Up)
        if self._extremes is None:  # the rows of smallest and largest ||W_k||_1 (fixed for the call)
            k = min(self._TOP_Z, self.V)
            self._extremes = torch.cat([norms[0].topk(k).indices, norms[0].topk(k, largest=False).indices])
        probe = torch.cat([z.argmax(-1), self._extremes])  # repeats are harmless (no unique: no sync on CUDA)
        z_probe = z.index_select(1, probe) if exact is None else exact(probe)
        t_lo, _ = self._t_bounds(z_probe, norms.index_select(1, probe), coef_lo, coef_hi)
        bar = t_lo.amax(-1, keepdim=True)
        # z_k >= bar * bound_k with bound_k = max(coef . n_k, floor), bounded below by bar (coef . n_k) (bar >= 0)
        # or bar (coef . n_k + floor) (bar < 0); weights and offset moved down by 16 ulps of their terms, more
        # than the rounding of d = z - w . n_k - offset (whose sign decides)
        w = torch.where(bar >= 0, bar * coef_lo, bar * coef_hi)
        offset = torch.where(bar >= 0, torch.zeros_like(bar), bar * self.scale_floor)
        slack = 16 * torch.finfo(w.dtype).eps
        w, offset = w - w.abs() * slack, offset - offset.abs() * slack
        d = torch.addcmul(z if z_up is None else z_up, w[:, :1], norms[:1], value=-1)
        d = d.addcmul_(w[:, 1:], norms[1:], value=-1).sub_(offset)
        keep = (d.amax(0) >= 0).nonzero().squeeze(1)  # amax over the batch: a tenth of the time of any(0) on CPU
        if not keep.numel():  # no row passes: only a z that is not finite (NaN) gives that; the exact path decides
            return None
        if keep.numel() > self.V // 2:  # most rows pass: bound them all in place (an approximate z: give up)
            if exact is not None:
                return None
            keep = None
        zk = z if keep is None else (z.index_select(1, keep) if exact is None else exact(keep))
        t_lo, t_hi = self._t_bounds(zk, norms if keep is None else norms.index_select(1, keep), coef_lo, coef_hi)
        hit = (t_hi >= t_lo.amax(-1, keepdim=True)).any(0).nonzero().squeeze(1)
        idx = hit if keep is None else keep.index_select(0, hit)
        if idx.numel() > max(64, self.V // 8):
            return None
        return idx

    def ovr_argmax(self, loc_S: Tensor, scale_Up: Tensor, loc_U: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(argmax_k P_k, its P) per row: [B, V], [B, C] -> [B], [B]. loc_U: loc_S is `approx_loc_scores(loc_U)`
        (eos-masked or not); the argmax and P are those of the float32 loc_S all the same."""
        if self.ovr_pruning:
            z = loc_S - self.thresholds
            exact_z = z_up = None
            if loc_U is not None:
                z_up = z + self._approx_error(loc_U, loc_S)
                exact_z = lambda idx: self._exact_loc(loc_U, idx, loc_S) - self._thresholds_at(idx)  # noqa: E731
            idx = self._candidates(z, scale_Up, exact_z, z_up)
            if idx is not None:
                loc = loc_S.index_select(1, idx) if loc_U is None else self._exact_loc(loc_U, idx, loc_S)
                P = ovr_probability(loc, self.abs_scores(scale_Up, idx), self._thresholds_at(idx))
                j = P.argmax(-1)
                return idx[j], P.gather(1, j.unsqueeze(1)).squeeze(1)
        if loc_U is not None:  # no pruning, or the bounds kept too many rows: the float32 product after all
            loc_S = self._exact_loc(loc_U, None, loc_S)
        P = ovr_probability(loc_S, self.abs_scores(scale_Up), self.thresholds)
        tok = P.argmax(-1)
        return tok, P.gather(1, tok.unsqueeze(1)).squeeze(1)


def _norms_of(W: Tensor) -> Tensor:
    """[2, V]: ||W_k||_1 and ||W_k||_2, by chunks of rows through one buffer."""
    V, H = W.shape
    norms = torch.empty(2, V, dtype=torch.float32 if W.dtype != torch.float64 else W.dtype, device=W.device)
    buf = torch.empty(min(_ABS_CHUNK_ROWS, V), H, dtype=W.dtype, device=W.device)
    for c in range(0, V, _ABS_CHUNK_ROWS):
        n = min(_ABS_CHUNK_ROWS, V - c)
        b = torch.abs(W[c:c + n], out=buf[:n])
        norms[0, c:c + n] = b.sum(-1, dtype=norms.dtype)
        torch.mul(b, b, out=b)
        norms[1, c:c + n] = b.sum(-1, dtype=norms.dtype).sqrt_()
    return norms
