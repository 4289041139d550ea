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

from ..numbers import find_numbers
from .cauchy import cauchy_cdf
from .generation.api import batched_options
from .generation.loop import StepLoop
from .generation.prepare import Group, text_prompts_tokenizer
from .generation.record import Row
from .intervals import conformal_multiplier
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


def lane_rows(model, ntok, ids: list[int], values: list[float], continuation: list | None, horizon: int, paths: int,
              gen: torch.Generator | None, individual: str = DEFAULT_INDIVIDUAL, adapter: str | None = None,
              floored: bool | None = None, log: bool = False) -> list[Row]:
    """The 1 + `paths` rows of the step loop that run one prompt's lanes (ids / values: the prompt, no padding), to
    add with ``StepLoop.add(rows, fork=True)``: lane 0 in the deterministic mode, lanes 1.. in the causal mode
    (`individual` "path": one eps per lane, `shared_individual`; "step": drawn at each value, or at each token of a
    lane's own text, from `gen`). `continuation`: (ids, values) of the text before values 2..H
    (`continuation_tokens`): every lane writes <NUM>, it, <NUM>, ..., its values the head's; None: a lane writes
    <NUM> then its own text, a <NUM> after the two tokens the prompt ends with being its next value. `floored`: the
    row's series never goes below 0 (None: the loop reads it, and `log`, from the prompt); `log`: a "series" head tells
    it on log y."""
    num = model.num_token_id
    forced, after, limit = [(num, None)], None, None
    if continuation is None:
        after, limit = (ids[-2] if len(ids) >= 2 else -1, ids[-1]), MAX_TEXT_TOKENS
        budget = 1 + (horizon - 1) * (MAX_TEXT_TOKENS + 1)
    else:
        for c_ids, c_vals in continuation[:horizon - 1]:
            forced += list(zip(c_ids, c_vals)) + [(num, None)]
        budget = len(forced)

    def group(mode: str) -> Group:
        shared = mode == "causal" and individual == "path"
        # with continuations every lane draws at the same steps: one [N, C] draw a value (fixed slots, as predict's
        # paths always drew); writing its own text a lane draws while it writes (the rows present)
        return Group(adapter, batched_options(dict(mode=mode, shared_individual=shared))[0], ntok, gen,
                     fixed_slots=mode == "causal" and continuation is not None, slots=paths)

    det, cau = group("deterministic"), group("causal")
    return [Row(list(ids), list(values), det if lane == 0 else cau, budget, forced=forced, max_values=horizon,
                value_after=after, max_text=limit, lane=lane, slot=max(lane - 1, 0), floored=floored,
                log=log and floored is not None)
            for lane in range(1 + paths)]


def lane_paths(rows: list[Row], horizon: int, free_text: bool) -> Paths:
    """The `Paths` of one prompt's finished lane rows (`lane_rows`); the deterministic lane must have written its
    `horizon` values (a ValueError says why it did not)."""
    det = rows[0]
    if len(det.value_steps) < horizon:
        k = len(det.value_steps)
        if free_text and det.stop_reason is not None and det.stop_reason.startswith("stopped"):
            raise ValueError(f"the deterministic path chose a number after value {k} that the value head cannot "
                             f"write ({det.stop_reason}): give the row's continuations (the text before each value)")
        if free_text:
            raise ValueError(f"the deterministic path wrote no value (a number after the text the prompt ends with) "
                             f"within {MAX_TEXT_TOKENS} tokens after value {k}: give the row's continuations (the "
                             "text before each value)")
        raise ValueError(f"the deterministic path's value {k + 1} cannot be written: {det.stop_reason}")
    nan = torch.full((len(rows), horizon), math.nan, dtype=torch.float64)
    value, loc_Y, scale_Y = nan.clone(), nan.clone(), nan.clone()
    for lane, r in enumerate(rows):
        at = r.value_steps[:horizon]
        h = len(at)
        value[lane, :h] = torch.tensor([r.exact[i] for i in at], dtype=torch.float64)
        loc_Y[lane, :h] = torch.tensor([r.loc_Y[i] for i in at], dtype=torch.float64)
        scale_Y[lane, :h] = torch.tensor([r.scale_Y[i] for i in at], dtype=torch.float64)
    return Paths(value, loc_Y, scale_Y)


