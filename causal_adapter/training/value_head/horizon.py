"""The per-step calibration of a horizon's intervals (`modeling.horizon`), fitted after training on the validation
rows that hold several values: a forecasting file's rows, prompt ``"...; 2016-06: 31.7; 2016-07:"`` and completion
``" 33.2; 2016-08: 32.9; 2016-09: 30.4"``. No flag: `train --validation-file` fits it whenever such rows exist.

A row's values are read from its completion's tokens (`completion_steps`, by `records.record_values`: value 1 is
the completion's first number, the next ones the numbers written after the same two tokens), the text between two
values its continuation. The paths of
each row (`modeling.horizon.run_lanes`: its lanes as rows of the step loop, as `predict_horizon` runs them;
`CALIBRATION_PATHS` per row, at most `MAX_ROWS` rows) give per step h >= 2
the deterministic value v_h and the spread s_h (`path_spread`); the map of step h is the split-conformal map of
|y_h - v_h| / s_h (`intervals.fit_calibration`, on the head's scale; a residual below the written resolution counts
at it, as the one-step map does). Steps are covered while at least `MIN_STEP_ROWS` rows reach them.

Whether u is drawn once per path or at each step (`modeling.horizon.INDIVIDUALS`) is chosen here: the paths are run
both ways, and the way whose per-step intervals have the smaller held-out interval score
(`intervals.crossfit_interval_score`, maps cross-fitted on halves of the rows, summed over the steps) is kept, "path"
on a tie. The choice, each way's score and its 50% / 90% coverage before calibration go into the summary.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import torch

from ...modeling.horizon import INDIVIDUALS, Paths, path_spread, run_lanes
from ...modeling.intervals import crossfit_interval_score, fit_calibration, interval
from ...modeling.series import positive_series, text_key
from ...records import record_values
from ...saving.unwrap import unwrap_causal_model
from .calibration import written_resolution
from .summary import LogSummary

#: validation rows whose paths are run (evenly spaced over the rows with two values or more)
MAX_ROWS = 256
#: sampled paths per row and way of drawing u
CALIBRATION_PATHS = 40
#: the fewest rows that reach a step for it to get a map (a 90% quantile needs 9)
MIN_STEP_ROWS = 10
SEED = 0


def completion_steps(ids: list[int], values: list[float], labels: list[int], num_id: int
                     ) -> tuple[list[int], list[float], list[float], list[tuple[list[int], list[float]]]] | None:
    """One tokenized validation row -> (prompt ids, prompt values, y [H], continuations [H - 1] of (ids, values)),
    the prompt ending where value 1 is read; None when its completion holds fewer than two values."""
    start = next((i for i, lab in enumerate(labels) if lab != -100), None)
    if start is None:
        return None
    at = record_values(ids, [i for i in range(start, len(ids)) if ids[i] == num_id])
    if at is None:
        return None
    conts = [(ids[a + 1:b], [float(v) for v in values[a + 1:b]]) for a, b in zip(at, at[1:])]
    return ids[:at[0]], [float(v) for v in values[:at[0]]], [float(values[j]) for j in at], conts


def horizon_rows(eval_ds, num_id: int, max_rows: int = MAX_ROWS) -> list[tuple]:
    """The validation rows with two values or more (`completion_steps` on input_ids / numeric_values / labels), at
    most `max_rows`, evenly spaced."""
    rows = []
    for ids, vals, labels in zip(eval_ds["input_ids"], eval_ds["numeric_values"], eval_ds["labels"]):
        steps = completion_steps(list(ids), [float(v) for v in vals], list(labels), num_id)
        if steps is not None:
            rows.append(steps)
    if len(rows) > max_rows:
        pick = torch.linspace(0, len(rows) - 1, max_rows).round().long().tolist()
        rows = [rows[i] for i in pick]
    return rows


@torch.no_grad()
def run_rows(inner, rows: list[tuple], individual: str, paths: int = CALIBRATION_PATHS, seed: int = SEED
             ) -> list[tuple[Paths, list[float], bool]]:
    """The paths of every row (`run_lanes` with the row's continuations, one generator drawn row after row), with
    its true values and whether a "series" head tells it on log y (`series.positive_series`)."""
    gen = torch.Generator(device=inner.device).manual_seed(seed)
    table, num = inner.causal_config.value_series, inner.num_token_id
    out = []
    for r in rows:  # unfloored, as the maps were fitted before the lanes ran on the step loop
        log = inner.value_map.series and positive_series([text_key(r[0], r[1], num)], table)[0]
        out.append((run_lanes(inner, None, r[0], r[1], r[3], len(r[2]), paths, gen, individual, floored=False,
                              log=log), r[2], log))
    return out


def step_scores(inner, results: list[tuple[Paths, list[float], bool]]) -> list[dict[str, torch.Tensor]]:
    """Per step h >= 2 (index h - 2): {"y", "centre", "spread", "resolution"} [rows reaching it] on the head's
    scale (each row's own under a "series" head)."""
    H = max(len(y) for _, y, _ in results)
    steps: list[dict[str, list]] = [{"y": [], "centre": [], "spread": [], "value_y": [], "log": []}
                                    for _ in range(H - 1)]
    for p, y, log in results:
        centre, spread, _ = path_spread(p)
        for h in range(1, len(y)):
            s = steps[h - 1]
            s["y"].append(y[h])
            s["value_y"].append(y[h])
            s["log"].append(log)
            s["centre"].append(float(centre[h]))
            s["spread"].append(float(spread[h]))
    out = []
    for s in steps:
        value_y = torch.tensor(s["value_y"], dtype=torch.float64)
        vm = inner.value_map.rows(torch.tensor(s["log"], dtype=torch.bool))
        y = vm.to_head(value_y)
        res = vm.head_resolution(value_y, written_resolution(value_y, inner.causal_config.value_decimals))
        out.append({"y": y, "centre": torch.tensor(s["centre"], dtype=torch.float64),
                    "spread": torch.tensor(s["spread"], dtype=torch.float64), "resolution": res})
    return out


def _covered(steps: list[dict]) -> list[dict]:
    """The steps from 2 on while at least MIN_STEP_ROWS rows reach them with a finite score."""
    out = []
    for s in steps:
        ok = torch.isfinite(s["y"]) & torch.isfinite(s["centre"]) & torch.isfinite(s["spread"]) & (s["spread"] > 0)
        if int(ok.sum()) < MIN_STEP_ROWS:
            break
        out.append({k: v[ok] for k, v in s.items()})
    return out


def _floored(s: dict) -> torch.Tensor:
    """The centre moved so that |y - centre| is at least the written resolution (`calibrate_regression_scale`)."""
    resid = (s["y"] - s["centre"]).abs()
    return torch.where(resid < s["resolution"], s["y"] - s["resolution"], s["centre"])


def coverage(s: dict, level: float) -> float:
    """The share of rows inside the uncalibrated interval centre -+ tan(pi level / 2) spread (the spread being the
    paths' 50% half-width, what a Cauchy-shaped spread of the paths would cover at `level`)."""
    lo, hi = interval(s["centre"], s["spread"], level, None)
    return float(((s["y"] >= lo) & (s["y"] <= hi)).double().mean())


def sharded(inner) -> bool:
    """Whether some parameter is a shard (FSDP2's DTensor, FSDP1's empty views, DeepSpeed ZeRO-3's ``ds_id``): the
    paths run the model's own modules, which need whole parameters."""
    return any(type(p).__name__ == "DTensor" or hasattr(p, "ds_id") or p.numel() == 0 for p in inner.parameters())


@dataclass
class HorizonCalibrationSummary(LogSummary):
    """What `fit_horizon_calibration` kept and measured. rows: the validation rows run; steps: the horizon's steps
    (the one-step map's and each calibrated step's); individual: the way of drawing u kept
    (`modeling.horizon.INDIVIDUALS`); scores: each way's held-out interval score, summed over the steps;
    raw_coverage: per way, per level (50, 90), the intervals' coverage before calibration at each step.
    `as_dict()` (and `items()`, `[key]`) give the flat log line: horizon_rows, horizon_steps, horizon_individual,
    horizon_score_<way>, horizon_raw_cov<level>_<way>."""
    rows: int
    steps: int
    individual: str
    scores: dict[str, float]
    raw_coverage: dict[str, dict[int, list[float]]]

    def as_dict(self) -> dict[str, Any]:
        out = {"horizon_rows": self.rows, "horizon_steps": self.steps, "horizon_individual": self.individual,
               **{f"horizon_score_{k}": v for k, v in self.scores.items()}}
        for k, by_level in self.raw_coverage.items():
            for level, cov in by_level.items():
                out[f"horizon_raw_cov{level}_{k}"] = cov
        return out


def fit_horizon_calibration(model, eval_ds, verbose: bool = False, paths: int = CALIBRATION_PATHS,
                            max_rows: int = MAX_ROWS) -> HorizonCalibrationSummary | None:
    """Fit `CausalAdapterConfig.horizon_calibration` on the validation rows of `eval_ds` (tokenized: input_ids,
    numeric_values, labels) that hold several values; without enough of them (or with sharded parameters) the adapter
    keeps no map (an earlier one is dropped: it described another head) and None is returned. Returns the summary
    (`HorizonCalibrationSummary`): the way of drawing u kept, each way's held-out interval score and raw coverage
    per step, the rows and steps."""
    inner = unwrap_causal_model(model)
    if eval_ds is None or inner.causal_config.value_loc is None:
        return None
    inner.causal_config.horizon_calibration = None  # maps of an earlier head would describe another head
    if sharded(inner):
        if verbose:
            print("horizon calibration: skipped, the model's parameters are sharded (FSDP / ZeRO-3): run `train` "
                  "unsharded, or the horizon's intervals beyond step 1 stay raw", file=sys.stderr)
        return None
    rows = horizon_rows(eval_ds, inner.num_token_id, max_rows)
    if len(rows) < MIN_STEP_ROWS:
        return None
    was_training = inner.training
    inner.eval()
    try:
        ways = {}
        for individual in INDIVIDUALS:
            steps = _covered(step_scores(inner, run_rows(inner, rows, individual, paths)))
            if not steps:
                return None
            ways[individual] = steps
    finally:
        inner.train(was_training)
    common = min(len(st) for st in ways.values())
    scores = {k: sum(crossfit_interval_score(s["y"], _floored(s), s["spread"]) for s in st[:common])
              for k, st in ways.items()}
    finite = {k: v for k, v in scores.items() if math.isfinite(v)}
    chosen = min(finite, key=lambda k: (finite[k], INDIVIDUALS.index(k))) if finite else INDIVIDUALS[0]
    steps = ways[chosen]
    maps = [fit_calibration(s["y"], _floored(s), s["spread"]) for s in steps]
    if any(m is None for m in maps):
        return None
    inner.causal_config.horizon_calibration = {"individual": chosen, "paths": int(paths), "steps": maps}
    summary = HorizonCalibrationSummary(
        rows=len(rows), steps=len(steps) + 1, individual=chosen, scores={k: round(v, 6) for k, v in scores.items()},
        raw_coverage={k: {round(100 * q): [round(coverage(s, q), 3) for s in st] for q in (0.5, 0.9)}
                      for k, st in ways.items()})
    if verbose:
        print("horizon calibration: " + ", ".join(f"{k}={v}" for k, v in summary.items()), file=sys.stderr)
    return summary
