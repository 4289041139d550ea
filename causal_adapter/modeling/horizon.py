"""A horizon: the next H values after a prompt, each with its intervals, from paths of the causal representation
(SPEC 4, "A horizon"; `CausalModel.predict_horizon`, `causal-adapter predict --horizon H`).

    model.predict_horizon(["Monthly rain. 2016-06: 31.7; 2016-07:"], tokenizer=tok, horizon=3, paths=100,
                          continuations=[["; 2016-08:", "; 2016-09:"]], seed=0)
    -> [{"row": 0, "value": ..., (predict_values' columns), "horizon": [{"step": 1, "value": ..., "lower_50": ...,
        "upper_50": ..., "lower_90": ..., "upper_90": ...}, {"step": 2, ...}, {"step": 3, ...}]}]

The paths (lanes) of one prompt share its prefill: the prompt goes through the backbone once, in the same batches
and with the same encodings as `predict_values` (`prediction.predict_forward`), so step 1 IS the one-step prediction,
value and intervals. Its keys and values are then expanded to 1 + N lanes, which run as rows of one batch:

* lane 0, the deterministic path: the value is the value head's location (loc_Y) at each step, fed back;
* lanes 1..N, causal sampling (seed 002, SPEC 4 ``causal``): at each value an individual
  u = loc_U + scale_U' tan(pi (eps - 1/2)) is drawn, the value is where u puts it in the value head's own Cauchy
  (`individual_draw`: the head is linear in u through w_reg, so w_reg . (u - loc_U) / (|w_reg| . scale_U') is an
  exact standard Cauchy deviate, and the value is loc_Y + scale_Y times it), and it is fed back. The noise-free
  action's value itself (loc_Y at u) has the width |w_reg| . scale_U', which nothing fits to the values: on the
  synthetic panel of `benchmarks/scales.py` (an adapter of 4 steps) it was 27,000x scale_Y at step 1 and its paths
  reached 1e14 by step 4, where the head's own width, set by the regression NLL and calibrated on validation,
  keeps them on the data's scale. `individual="path"` draws eps once per lane (one individual throughout, SPEC's
  ``shared_individual``); ``"step"`` draws it afresh at every value (and, without continuations, every token).

Between two values a lane writes the text before the next one: the row's `continuations` (tokens forced: every lane
feeds the same text, only the values differ), or, without them, the tokens its own mode chooses (lane 0 the
deterministic mode, lanes 1..N the causal mode on their u, `generation.choose`), with the number layout of training
(`generation.place`), until it writes a number after the two tokens the prompt ends with (``": "``): its next value;
a number written elsewhere (a label's year) is text. A lane that writes no value within `MAX_TEXT_TOKENS` tokens (or
writes eos) ends there: its later values are NaN (a deterministic path that ends raises).

The interval of step h >= 2, on the head's scale (the value, or log y): the paths give a predictive distribution, the
mixture over the sampled lanes of each lane's own Cauchy(loc_Y, scale_Y) at that step (the spread of the histories
the lanes wrote, plus the next value's own width). Its central 50% half-width is the step's spread s_h. With a
calibration map of that step (`CausalAdapterConfig.horizon_calibration`, fitted by `train()` on validation rows,
`training.value_head.horizon`), the interval at level q is value_h -+ c_{h,q} s_h, c_{h,q} the split-conformal
quantile of the validation scores |y_h - value_h| / s_h, exactly as the one-step map is for step 1
(`intervals.fit_calibration`). Beyond the steps validation covered the last covered step's multiplier is widened by
sqrt(h / H_v) (`widened_multiplier`); an adapter with no horizon map gives the mixture's own quantiles (raw).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from .._compat import cache_kwargs
from ..numbers import find_numbers
from .cauchy import cauchy_cdf
from .generation.cache import cache_from, key_value_only
from .generation.choose import choose, draw_eps
from .generation.options import DecodingOptions
from .generation.prepare import Group, prepare, text_prompts_tokenizer
from .heads import full_precision, individual_draw, recent_values
from .intervals import conformal_multiplier
from .value_transform import ValueMap
from .prediction import (DEFAULT_LEVELS, batch_series, check_levels, encoded_batches, level_name, predict_forward,
                         prediction_rows)

#: the longest horizon `predict_horizon` accepts
MAX_HORIZON = 64
#: the fewest paths with which intervals are given (fewer describe the tails of the mixture poorly)
MIN_PATHS = 20
#: the most paths per row
MAX_PATHS = 10000
DEFAULT_PATHS = 100
#: tokens a lane may write between two values when it writes the text itself (no continuations)
MAX_TEXT_TOKENS = 48
#: a sampled value beyond this magnitude ends its lane (a Cauchy draw fed back can grow past float32's range)
MAX_FED_VALUE = 1e30
#: u drawn once per path ("path": one individual throughout) or afresh at every step ("step")
INDIVIDUALS = ("path", "step")
DEFAULT_INDIVIDUAL = "path"
#: the level whose half-width is a step's spread s_h (the unit of the per-step scores)
SPREAD_LEVEL = 0.5


# ----------------------------------------------------------------------------- checks
def check_horizon(horizon: int) -> int:
    if isinstance(horizon, bool) or not isinstance(horizon, int) or not 1 <= horizon <= MAX_HORIZON:
        raise ValueError(f"horizon must be an integer in [1, {MAX_HORIZON}], got {horizon!r}")
    return horizon


def check_paths(paths: int, intervals: bool = True) -> int:
    low = MIN_PATHS if intervals else 0
    if isinstance(paths, bool) or not isinstance(paths, int) or not low <= paths <= MAX_PATHS:
        why = f" (intervals are drawn from the paths: at least {MIN_PATHS})" if intervals else ""
        raise ValueError(f"paths must be an integer in [{low}, {MAX_PATHS}]{why}, got {paths!r}")
    return paths


def check_individual(individual: str) -> str:
    if individual not in INDIVIDUALS:
        raise ValueError(f"individual must be one of {INDIVIDUALS}, got {individual!r}")
    return individual


def check_continuations(continuations, prompts: Sequence[str], horizon: int) -> list[list[str] | None]:
    """One entry per prompt: its H - 1 texts, or None (the model writes the text itself; the prompt must then hold a
    number, whose layout the model follows)."""
    if continuations is None:
        continuations = [None] * len(prompts)
    if len(continuations) != len(prompts):
        raise ValueError(f"continuations: give one list per prompt ({len(prompts)}), got {len(continuations)}")
    out = []
    for i, (p, c) in enumerate(zip(prompts, continuations)):
        if c is None:
            if horizon > 1 and not find_numbers(p):
                raise ValueError(f"row {i}: the prompt holds no number and has no continuations: give its "
                                 f"{horizon - 1} continuations (the text before values 2..{horizon})")
            out.append(None)
            continue
        if isinstance(c, str) or not isinstance(c, (list, tuple)) or not all(isinstance(t, str) for t in c):
            raise ValueError(f"row {i}: continuations must be a list of {horizon - 1} strings, got {c!r:.80}")
        if len(c) != horizon - 1:
            raise ValueError(f"row {i}: continuations holds {len(c)} texts; horizon {horizon} needs {horizon - 1} "
                             f"(the text before values 2..{horizon})")
        out.append(list(c))
    return out


# ----------------------------------------------------------------------------- the paths
@dataclass
class Paths:
    """The lanes of one prompt, lane 0 the deterministic path: value [n, H] (value units, NaN after a lane ended),
    loc_Y / scale_Y [n, H] (the head's scale) at each value's position."""

    value: Tensor
    loc_Y: Tensor
    scale_Y: Tensor


def continuation_tokens(model, ntok, texts: Sequence[str]) -> list[tuple[list[int], list[float]]]:
    """Each continuation text -> (ids, values), ending where a number is read: the adapter's number prefix is
    appended after a last token that never preceded a training number (as `prediction.encode_prompts`)."""
    cfg = model.causal_config
    out = []
    for text in texts:
        ids, vals = [], []
        if text:
            enc = ntok.encode_batch([text], return_offsets=False)[0]
            ids, vals = list(enc.input_ids), [float(v) for v in enc.numeric_values]
        if cfg.number_prefix_id is not None and (not ids or ids[-1] not in set(cfg.number_contexts)):
            ids, vals = ids + [cfg.number_prefix_id], vals + [0.0]
        out.append((ids, vals))
    return out


def _lane_cache(model, out, row: int, pad: int, n: int, ids: Tensor, vals: Tensor):
    """The prompt's cache expanded to n lanes (its left padding cut): a view of the one prefill, copied once by the
    first step's concatenation. A cache that is not all key/value layers (a hybrid family's recurrent state) is
    prefilled again for the n lanes."""
    cache = out.cache
    if key_value_only(cache):
        layers = [(layer.keys[row:row + 1, :, pad:].expand(n, -1, -1, -1),
                   layer.values[row:row + 1, :, pad:].expand(n, -1, -1, -1)) for layer in cache.layers]
        return cache_from(layers)
    seq_ids, seq_vals = ids[row:row + 1, pad:].expand(n, -1), vals[row:row + 1, pad:].expand(n, -1)
    return model(seq_ids, seq_vals, torch.ones_like(seq_ids), use_cache=True).cache


@dataclass
class StepOutput:
    """The heads at the last fed position of n lanes: loc_U, scale_U [n, 1, C], loc_Y, scale_Y [n, 1], recent
    [n, 1, K] (None without), hidden_states z [n, 1, H] (the layout of `CausalOutput`, one position)."""

    loc_U: Tensor
    scale_U: Tensor
    loc_Y: Tensor
    scale_Y: Tensor
    recent: Tensor | None
    hidden_states: Tensor


def step_forward(model, cache, ids: Tensor, values: Tensor, recent_before: Tensor | None, length: int,
                 regression: bool = True, log_rows: Tensor | None = None) -> StepOutput:
    """ids / values [n, s] fed after `length` cached positions (no padding: every lane has the same length): the
    backbone over them (`cache` grows in place), then the heads on the LAST position only, as `CausalModel.forward`
    computes them there (the value head's recent numbers from `recent_before` [n, K] and the fed ones).
    regression=False: loc_Y / scale_Y left None (only the backbone's state and the recent numbers are needed)."""
    n, s = ids.shape
    mask = torch.ones((n, length + s), dtype=torch.long, device=ids.device)
    pos = torch.arange(length, length + s, device=ids.device).expand(n, s)
    out = model.decoder(inputs_embeds=model.embed(ids, values), attention_mask=mask, position_ids=pos, use_cache=True,
                        **cache_kwargs(model.decoder, cache))
    z = out.last_hidden_state[:, -1:]
    with full_precision(z.device):
        loc_U, scale_U = model.abduction(z)
        recent = None
        if model.action.recent_values:
            dev = loc_U.device
            width = getattr(model.action, "recent_window", None) or model.action.recent_values  # as forward reads
            recent = recent_values(ids.to(dev), values.to(dev), model.num_token_id, width, recent_before)[:, -1:]
        loc_Y = scale_Y = None
        if regression:
            loc_Y, scale_Y = model.action.regression(loc_U, model.action.noisy_scale(scale_U), recent, log_rows)
    return StepOutput(loc_U, scale_U, loc_Y, scale_Y, recent, z)


def _draw(gen, n: int, C: int, like: Tensor) -> Tensor:
    return draw_eps(n, C, like.dtype, like.device, gen)


@torch.no_grad()
def run_paths(model, out, row: int, pad: int, ids: Tensor, vals: Tensor, continuation: list | None, horizon: int,
              paths: int, gen: torch.Generator | None, individual: str = DEFAULT_INDIVIDUAL,
              groups: tuple[Group, Group] | None = None, floored: bool = False, log: bool = False) -> Paths:
    """The 1 + `paths` lanes of prompt `row` of a prefill `out` (`predict_forward` with use_cache; `pad` its left
    padding, ids / vals [B, S] its inputs), `horizon` values each; `floored`: the row's series never goes below 0
    (`series.RowSeries.floored`), so no lane writes (or feeds back) a value below it; `log`: a "series" head tells
    it on log y (`series.RowSeries.log`). `continuation`: (ids, values) of the text before
    values 2..H (`continuation_tokens`), or None (the lanes write it, with `groups`: `text_groups`)."""
    n = 1 + paths
    cache = _lane_cache(model, out, row, pad, n, ids, vals)
    L = ids.shape[1] - pad
    act = model.action

    def at(o, i: int | slice = -1):
        return (o.loc_U[:, i], o.scale_U[:, i], o.loc_Y[:, i], o.scale_Y[:, i],
                None if o.recent is None else o.recent[:, i], o.hidden_states[:, i])

    loc_U, scale_U, loc_Y, scale_Y, recent, z = (t[row:row + 1].expand(n, *t.shape[1:]) if t is not None else None
                                                  for t in at(out))
    dev = loc_U.device
    value = torch.full((n, horizon), math.nan, dtype=torch.float64, device=dev)
    locs, scales = value.clone(), value.clone()
    vm, decimals = model.value_map.row(floored, log), model.causal_config.value_decimals
    log_rows = torch.full((n, 1), log, device=dev) if model.value_map.series else None  # the lanes' scale
    C = loc_U.shape[-1]
    eps_path = _draw(gen, paths, C, loc_U) if individual == "path" and paths else None

    def draw_values(loc_U, scale_U, loc_Y, scale_Y, eps):
        """The sampled lanes' values [N] on the head's scale: the head's Cauchy at the quantile their u gives it
        (`individual_draw`)."""
        with full_precision(dev):
            t = individual_draw(act, eps, act.noisy_scale(scale_U))
        return loc_Y.double() + scale_Y.double() * t.double()

    def fed(v: Tensor) -> Tensor:  # as generation writes a value and feeds it back (`record.written_values`)
        return v if decimals is None else torch.round(v, decimals=decimals)

    def forward(new_ids: Tensor, new_vals: Tensor, recent_before, length: int, regression: bool = True):
        """The lanes' next tokens [n, s] through the backbone (cache grown in place); the heads at the last one."""
        return step_forward(model, cache, new_ids, new_vals, recent_before, length, regression, log_rows)

    in_dev = model.input_device
    num = model.num_token_id
    vdtype = vals.dtype
    if continuation is not None or horizon == 1:
        dead = torch.zeros(n, dtype=torch.bool, device=dev)  # lanes whose value left the finite range: ended
        for h in range(horizon):
            if h:  # the lanes' own heads after what they fed (step 1: the prompt's, lane 0 `predict_values`' row)
                with full_precision(dev):
                    loc_Y, scale_Y = act.regression(loc_U, act.noisy_scale(scale_U), recent, log_rows)
            head = loc_Y.double().clone()
            if paths:
                eps = eps_path if eps_path is not None else _draw(gen, paths, C, loc_U)
                head[1:] = draw_values(loc_U[1:], scale_U[1:], loc_Y[1:], scale_Y[1:], eps)
            v = vm.to_value(head)
            dead |= ~torch.isfinite(v) | (v.abs() > MAX_FED_VALUE) | ~torch.isfinite(loc_Y) | ~torch.isfinite(scale_Y)
            nan = torch.full_like(v, math.nan)
            value[:, h] = torch.where(dead, nan, v)
            locs[:, h] = torch.where(dead, nan, loc_Y.double())
            scales[:, h] = torch.where(dead, nan, scale_Y.double())
            if h == horizon - 1:
                break
            if bool(dead[0]):
                raise ValueError(f"the deterministic path's value {h + 1} is {float(v[0])!r} (not finite)")
            c_ids, c_vals = continuation[h]
            new_ids = torch.tensor([[num] + c_ids], dtype=torch.long, device=in_dev).expand(n, -1)
            new_vals = torch.tensor([[0.0] + c_vals], dtype=vdtype, device=in_dev).repeat(n, 1)
            new_vals[:, 0] = fed(value[:, h].nan_to_num(0.0)).to(in_dev, vdtype)  # an ended lane feeds 0, unread
            o = forward(new_ids, new_vals, recent, L, regression=False)
            L += new_ids.shape[1]
            loc_U, scale_U, recent = o.loc_U[:, -1], o.scale_U[:, -1], None if o.recent is None else o.recent[:, -1]
        return Paths(value, locs, scales)
    if groups is None:
        raise ValueError("a prompt without continuations needs the decoding groups (`text_groups`)")
    context = (int(ids[row, -2]) if ids.shape[1] - pad >= 2 else -1, int(ids[row, -1]))
    return _free_text_paths(model, cache, L, horizon, paths, gen, groups, eps_path, forward,
                            (loc_U, scale_U, loc_Y, scale_Y, recent, z), value, locs, scales, draw_values, fed, context,
                            vm)


def text_groups(model, ntok, gen: torch.Generator | None, individual: str) -> tuple[Group, Group]:
    """The decoding groups of the lanes that write their own text: the deterministic mode (lane 0) and the causal
    mode (lanes 1..N, `individual` "path": one eps per lane, given; "step": drawn at each token from `gen`)."""
    def options(mode: str) -> DecodingOptions:
        return DecodingOptions(mode=mode, max_new_tokens=None, max_length=None, min_new_tokens=0, eos_token_id=None,
                               pad_token_id=None, stop_strings=[], do_sample=False, temperature=None, top_k=None,
                               top_p=None, repetition_penalty=None, logits_processor=None,
                               shared_individual=mode == "causal" and individual == "path", return_eps=False)

    groups = []
    for mode in ("deterministic", "causal"):
        g = Group(adapter=None, opts=options(mode), ntok=ntok, gen=gen)
        g.settings = prepare(model, g)
        groups.append(g)
    return groups[0], groups[1]


def _free_text_paths(model, cache, L, horizon, paths, gen, groups, eps_path, forward, state, value, locs,
                     scales, draw_values, fed, context: tuple[int, int], vm: ValueMap) -> Paths:
    """`run_paths` without continuations: each lane writes its own text between the values (module docstring). A
    number the lane writes after `context`, the two tokens the prompt ends with (``": "``), is its next value; any
    other number it writes (a label's year) is text: written and fed back, not a step."""
    loc_U, scale_U, loc_Y, scale_Y, recent, z = state
    n = 1 + paths
    dev = loc_U.device
    num = model.num_token_id
    # step 1 at the prompt's end (a number comes there, as in `predict_values`)
    head = loc_Y.double().clone()
    if paths:
        eps = eps_path if eps_path is not None else _draw(gen, paths, loc_U.shape[-1], loc_U)
        head[1:] = draw_values(loc_U[1:], scale_U[1:], loc_Y[1:], scale_Y[1:], eps)
    value[:, 0], locs[:, 0], scales[:, 0] = vm.to_value(head), loc_Y.double(), scale_Y.double()
    if horizon == 1:
        return Paths(value, locs, scales)

    det, cau = groups
    eos = det.settings.eos_set
    lanes = torch.arange(n, device=dev)  # the lanes still writing, in cache order
    step = torch.ones(n, dtype=torch.long, device=dev)  # values written so far per lane
    written = torch.zeros(n, dtype=torch.long, device=dev)  # tokens since the lane's last value
    tok = torch.full((n,), num, dtype=torch.long, device=dev)
    fed_val = fed(value[:, 0]).to(dev)
    prev = tok.clone()  # the last token each lane fed, and the one before it
    prev2 = torch.full((n,), context[1], dtype=torch.long, device=dev)
    pending = torch.zeros(n, dtype=torch.bool, device=dev)
    in_dev = model.input_device
    while True:
        o = forward(tok.unsqueeze(1).to(in_dev), fed_val.unsqueeze(1).to(in_dev, torch.float32), recent, L, False)
        L += 1
        recent = None if o.recent is None else o.recent[:, -1]
        z = o.hidden_states[:, -1]
        tok = torch.empty_like(tok)
        val = torch.full(tok.shape, math.nan, dtype=torch.float64, device=dev)
        ly, sy = val.clone(), val.clone()
        writable = torch.ones(tok.shape, dtype=torch.bool, device=dev)
        pend = torch.zeros_like(pending)
        for g, rows in ((det, (lanes == 0).nonzero().squeeze(1)), (cau, (lanes > 0).nonzero().squeeze(1))):
            if not rows.numel():
                continue
            shared = None if eps_path is None or g is det else eps_path[lanes[rows] - 1]
            with full_precision(dev):
                c = choose(model, g, z[rows], prev=prev[rows], pending=pending[rows],
                           recent=None if recent is None else recent[rows], shared_eps=shared,
                           log=torch.full(rows.shape, vm.log, device=dev))
            tok[rows], pend[rows], writable[rows] = c.tok, c.pending, c.writable
            # the causal lanes' value: the head's own Cauchy where the lane's u puts it (`heads.individual_draw`)
            val[rows], ly[rows], sy[rows] = c.val.double(), c.loc_Y.double(), c.scale_Y.double()
        if vm.positive:  # the row's series never goes below 0 (`ValueMap.floored`)
            val = val.clamp_min(0.0)
        is_num = tok == num
        is_val = is_num & (prev2 == context[0]) & (prev == context[1])  # written where value 1 was
        prev2, prev, pending = prev, tok, pend
        written = torch.where(is_val, torch.zeros_like(written), written + 1)
        for i in is_val.nonzero().squeeze(1).tolist():
            lane, h = int(lanes[i]), int(step[i])
            if bool(writable[i]) and math.isfinite(float(val[i])) and abs(float(val[i])) <= MAX_FED_VALUE:
                value[lane, h], locs[lane, h], scales[lane, h] = val[i], ly[i], sy[i]
        step = step + is_val.long()
        bad = is_num & (~torch.isfinite(val) | (val.abs() > MAX_FED_VALUE) | ~writable)  # as `generation.record.faults`
        ended = (written > MAX_TEXT_TOKENS) | torch.isin(tok, torch.tensor(sorted(eos), dtype=torch.long, device=dev))
        ended |= bad
        done = (step >= horizon) | ended
        if bool(bad[lanes == 0].any()):
            raise ValueError(f"the deterministic path chose a number after value {int(step[0])} that the value head "
                             "cannot write (not finite, or outside a log head's bounds: a position it was not fitted "
                             "at): give the row's continuations (the text before each value)")
        if bool(ended[lanes == 0].any()):
            raise ValueError(f"the deterministic path wrote no value (a number after the text the prompt ends with) "
                             f"within {MAX_TEXT_TOKENS} tokens after value {int(step[0])}: give the row's "
                             "continuations (the text before each value)")
        fed_val = torch.where(is_num, fed(val).nan_to_num(0.0), torch.zeros_like(val))
        if bool(done.all()):
            break
        if bool(done.any()):
            keep = (~done).nonzero().squeeze(1)
            cache.reorder_cache(keep.to(in_dev))
            lanes, step, written, tok, fed_val = lanes[keep], step[keep], written[keep], tok[keep], fed_val[keep]
            prev, prev2, pending = prev[keep], prev2[keep], pending[keep]
            recent = None if recent is None else recent[keep]
    return Paths(value, locs, scales)


# ----------------------------------------------------------------------------- intervals
def mixture_quantile(loc: Tensor, scale: Tensor, p: float | Sequence[float], iters: int = 64) -> Tensor:
    """The p-quantiles of the equal mixture of Cauchy(loc_i, scale_i) over the last axis: [..., N] -> [...] for one
    p, [P, ...] for a sequence of P (NaN entries left out; NaN with none), by bisection on mean_i F_i(x) = p, all p
    at once (every component's p-quantile brackets the mixture's)."""
    one = isinstance(p, (int, float))
    ps = torch.tensor([p] if one else list(p), dtype=torch.float64, device=loc.device)
    ps = ps.reshape(-1, *([1] * (loc.dim() - 1)))
    ok = torch.isfinite(loc) & torch.isfinite(scale) & (scale > 0)
    loc = torch.where(ok, loc, torch.zeros_like(loc)).unsqueeze(0)
    scale = torch.where(ok, scale, torch.ones_like(scale)).unsqueeze(0)
    w = ok.double() / ok.double().sum(-1, keepdim=True).clamp_min(1)
    comp = loc + scale * torch.tan(math.pi * (ps.unsqueeze(-1) - 0.5))  # [P, ..., N] each component's quantile
    lo = torch.where(ok, comp, math.inf).amin(-1)
    hi = torch.where(ok, comp, -math.inf).amax(-1)
    for _ in range(iters):
        mid = (lo + hi) / 2
        below = (w * cauchy_cdf(mid.unsqueeze(-1), loc, scale)).sum(-1) < ps
        lo, hi = torch.where(below, mid, lo), torch.where(below, hi, mid)
    out = torch.where(ok.any(-1), (lo + hi) / 2, torch.full_like(lo, math.nan))
    return out[0] if one else out


def path_spread(p: Paths, levels: Sequence[float] = ()) -> tuple[Tensor, Tensor, dict[float, tuple[Tensor, Tensor]]]:
    """(centre [H], spread s [H], {level: raw (lower [H], upper [H])}) of one prompt's lanes on the head's scale: the
    deterministic path's location, the central `SPREAD_LEVEL` half-width of the sampled lanes' mixture (the
    deterministic lane's own Cauchy without sampled lanes), and the mixture's central interval of each of `levels`."""
    sampled = slice(1, None) if p.loc_Y.shape[0] > 1 else slice(0, 1)
    loc, scale = p.loc_Y[sampled].T, p.scale_Y[sampled].T  # [H, N]
    ps = [(1 - SPREAD_LEVEL) / 2, (1 + SPREAD_LEVEL) / 2]
    for q in levels:
        ps += [(1 - q) / 2, (1 + q) / 2]
    qs = mixture_quantile(loc, scale, ps)
    raw = {q: (qs[2 + 2 * i], qs[3 + 2 * i]) for i, q in enumerate(levels)}
    return p.loc_Y[0], (qs[1] - qs[0]) / 2, raw


def widened_multiplier(steps: list[dict], h: int, level: float) -> tuple[float, bool]:
    """(c_{h,q}, calibrated) for step h >= 2 from the per-step maps `steps` (maps of steps 2, 3, ...): the step's own
    split-conformal quantile, or beyond the last covered step H_v the last one's times sqrt(h / H_v) (a random walk's
    growth: the error of an iterated forecast grows at least so)."""
    k = h - 2
    if k < len(steps):
        return conformal_multiplier(steps[k], level), True
    last = len(steps) + 1
    return conformal_multiplier(steps[-1], level) * math.sqrt(h / last), False


def step_intervals(config, horizon: int) -> list[str]:
    """How the intervals of steps 1..`horizon` are made, by an adapter's `config`: "calibrated" (a map fitted on
    validation: `value_calibration` for step 1, `horizon_calibration`'s own map of step h >= 2), "widened" (beyond the
    steps validation covered: the last map's multiplier widened, `widened_multiplier`) or "raw" (no map: the head's
    Cauchy for step 1, the paths' mixture for h >= 2). Only "calibrated" steps are calibrated."""
    cal = config.horizon_calibration
    out = ["calibrated" if config.value_calibration is not None else "raw"]
    for h in range(2, horizon + 1):
        out.append("raw" if not cal else "calibrated" if h - 2 < len(cal["steps"]) else "widened")
    return out


def horizon_steps(model, first: dict, p: Paths | None, levels: tuple[float, ...], calibration: dict | None,
                  floored: bool = False, log: bool = False) -> list[dict]:
    """The `horizon` list of one prompt: step 1 is the one-step prediction `first` (`predict_values`' row) as it is;
    steps 2..H the deterministic path's value with the intervals of the module docstring (floored at 0 for a
    `floored` row, on log y for a `log` one, as `run_paths`)."""
    vm = model.value_map.row(floored, log)
    out = [{"step": 1, "value": first["value"],
            **{k: first[f"{k}"] for q in levels for k in (f"lower_{level_name(q)}", f"upper_{level_name(q)}")}}]
    if p is None or p.value.shape[1] == 1:
        return out
    H = p.value.shape[1]
    centre, spread, raw = path_spread(p, () if calibration else levels)
    for h in range(2, H + 1):
        row = {"step": h, "value": float(p.value[0, h - 1])}
        for q in levels:
            name = level_name(q)
            if calibration:
                c, _ = widened_multiplier(calibration["steps"], h, q)
                half = c * float(spread[h - 1]) if math.isfinite(c) else math.inf
                lo = torch.tensor(float(centre[h - 1]) - half, dtype=torch.float64)
                hi = torch.tensor(float(centre[h - 1]) + half, dtype=torch.float64)
            else:
                lo, hi = raw[q][0][h - 1], raw[q][1][h - 1]
            row[f"lower_{name}"], row[f"upper_{name}"] = float(vm.to_value(lo)), float(vm.to_value(hi))
        out.append(row)
    return out


# ----------------------------------------------------------------------------- the entry point
def predict_horizon(model, prompts: str | Sequence[str], tokenizer=None, horizon: int = 1, paths: int = DEFAULT_PATHS,
                    levels: Sequence[float] | None = DEFAULT_LEVELS, continuations=None, seed: int | None = 0,
                    batch_size: int = 16, individual: str | None = None,
                    progress: Callable[[int], Any] | None = None) -> list[dict[str, Any]]:
    """The next `horizon` values after each prompt, with their intervals; one dict per prompt, in order.

    Args:
        model: a CausalModel with value units (trained, or loaded from an adapter).
        prompts: texts ending where the first value starts (as `predict_values`).
        tokenizer: a Qwen tokenizer or NumberTokenizer.
        horizon: H, 1..`MAX_HORIZON`.
        paths: N causal-sampling paths per prompt (>= `MIN_PATHS` when `levels` are asked; 0 with ``levels=None``:
            the deterministic path alone).
        levels: central interval levels in (0, 1), or None (values only).
        continuations: per prompt, None or the H - 1 texts written before values 2..H (e.g. the known future
            labels ``["; 2016-08:", "; 2016-09:"]``); None for a prompt: the model writes the text itself up to each
            next number (its prompt must hold a number).
        seed: the paths' draws (one generator per call, drawn prompt after prompt): the same call gives the same
            output. None: torch's global generator.
        batch_size: prompts per prefill, as `predict_values` batches them (step 1 is its output exactly).
        individual: "path" (u once per path) or "step" (u afresh at each step); default: the one the adapter's
            horizon calibration chose on validation, else "path".
        progress: called with the number of prompts done after each one.

    Returns `predict_values`' dict of each prompt (step 1's columns: ``value``, ``scale``, ``p_num``, the
    intervals) with ``horizon``: H dicts ``{"step", "value", "lower_<L>", "upper_<L>", ...}``; step 1 is
    `predict_values`' row exactly; steps >= 2 the deterministic path's value (each value fed back) and intervals
    calibrated per step (`horizon_steps`; shapes: one float per key).
    """
    if isinstance(prompts, str):
        prompts = [prompts]
        if continuations is not None and all(isinstance(t, str) for t in continuations):
            continuations = [continuations]
    check_horizon(horizon)
    want = levels is not None
    levels = check_levels(levels) if want else ()
    check_paths(paths, intervals=want and horizon > 1)
    texts = check_continuations(continuations, prompts, horizon)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if model.causal_config.value_loc is None:
        raise ValueError("the adapter has no value units (value_loc / value_scale): train it first, or load a "
                         "trained adapter with CausalModel.from_pretrained")
    calibration = model.causal_config.horizon_calibration
    individual = check_individual(individual or (calibration or {}).get("individual", DEFAULT_INDIVIDUAL))
    ntok = text_prompts_tokenizer(model, prompts, tokenizer, "predict_horizon")
    gen = None if seed is None else torch.Generator(device=model.device).manual_seed(int(seed))
    was_training = model.training
    model.eval()
    out: list[dict[str, Any]] = []
    groups = None
    try:
        for start, enc in encoded_batches(model, ntok, prompts, batch_size):
            loc, scale, p_num, fwd = predict_forward(model, enc, use_cache=True)
            series = batch_series(model, enc, fwd)
            firsts = prediction_rows(model, loc, scale, p_num, levels or DEFAULT_LEVELS, start, series)
            pads = (enc["attention_mask"] == 0).sum(-1).tolist()
            floored = series.floored.tolist()
            logs = [False] * len(floored) if series.log is None else series.log.tolist()
            if groups is None and any(texts[i] is None for i in range(start, start + len(firsts))) and horizon > 1:
                groups = text_groups(model, ntok, gen, individual)
            ids, vals = enc["input_ids"].to(model.input_device), enc["numeric_values"].to(model.input_device)
            for b, first in enumerate(firsts):
                i = start + b
                row = first if want else {k: first[k] for k in ("row", "value", "scale", "p_num")}
                if horizon == 1:  # predict's row alone: no path to run
                    row["horizon"] = horizon_steps(model, first, None, levels, calibration, floored[b], logs[b]) \
                        if want else \
                        [{"step": 1, "value": first["value"]}]
                    out.append(row)
                    if progress is not None:
                        progress(1)
                    continue
                cont = None if texts[i] is None else continuation_tokens(model, ntok, texts[i])
                try:
                    p = run_paths(model, fwd, b, int(pads[b]), ids, vals, cont, horizon, paths, gen, individual,
                                  groups, floored[b], logs[b])
                except ValueError as e:
                    raise ValueError(f"row {i}: {e}") from None
                if want:
                    row["horizon"] = horizon_steps(model, first, p, levels, calibration, floored[b], logs[b])
                else:
                    row["horizon"] = [{"step": h + 1, "value": float(p.value[0, h]) if h else first["value"]}
                                      for h in range(horizon)]
                out.append(row)
                if progress is not None:
                    progress(1)
            del fwd
    finally:
        model.train(was_training)
    for r in out:
        for s in r["horizon"]:
            if not math.isfinite(s["value"]):
                raise FloatingPointError(f"prompt {r['row']}: the value of step {s['step']} is {s['value']} "
                                         "(not finite)")
    return out