@torch.no_grad()
def run_lanes(model, ntok, ids: list[int], values: list[float], continuation: list | None, horizon: int, paths: int,
              gen: torch.Generator | None, individual: str = DEFAULT_INDIVIDUAL, floored: bool | None = None,
              log: bool = False) -> Paths:
    """One prompt's lanes (`lane_rows`) run alone on a step loop, to their `horizon` values: their `Paths`."""
    rows = lane_rows(model, ntok, ids, values, continuation, horizon, paths, gen, individual, floored=floored,
                     log=log)
    loop = StepLoop(model)
    loop.add(rows, fork=True)
    while loop.busy:
        loop.step()
    return lane_paths(rows, horizon, continuation is None)


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
class HorizonRun:
    """A horizon call, prompt after prompt: the checks, step 1 of every prompt (`predict_values`' rows, from one
    forward a batch), then each prompt's lanes as rows of a step loop (`lanes(i)`, one prompt at a time: the paths'
    draws come from one generator in prompt order) and its output row once they are done (`row(i)`).
    `predict_horizon` runs them on a loop of its own; the server on its running batch (`serving.engine`)."""

    def __init__(self, model, prompts: Sequence[str], tokenizer, horizon: int, paths: int,
                 levels: Sequence[float] | None, continuations, seed: int | None, batch_size: int,
                 individual: str | None, adapter: str | None = None):
        check_horizon(horizon)
        self.want = levels is not None
        self.levels = check_levels(levels) if self.want else ()
        check_paths(paths, intervals=self.want and horizon > 1)
        self.texts = check_continuations(continuations, prompts, horizon)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if model.causal_config.value_loc is None:
            raise ValueError("the adapter has no value units (value_loc / value_scale): train it first, or load a "
                             "trained adapter with CausalModel.from_pretrained")
        self.calibration = model.causal_config.horizon_calibration
        self.individual = check_individual(individual or (self.calibration or {}).get("individual",
                                                                                       DEFAULT_INDIVIDUAL))
        self.ntok = text_prompts_tokenizer(model, prompts, tokenizer, "predict_horizon")
        self.model, self.horizon, self.paths, self.adapter = model, horizon, paths, adapter
        self.gen = None if seed is None else torch.Generator(device=model.device).manual_seed(int(seed))
        self.firsts: list[dict] = []
        self.floored: list[bool] = []
        self.logs: list[bool] = []  # a "series" head's rows on log y (`series.RowSeries.log`)
        self.prompts: list[tuple[list[int], list[float]]] = []
        with torch.no_grad():
            for start, enc in encoded_batches(model, self.ntok, prompts, batch_size):
                loc, scale, p_num, fwd = predict_forward(model, enc)
                series = batch_series(model, enc, fwd)
                self.firsts += prediction_rows(model, loc, scale, p_num, self.levels or DEFAULT_LEVELS, start, series)
                self.floored += series.floored.tolist()
                self.logs += [False] * len(loc) if series.log is None else series.log.tolist()
                for ids, vals, mask in zip(enc["input_ids"].tolist(), enc["numeric_values"].tolist(),
                                           enc["attention_mask"].tolist()):
                    pad = mask.count(0)
                    self.prompts.append((ids[pad:], vals[pad:]))

    def __len__(self) -> int:
        return len(self.prompts)

    def lanes(self, i: int) -> list[Row] | None:
        """Prompt i's lane rows (`lane_rows`), None with horizon 1 (predict's row alone: no path to run)."""
        if self.horizon == 1:
            return None
        ids, vals = self.prompts[i]
        cont = None if self.texts[i] is None else continuation_tokens(self.model, self.ntok, self.texts[i])
        return lane_rows(self.model, self.ntok, ids, vals, cont, self.horizon, self.paths, self.gen, self.individual,
                         self.adapter, bool(self.floored[i]), bool(self.logs[i]))

    def row(self, i: int, rows: list[Row] | None) -> dict[str, Any]:
        """Prompt i's output row from its finished lanes (`lanes(i)`)."""
        first = self.firsts[i]
        row = first if self.want else {k: first[k] for k in ("row", "value", "scale", "p_num")}
        p = None
        if rows is not None:
            try:
                p = lane_paths(rows, self.horizon, self.texts[i] is None)
            except ValueError as e:
                raise ValueError(f"row {i}: {e}") from None
        if self.want:
            row["horizon"] = horizon_steps(self.model, first, p, self.levels, self.calibration, self.floored[i],
                                           self.logs[i])
        else:
            row["horizon"] = [{"step": h + 1, "value": float(p.value[0, h]) if h else first["value"]}
                              for h in range(self.horizon)]
        for s in row["horizon"]:
            if not math.isfinite(s["value"]):
                raise FloatingPointError(f"prompt {row['row']}: the value of step {s['step']} is {s['value']} "
                                         "(not finite)")
        return row


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
    was_training = model.training
    model.eval()
    try:
        run = HorizonRun(model, prompts, tokenizer, horizon, paths, levels, continuations, seed, batch_size,
                         individual)
        out = []
        loop = StepLoop(model)
        for i in range(len(run)):
            rows = run.lanes(i)
            if rows is not None:
                loop.add(rows, fork=True)
                with torch.no_grad():
                    while loop.busy:
                        loop.step()
            out.append(run.row(i, rows))
            if progress is not None:
                progress(1)
    finally:
        model.train(was_training)
    return out
