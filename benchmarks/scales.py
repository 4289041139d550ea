"""Value prediction across scales: does the value head predict as well at 10^-3 as at 10^5?

    python benchmarks/scales.py                        # sets a, b, c; train's default steps (3 epochs)
    python benchmarks/scales.py --sets a --steps 200   # one set, a fixed number of optimizer steps
    python benchmarks/scales.py --quick                # toy size (smoke test, ~60 s of CPU)
    # every row, 60 steps: the figures of docs/numeric_quality.md (~20 min on a 2-core machine, see below)
    python benchmarks/scales.py --steps 60
    # smaller still (~5 min): the value head then sees the last 32 training rows of each series
    python benchmarks/scales.py --steps 60 --max-train-rows 32 --max-val-rows 4 --synthetic-lengths 144

Three data sets, each ONE training file and so one adapter, trained by `training.loop.train` with the
default `TrainConfig` (what `causal-adapter train --train-file F --validation-file V` does with no other flag:
the embedded tiny Qwen and the real Qwen tokenizer), and predicted by the `predict` command's function
(`commands.predict.predict_files` on the adapter loaded back with `CausalModel.from_pretrained`), so the
values and the calibrated 50% / 90% intervals are what a user gets:

* ``a``: each bundled series (sunspots, nile, co2, elnino, macro/unemp) copied at the scales `SCALES`
  (values times the scale, written by `numbers.format_number`; titles and time labels untouched), all copies
  in one file; ``series`` = ``co2@1e-3``. The same series at scale 1 is in the file, so each copy's MAE / scale
  can be set against it: a head that works in per-row units gives the same ratio at every scale.
* ``b``: the chat corpus's seven series (`data.corpora.chat_corpus`, TRL conversational rows).
* ``c``: a seeded synthetic panel (`--synthetic-series`, default 50) of two kinds. Additive (60%): level
  log-uniform over 10^-2 .. 10^6, a linear trend, a season of period 12 (monthly labels), 4 (quarterly labels) or
  none, AR(1) noise, all in units of the level. Multiplicative (`MULT_FRACTION`, 40%, which series chosen by the
  same seed; `multiplicative_values`): y_t = level_t * season_t * exp(noise_t), level_t growing or shrinking
  exponentially, season_t = 1 + a sin(...) of period 12 or 4, AR(1) noise in logs, so the season's swing and the
  noise grow with the level (airline passengers, quarterly gas use). Every series is positive; each is marked
  ``multiplicative`` and the summaries give the two kinds apart (``mult_*``, ``add_*``). The additive series are
  the draws the seed gave before the multiplicative kind existed (a multiplicative series replaces its draw).

Every series is split by time (`SPLIT`, 70/15/15 of its targets; the chat corpus with the same fractions).
All choices are made on VALIDATION (the product's own, AR order, the best baseline), every figure is on TEST.

Baselines, fitted per series on its own training part (the values up to its last training target), one step
ahead from the true history: persistence; drift (last value + the mean step of the training part); window drift
(last value + the mean step over the row's window, (y[t-1] - y[t-w]) / (w - 1)); seasonal naive (series with a
season); AR(p) by least squares with intercept (p in 1..`AR_MAX_P`, at most the window, chosen on validation
MAE); statsmodels' Holt-Winters ETS (additive trend, additive season where there is one), fitted on the training
part and run over the whole series with those parameters fixed (its fitted values are then the one-step
forecasts), a failed fit falls back to persistence (counted). Two "best" baselines per series, each the one with
the smallest VALIDATION MAE among its candidates: ``best`` among all of them (``vs_best``, ``gm_vs_best``, kept
for comparison), and ``best_window`` among those that see only what the row shows (`WINDOW_BASELINES`:
persistence, window drift, seasonal naive where the season fits in the window, AR) -- the target's. ETS (the
whole history smoothed) and drift (the training part's mean step) stay in the tables as references
(``gm_vs_ets``) but are never ``best_window``. The window is the row's (set a: the corpus's, set c:
``--synthetic-window``); set b's conversations show 3..48 values, and its window baselines use `AR_MAX_P`.

Per series: the adapter's MAE, MAE / persistence with a 90% moving-block bootstrap interval
(`block_bootstrap_ratio`: blocks of ~sqrt(n) consecutive test rows, `BOOT_RESAMPLES` resamples, fixed seed), MAE
/ best baseline and / best window baseline, MASE (scaled by the mean absolute one-step change of the training
part), coverage of the 50% and 90% intervals with the effective number of test rows of each (`effective_n`: the
lag-1 autocorrelation rho of the miss indicators, n_eff = n (1 - rho) / (1 + rho) clamped to [1, n]), and the
test rows whose 90% lower bound is negative on a series whose training values are all > 0. Per set: geometric
means of the ratios, the worst ratio vs persistence and its interval, how many series beat persistence, coverage
ranges over the series with >= `MIN_COVERAGE_ROWS` test rows beside what exact intervals would give on the same
series (`coverage_reference`, binomial with n_eff per series); set a: per copy (MAE / scale) / (MAE of the
scale-1 series). ``--synthetic-window`` and ``--recent-values`` measure how much of its history a row gives.

The targets (`check_targets`, `TARGETS`), a PASS / FAIL line each, per set:

* (set a) every copy's MAE / scale within 10% of the scale-1 series';
* the worst series (largest MAE / persistence): its 90% block-bootstrap interval contains a value <= 1.05;
* geometric mean MAE / best window baseline <= 1.0;
* geometric mean MAE / persistence <= 0.8;
* coverage at 50% and at 90%: no more series off the level (exact binomial test at `COVERAGE_TEST_ALPHA` on
  round(n_eff) rows) than exact intervals would leave off at the 95th percentile (the count of series off under
  exact intervals is Poisson-binomial, each series off with the probability its Binomial(n_eff, level) gives);
* (sets with multiplicative series: c) geometric mean MAE / AR <= 1.1 over them (the worst reported beside);
* no negative 90% lower bound on a positive series (``neg_bounds90``: test rows, over the series whose training
  values are all > 0).

Output: markdown tables and JSON at ``--output`` (default /tmp/scales.md and .json), and ONE last line
``RESULT key=value ...``.

Cost: every optimizer step and every validation row's evaluation pays the OvR loss over the 151,936-row
vocabulary, so the defaults (3 epochs over ~7,600 + ~1,600 + ~5,200 training rows) take hours on a CPU. The
reduction flags keep every series and every test row: ``--steps`` caps the optimizer steps, ``--max-train-rows``
/ ``--max-val-rows`` keep the last rows of each series' training / validation split in the adapter's files (the
closed-form value head is fitted on those rows; the baselines still use the whole training part and choose on
every validation target), ``--synthetic-lengths 144`` gives set c one length with 20 test rows per series.
``--quick`` also shrinks the tiny base (hidden 16, 1 layer): a smoke test of the pipeline, not of the figures.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from common import fmt as _fmt, log as _log, offline, ridge_fit, ridge_predict, write_report

SETS = ("a", "b", "c")
SCALES = (1e-3, 1e-1, 1.0, 10.0, 1e3, 1e5)
SPLIT = (0.70, 0.15, 0.15)
AR_MAX_P = 12
MIN_COVERAGE_ROWS = 20
COVERAGE_TEST_ALPHA = 0.01
#: `coverage_reference`'s keys in the RESULT line (its all-inside probabilities go in the tables and check lines)
COVERAGE_KEYS = tuple(f"cov{q}_{part}" for q in ("50", "90")
                      for part in ("out", "out_exact", "off", "off_exact", "off_q95", "off_iid"))
#: the quantile of the count of series off the level under exact intervals that the coverage target allows
COVERAGE_OFF_QUANTILE = 0.95
#: set c's figures per kind of series (`kind_summary`), in the tables and the RESULT line
KIND_KEYS = ("mult_n_series", "mult_gm_vs_ar", "mult_worst_vs_ar", "mult_gm_vs_best_window", "mult_gm_vs_persistence",
             "add_n_series", "add_gm_vs_ar", "add_gm_vs_best_window", "add_gm_vs_persistence")
LEVELS = (0.5, 0.9)
BASELINES = ("persistence", "drift", "window_drift", "seasonal_naive", "ar", "ets")
#: the candidates of the best WINDOW baseline: what sees only the row's window (never ETS nor the training drift)
WINDOW_BASELINES = ("persistence", "window_drift", "seasonal_naive", "ar")
#: the worst series' MAE / persistence: a moving-block bootstrap over its test rows (blocks of ~sqrt(n) rows)
BOOT_RESAMPLES = 2000
BOOT_LEVEL = 0.90
BOOT_SEED = 0
#: the bundled series of set a: name -> (title, window, season); the titles and windows are the corpora's
BUNDLED = {
    "sunspots": ("Yearly sunspot numbers.", 10, None),
    "nile": ("Annual flow of the Nile at Aswan (10^8 m^3).", 10, None),
    "co2": ("Monthly mean CO2 at Mauna Loa (ppm).", 12, 12),
    "elnino": ("Monthly sea surface temperature, Pacific 0-10 S 90-80 W (deg C).", 12, 12),
    "macro/unemp": ("US quarterly unemployment rate (%).", 8, None),
}
CHAT_SEASON = {"co2": 12, "elnino": 12}
CHAT_WINDOW = 48  # chat_corpus's default longest window
SYNTHETIC_WINDOW = 12
SYNTHETIC_LENGTHS = (96, 144, 240)
#: the share of set c's series whose season and noise multiply with the level
MULT_FRACTION = 0.4
#: cov50 / cov90: the band of `in_band` (the exact-interval reference's "out"); the coverage TARGET is the count
#: of series off the level (`coverage_reference`). worst_vs_persistence: the value the worst series' bootstrap
#: interval must reach down to
TARGETS = {"copy_deviation": 0.10, "worst_vs_persistence": 1.05, "gm_vs_best_window": 1.0, "gm_vs_persistence": 0.8,
           "mult_gm_vs_ar": 1.1, "neg_bounds90": 0, "cov50": (0.30, 0.70), "cov90": (0.75, 0.98)}
#: --quick: a few series, few training / validation rows, 2 steps on a smaller tiny base (the pipeline end to
#: end, not the figures); each set keeps one series with >= MIN_COVERAGE_ROWS test rows, so every key is finite
QUICK = dict(steps=2, a_series=("macro/unemp",), a_scales=(1e-1, 1.0, 1e3), chat_series=("macro/unemp",),
             synthetic_series=2, synthetic_lengths=(160,), max_train_rows=6, max_val_rows=4,
             tiny=dict(tiny_hidden_size=16, tiny_layers=1))


def scale_label(s: float) -> str:
    return "1" if s == 1 else f"1e{round(math.log10(s))}"


# ----------------------------------------------------------------------------- data
def split_bounds(n: int, window: int) -> tuple[int, int]:
    """(train_end, val_end): targets t_index < train_end are training rows, < val_end validation, the rest test."""
    m = n - window
    n_val, n_test = max(1, round(SPLIT[1] * m)), max(1, round(SPLIT[2] * m))
    if m - n_val - n_test < 2:
        raise ValueError(f"a series of {n} values with window {window} is too short to split {SPLIT}")
    return window + m - n_val - n_test, window + m - n_test


def series_entry(name: str, title: str, times: list[str], values: list[float], window: int, season, **extra) -> dict:
    """A series of set a or c: its rows in the bundled corpora's layout (`corpora.series_rows`: the window of
    "time: value" pairs, the value as `format_number` writes it) and the values as written, for the baselines."""
    from causal_adapter.data.corpora import series_rows
    from causal_adapter.numbers import format_number

    rows = series_rows(name, title, times, values, window)
    train_end, val_end = split_bounds(len(values), window)
    return {"name": name, "y": np.array([float(format_number(v)) for v in values]), "window": window,
            "season": season, "train_end": train_end, "val_end": val_end, "rows": rows, **extra}


def split_rows(entry: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {"train": [], "validation": [], "test": []}
    for r in entry["rows"]:
        i = r["t_index"]
        out["train" if i < entry["train_end"] else "validation" if i < entry["val_end"] else "test"].append(r)
    return out


def bundled_values(name: str) -> tuple[list[str], list[float]]:
    from causal_adapter.data import corpora

    if name.startswith("macro/"):
        return corpora._macro_data(name.split("/", 1)[1])
    return getattr(corpora, f"_{name}_data")()


def set_a(args) -> list[dict]:
    out = []
    for name in args.a_series:
        title, window, season = BUNDLED[name]
        times, values = bundled_values(name)
        for s in args.a_scales:
            out.append(series_entry(f"{name}@{scale_label(s)}", title, times, [v * s for v in values], window, season,
                                    base=name, scale=s))
    return out


def set_b(args) -> list[dict]:
    """The chat corpus split 70/15/15 per series; each row's target is the value at its t_index of the series,
    so the baselines forecast that step from the series' true history."""
    from causal_adapter.data.corpora import CHAT_SERIES, canonical_value, chat_corpus

    dd = chat_corpus(window=CHAT_WINDOW, seed=args.seed, split_fractions=SPLIT, series=list(args.chat_series))
    out = []
    for name in args.chat_series:
        times, values = CHAT_SERIES[name][0]("chat")
        parts = {k: [r for r in dd[k] if r["series"] == name] for k in ("train", "validation", "test")}
        # a split's answers all lie inside its steps, and its last step is answered: max t_index + 1 is its end
        out.append({"name": name, "y": np.array([canonical_value(v)[1] for v in values]), "window": AR_MAX_P,
                    "season": CHAT_SEASON.get(name), "train_end": max(r["t_index"] for r in parts["train"]) + 1,
                    "val_end": max(r["t_index"] for r in parts["validation"]) + 1, "parts": parts})
    return out


def multiplicative_values(n: int, level: float, growth: float, period: int, amplitude: float, phase: float,
                          phi: float, sd: float, rng: np.random.Generator) -> np.ndarray:
    """y_t = level_t * season_t * exp(noise_t): level_t = level * exp(growth * t / n) (the log-level moves by
    `growth` over the series), season_t = 1 + amplitude * sin(2 pi t / period + phase) (amplitude < 1: positive),
    noise AR(1) in logs (phi, innovations N(0, sd) from `rng`). The season's swing and the noise are fractions of
    the level, so they grow and shrink with it."""
    t = np.arange(n)
    e = rng.normal(0, sd, n)
    for i in range(1, n):
        e[i] += phi * e[i - 1]
    return level * np.exp(growth * t / n) * (1 + amplitude * np.sin(2 * np.pi * t / period + phase)) * np.exp(e)


def synthetic_panel(n_series: int, lengths, seed: int, window: int = SYNTHETIC_WINDOW) -> list[dict]:
    """`n_series` seeded series, rows of `window` values. Additive: level 10^U(-2, 6), a trend of -0.4..0.6
    levels over the series, a season of period 12 / 4 / none (amplitude 5..25% of the level), AR(1) noise (phi
    0..0.8, sd 1..6% of the level). Multiplicative (round(`MULT_FRACTION` * n_series) series, chosen by the seed;
    `multiplicative_values`): the same level and length draws, log-level growth -0.3..1.0 over the series, season
    of period 12 / 4 (amplitude 10..35% of the level), AR(1) log noise (phi 0..0.8, sd 1..5%). The additive draws
    of every series are made in the same order as before the multiplicative kind existed, so the additive series
    are unchanged; a multiplicative series takes its own draws from a second generator."""
    rng = np.random.default_rng(seed)
    mult_rng = np.random.default_rng([seed, 1])
    mult = {int(k) for k in mult_rng.choice(n_series, size=round(MULT_FRACTION * n_series), replace=False)}
    out = []
    for k in range(n_series):
        level = 10.0 ** rng.uniform(-2, 6)
        n = int(rng.choice(lengths))
        period = int(rng.choice([12, 4, 0]))
        t = np.arange(n)
        trend = rng.uniform(-0.4, 0.6) * t / n
        season = rng.uniform(0.05, 0.25) * np.sin(2 * np.pi * t / period + rng.uniform(0, 2 * np.pi)) if period else 0.0
        phi, sd = rng.uniform(0, 0.8), rng.uniform(0.01, 0.06)
        e = rng.normal(0, sd, n)
        for i in range(1, n):
            e[i] += phi * e[i - 1]
        values = (level * (1 + trend + season + e)).tolist()
        start = int(rng.integers(1950, 2000))
        if k in mult:
            period = int(mult_rng.choice([12, 4]))
            values = multiplicative_values(
                n, level, growth=mult_rng.uniform(-0.3, 1.0), period=period, amplitude=mult_rng.uniform(0.10, 0.35),
                phase=mult_rng.uniform(0, 2 * np.pi), phi=mult_rng.uniform(0, 0.8), sd=mult_rng.uniform(0.01, 0.05),
                rng=mult_rng).tolist()
        if period == 4:
            times = [f"{start + i // 4} Q{i % 4 + 1}" for i in range(n)]
            title = f"Synthetic quarterly series {k}."
        else:
            times = [f"{start + i // 12}-{i % 12 + 1:02d}" for i in range(n)]
            title = f"Synthetic monthly series {k}."
        out.append(series_entry(f"synthetic/{k:02d}", title, times, values, window, period or None,
                                level=level, period=period, multiplicative=k in mult))
    return out


def last_rows(rows: list[dict], n: int | None) -> list[dict]:
    """The last `n` rows of a series' split (--max-train-rows, --max-val-rows: the training rows nearest the
    validation split, the validation rows nearest the test split)."""
    return rows if n is None else rows[-n:]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")


# ----------------------------------------------------------------------------- baselines
def _standardise(y: np.ndarray, train_end: int) -> tuple[np.ndarray, float, float]:
    """The series in units of its training part: AR and ETS are affine-equivariant, and their fits (least
    squares, statsmodels' optimiser) are then the same at every scale of set a."""
    mu, sd = float(y[:train_end].mean()), float(y[:train_end].std())
    sd = sd if sd > 0 else 1.0
    return (y - mu) / sd, mu, sd


def ar_forecasts(y: np.ndarray, train_end: int, p: int) -> np.ndarray:
    """One-step forecasts f[i] (i >= p; nan before) of AR(p) with intercept, least squares on the training part."""
    z, mu, sd = _standardise(y, train_end)
    lags = lambda idx: torch.tensor(np.stack([z[idx - j] for j in range(1, p + 1)], 1), dtype=torch.float64)
    fit_idx = np.arange(p, train_end)
    try:
        w = ridge_fit(lags(fit_idx), torch.tensor(z[fit_idx], dtype=torch.float64), 0.0)
    except RuntimeError:  # collinear lags (a constant stretch): the smallest penalty of the grid
        w = ridge_fit(lags(fit_idx), torch.tensor(z[fit_idx], dtype=torch.float64), 1e-8)
    f = np.full(len(y), np.nan)
    idx = np.arange(p, len(y))
    f[idx] = mu + sd * ridge_predict(w, lags(idx)).numpy()
    return f


def ets_forecasts(y: np.ndarray, train_end: int, season) -> np.ndarray:
    """Holt-Winters (additive trend, additive season where there is one) fitted on the training part, then run
    over the whole series with its parameters and initial states fixed: the fitted values are one-step forecasts."""
    from statsmodels.tsa.holtwinters import ExponentialSmoothing

    z, mu, sd = _standardise(y, train_end)
    seasonal = "add" if season and train_end >= 2 * season + 2 else None
    spec = dict(trend="add", seasonal=seasonal, seasonal_periods=season if seasonal else None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # statsmodels' convergence chatter; a bad fit shows in validation MAE
        fit = ExponentialSmoothing(z[:train_end], initialization_method="estimated", **spec).fit()
        p = fit.params
        full = ExponentialSmoothing(z, initialization_method="known", initial_level=p["initial_level"],
                                    initial_trend=p["initial_trend"],
                                    initial_seasonal=p["initial_seasons"] if seasonal else None, **spec)
        run = full.fit(smoothing_level=p["smoothing_level"], smoothing_trend=p["smoothing_trend"],
                       smoothing_seasonal=p["smoothing_seasonal"] if seasonal else None, optimized=False)
    f = mu + sd * np.asarray(run.fittedvalues, dtype=float)
    if f.shape != y.shape or not np.isfinite(f[train_end:]).all():
        raise FloatingPointError("ETS forecasts are not finite")
    return f


def baselines(entry: dict, idx: dict[str, np.ndarray]) -> dict:
    """Per baseline: its one-step forecasts at the validation and test targets `idx`, its MAE there, the best
    baseline by VALIDATION MAE (``best``, every baseline a candidate) and the best WINDOW baseline (``best_window``:
    the candidates `WINDOW_BASELINES` see only the row's `window` values, so never ETS nor the training drift;
    seasonal naive only where the season fits in the window)."""
    y, te, season, w = entry["y"], entry["train_end"], entry["season"], entry["window"]
    n = len(y)
    fc: dict[str, np.ndarray] = {}
    prev = np.full(n, np.nan)
    prev[1:] = y[:-1]
    fc["persistence"] = prev
    fc["drift"] = prev + (y[te - 1] - y[0]) / (te - 1)
    if w >= 2:  # the mean step over the window: (y[t-1] - y[t-w]) / (w - 1)
        f = np.full(n, np.nan)
        f[w:] = y[w - 1:-1] + (y[w - 1:-1] - y[:n - w]) / (w - 1)
        fc["window_drift"] = f
    if season:
        f = np.full(n, np.nan)
        f[season:] = y[:-season]
        fc["seasonal_naive"] = f
    # AR order: 1..AR_MAX_P, no more than the window the model sees, and enough training targets to fit it
    orders = range(1, min(AR_MAX_P, entry["window"], (te - 2) // 3) + 1)
    ar = {p: ar_forecasts(y, te, p) for p in orders}
    mae = lambda f, k: float(np.abs(f[idx[k]] - y[idx[k]]).mean())
    p_best = min(ar, key=lambda p: mae(ar[p], "validation"))
    fc["ar"] = ar[p_best]
    try:
        fc["ets"] = ets_forecasts(y, te, season)
        ets_fallback = False
    except Exception:  # any failure of the fit: persistence stands in, and is counted
        fc["ets"], ets_fallback = prev, True
    out = {"forecasts": fc, "ar_order": p_best, "ets_fallback": ets_fallback,
           "mae": {b: {k: mae(f, k) for k in ("validation", "test")} for b, f in fc.items()}}
    out["best"] = min(fc, key=lambda b: out["mae"][b]["validation"])
    out["window_candidates"] = [b for b in WINDOW_BASELINES if b in fc and (b != "seasonal_naive" or season <= w)]
    out["best_window"] = min(out["window_candidates"], key=lambda b: out["mae"][b]["validation"])
    return out


# ----------------------------------------------------------------------------- the adapter
def train_and_predict(args, name: str, train_rows: list[dict], val_rows: list[dict], test_rows: list[dict],
                      work: Path) -> tuple[list[dict], dict]:
    """Train one adapter on the set's training file (the default TrainConfig), predict its test rows as
    `causal-adapter predict ADAPTER --data-file TEST` does; (prediction rows in test order, run info)."""
    from causal_adapter import CausalModel
    from causal_adapter.commands.predict import predict_files
    from causal_adapter.training.config import TrainConfig
    from causal_adapter.training.loop import load_base_and_tokenizer, train

    work.mkdir(parents=True, exist_ok=True)
    files = {k: work / f"{name}_{k}.jsonl" for k in ("train", "validation", "test")}
    for k, rows in zip(files, (train_rows, val_rows, test_rows)):
        write_jsonl(files[k], rows)
    overrides = {**args.tiny, **({} if args.steps is None else {"max_steps": args.steps}),
                 **({} if args.recent_values is None else {"recent_values": args.recent_values})}
    # output and display only (no plot file, no progress bar); every training setting is the default
    config = TrainConfig(train_file=[str(files["train"])], validation_file=[str(files["validation"])],
                         output_dir=str(work / f"{name}_run"), plot=False, progress=False, seed=args.seed, **overrides)
    t0 = time.perf_counter()
    result = train(None, config)
    train_seconds = time.perf_counter() - t0
    base, tokenizer = load_base_and_tokenizer(config)  # what `predict` loads with no --base flag
    model = CausalModel.from_pretrained(base, str(result.adapter_dir), tokenizer=tokenizer)
    pred_path = work / f"{name}_pred.jsonl"
    t1 = time.perf_counter()
    counts = predict_files(model, tokenizer, [str(files["test"])], output=str(pred_path), levels=LEVELS,
                           progress=False)
    predict_seconds = time.perf_counter() - t1
    preds = {}
    for line in pred_path.read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        preds[r["row"]] = r
    if counts["skipped"] or len(preds) != len(test_rows):
        raise RuntimeError(f"set {name}: predict skipped {counts['skipped']} of {len(test_rows)} test rows")
    info = {"steps": result.global_step, "train_rows": len(train_rows), "validation_rows": len(val_rows),
            "test_rows": len(test_rows), "train_seconds": train_seconds, "predict_seconds": predict_seconds,
            "calibrated": model.causal_config.value_calibration is not None,
            "validation_value_mae": (result.eval_metrics or {}).get("value_mae")}
    return [preds[i] for i in range(len(test_rows))], info


# ----------------------------------------------------------------------------- scoring
def score_series(entry: dict, val_idx: np.ndarray, test_idx: np.ndarray, preds: list[dict]) -> dict:
    y = entry["y"]
    base = baselines(entry, {"validation": val_idx, "test": test_idx})
    yt = y[test_idx]
    value = np.array([p["value"] for p in preds])
    # per test row: 1 where the true value falls outside the interval (the coverage's misses, in time order)
    miss = {q: [int(not p[f"lower_{q}"] <= t <= p[f"upper_{q}"]) for p, t in zip(preds, yt)] for q in ("50", "90")}
    cover = {q: float(np.mean([1 - m for m in miss[q]])) for q in ("50", "90")}
    err = np.abs(value - yt)
    pers_err = np.abs(base["forecasts"]["persistence"][test_idx] - yt)
    mae = float(err.mean())
    pers = base["mae"]["persistence"]["test"]
    best = base["mae"][base["best"]]["test"]
    best_window = base["mae"][base["best_window"]]["test"]
    naive_in = float(np.abs(np.diff(y[:entry["train_end"]])).mean())
    positive = bool((y[:entry["train_end"]] > 0).all())
    lo_ci, hi_ci = block_bootstrap_ratio(err, pers_err)
    return {"series": entry["name"], "n_test": len(test_idx), "mae": mae, "persistence_mae": pers,
            "vs_persistence": ratio(mae, pers), "vs_persistence_lo90": lo_ci, "vs_persistence_hi90": hi_ci,
            "best_baseline": base["best"], "best_mae": best,
            "best_window_baseline": base["best_window"], "best_window_mae": best_window,
            # against one baseline on every series: AR(p) reads at most the window the row shows, ETS the series'
            # whole history (its level and season smoothed over every step before)
            **{f"vs_{b}": ratio(mae, base["mae"][b]["test"]) for b in ("ar", "ets")},
            "vs_best": ratio(mae, best), "vs_best_window": ratio(mae, best_window), "mase": ratio(mae, naive_in),
            "cov50": cover["50"], "cov90": cover["90"],
            **{f"neff{q}": effective_n(miss[q]) for q in ("50", "90")},
            "positive": positive,
            # a negative lower bound on a series that was positive all through its training part
            "neg_bounds90": int(sum(p["lower_90"] < 0 for p in preds)) if positive else 0,
            "ar_order": base["ar_order"], "ets_fallback": base["ets_fallback"],
            "baseline_mae": base["mae"], "mean_scale": float(np.mean([p["scale"] for p in preds])),
            "miss50": miss["50"], "miss90": miss["90"], "abs_err": err.tolist(), "persistence_abs_err": pers_err.tolist(),
            **{k: entry[k] for k in ("base", "scale", "multiplicative") if k in entry}}


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else (1.0 if a == 0 else math.inf)


def lag1_autocorrelation(x) -> float:
    """The lag-1 autocorrelation of `x` (the usual estimator: sum (x_t - m)(x_t+1 - m) / sum (x_t - m)^2, m the
    mean); 0 for a constant sequence (no misses, or only misses) or one of fewer than 2 values."""
    x = np.asarray(x, dtype=float)
    d = x - x.mean() if len(x) else x
    den = float((d * d).sum())
    return float((d[:-1] * d[1:]).sum() / den) if len(x) > 1 and den > 0 else 0.0


def effective_n(misses) -> float:
    """The effective number of independent rows behind a series' miss indicators: n (1 - rho) / (1 + rho), rho
    their lag-1 autocorrelation, clamped to [1, n] (alternating misses, rho near -1: n; misses in one run: few)."""
    n = len(misses)
    if n == 0:
        return 0.0
    rho = lag1_autocorrelation(misses)
    if rho <= -1:
        return float(n)
    return float(min(n, max(1.0, n * (1 - rho) / (1 + rho))))


def block_bootstrap_ratio(num, den, resamples: int = BOOT_RESAMPLES, level: float = BOOT_LEVEL, seed: int = BOOT_SEED,
                          block: int | None = None) -> tuple[float, float]:
    """A `level` percentile interval of sum(num) / sum(den) (MAE / persistence MAE from the per-row absolute
    errors) by the moving-block bootstrap: each resample joins ceil(n / block) blocks of `block` consecutive rows
    (default round(sqrt(n))), their starts uniform over 0..n - block, cut to n rows; the rows of a block are
    resampled together with their pairs, so errors that cluster in time stay clustered. Fixed `seed`."""
    num, den = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    n = len(num)
    if n == 0:
        return math.nan, math.nan
    b = block or max(1, round(math.sqrt(n)))
    starts = np.random.default_rng(seed).integers(0, n - b + 1, size=(resamples, math.ceil(n / b)))
    idx = (starts[:, :, None] + np.arange(b)).reshape(resamples, -1)[:, :n]
    s_num, s_den = num[idx].sum(1), den[idx].sum(1)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(s_den > 0, s_num / s_den, np.where(s_num == 0, 1.0, np.inf))
    tail = (1 - level) / 2
    return float(np.quantile(r, tail, method="lower")), float(np.quantile(r, 1 - tail, method="higher"))


def poisson_binomial_quantile(ps, q: float) -> int:
    """The smallest c with P(sum of independent Bernoulli(p_i) <= c) >= q (the distribution by convolution)."""
    pmf = np.ones(1)
    for p in ps:
        pmf = np.convolve(pmf, [1 - p, p])
    return int(np.searchsorted(np.cumsum(pmf), q - 1e-12))


def gmean(v) -> float:
    v = [x for x in v if x > 0 and math.isfinite(x)]
    return math.exp(sum(map(math.log, v)) / len(v)) if v else math.nan


def in_band(r: dict, q: str) -> bool:
    """Series `r`'s coverage at level q ("50", "90") lies in the target band `TARGETS["cov{q}"]`."""
    lo, hi = TARGETS[f"cov{q}"]
    return lo <= r[f"cov{q}"] <= hi


def coverage_reference(cov_rows: list[dict]) -> dict:
    """What exact intervals would give on these series, per level q (50, 90). A series' test rows are consecutive
    steps, so its misses may cluster: it counts as n_e = max(1, round(``neff{q}``)) independent rows
    (`effective_n`; a row without ``neff{q}`` counts its n_test), and its covered count as round(cov * n_e). Under
    exact intervals that count is Binomial(n_e, q), so some series fall outside the band `TARGETS["cov{q}"]`, or
    off the level, by chance alone.
    cov{q}_out: series outside the band; cov{q}_out_exact: the number exact intervals put outside on average;
    cov{q}_all_in_exact: the probability that exact intervals keep every series in the band;
    cov{q}_off: series whose count rejects the level q (two-sided exact binomial test at `COVERAGE_TEST_ALPHA` on
    n_e rows); cov{q}_off_exact: the number exact intervals put off on average; cov{q}_off_q95: the
    `COVERAGE_OFF_QUANTILE` quantile of that number (independent series, each off with its own probability: a
    Poisson-binomial), the target's bound on cov{q}_off; cov{q}_off_iid: cov{q}_off with every row independent
    (n_e = n_test, what the reference was before the correction)."""
    from scipy.stats import binom, binomtest

    out = {}
    for q in ("50", "90"):
        lo, hi = TARGETS[f"cov{q}"]
        level = int(q) / 100
        p_out, p_off, off, off_iid = [], [], 0, 0
        for r in cov_rows:
            n = r["n_test"]
            ne = max(1, round(r.get(f"neff{q}", n)))
            ks = np.arange(ne + 1)
            pmf = binom.pmf(ks, ne, level)
            p_out.append(1.0 - float(pmf[[lo <= k / ne <= hi for k in ks]].sum()))
            rejects = np.array([binomtest(int(k), ne, level).pvalue < COVERAGE_TEST_ALPHA for k in ks])
            p_off.append(float(pmf[rejects].sum()))
            off += bool(rejects[round(r[f"cov{q}"] * ne)])
            off_iid += binomtest(round(r[f"cov{q}"] * n), n, level).pvalue < COVERAGE_TEST_ALPHA
        out[f"cov{q}_out"] = sum(not in_band(r, q) for r in cov_rows)
        out[f"cov{q}_out_exact"] = float(sum(p_out))
        out[f"cov{q}_all_in_exact"] = float(np.prod([1 - p for p in p_out]))
        out[f"cov{q}_off"] = int(off)
        out[f"cov{q}_off_exact"] = float(sum(p_off))
        out[f"cov{q}_off_q95"] = poisson_binomial_quantile(p_off, COVERAGE_OFF_QUANTILE)
        out[f"cov{q}_off_iid"] = int(off_iid)
        out[f"cov{q}_mean_neff_share"] = float(np.mean([max(1, round(r.get(f"neff{q}", r["n_test"]))) / r["n_test"]
                                                        for r in cov_rows])) if cov_rows else math.nan
    return out


def kind_summary(rows: list[dict]) -> dict:
    """Set c's two kinds apart (rows marked ``multiplicative``): per kind (``mult``, ``add``) the number of series,
    the geometric means of MAE / AR, / best window baseline and / persistence; for ``mult`` also the worst MAE / AR
    and its series (the target is on ``mult_gm_vs_ar``)."""
    out = {}
    for kind, flag in (("mult", True), ("add", False)):
        part = [r for r in rows if r.get("multiplicative") is flag]
        out[f"{kind}_n_series"] = len(part)
        if not part:
            continue
        out[f"{kind}_gm_vs_ar"] = gmean(r["vs_ar"] for r in part)
        out[f"{kind}_gm_vs_best_window"] = gmean(r["vs_best_window"] for r in part)
        out[f"{kind}_gm_vs_persistence"] = gmean(r["vs_persistence"] for r in part)
        if flag:
            worst = max(part, key=lambda r: r["vs_ar"])
            out["mult_worst_vs_ar"], out["mult_worst_series"] = worst["vs_ar"], worst["series"]
    return out


def summarise(rows: list[dict], copies: dict | None) -> dict:
    worst = max(rows, key=lambda r: r["vs_persistence"])
    cov_rows = [r for r in rows if r["n_test"] >= MIN_COVERAGE_ROWS]
    rng = lambda k, f: f(r[k] for r in cov_rows) if cov_rows else math.nan
    out = {"gm_vs_persistence": gmean(r["vs_persistence"] for r in rows),
           "gm_vs_best_window": gmean(r["vs_best_window"] for r in rows),
           "gm_vs_best": gmean(r["vs_best"] for r in rows),
           **{f"gm_vs_{b}": gmean(r[f"vs_{b}"] for r in rows) for b in ("ar", "ets")},
           "worst_vs_persistence": worst["vs_persistence"],
           "worst_vs_persistence_lo90": worst["vs_persistence_lo90"],
           "worst_vs_persistence_hi90": worst["vs_persistence_hi90"],
           "worst_series": worst["series"], "n_series": len(rows),
           # series whose whole interval lies above the worst-series target (the target reads the worst only)
           "n_above_worst_target": sum(r["vs_persistence_lo90"] > TARGETS["worst_vs_persistence"] for r in rows),
           "n_beat_persistence": sum(r["vs_persistence"] < 1 for r in rows),
           "n_positive_series": sum(r["positive"] for r in rows),
           "neg_bounds90": sum(r["neg_bounds90"] for r in rows),
           "neg_bound_series": sum(r["neg_bounds90"] > 0 for r in rows),
           "n_coverage_series": len(cov_rows),
           "cov50_min": rng("cov50", min), "cov50_max": rng("cov50", max),
           "cov90_min": rng("cov90", min), "cov90_max": rng("cov90", max),
           "gm_mase": gmean(r["mase"] for r in rows), "ets_fallbacks": sum(r["ets_fallback"] for r in rows),
           **(coverage_reference(cov_rows) if cov_rows else {})}
    if any("multiplicative" in r for r in rows):
        out.update(kind_summary(rows))
    if copies is not None:
        devs = [abs(v - 1) for by in copies.values() for s, v in by.items() if s != "1" and math.isfinite(v)]
        out["max_abs_copy_deviation"] = max(devs) if devs else math.nan
    return out


def copy_ratios(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Set a: (MAE / scale of each copy) / (MAE of the same series at scale 1), by series and scale label."""
    ref = {r["base"]: r["mae"] for r in rows if r["scale"] == 1}
    out: dict[str, dict[str, float]] = {}
    for r in rows:
        if r["base"] in ref:
            out.setdefault(r["base"], {})[scale_label(r["scale"])] = (r["mae"] / r["scale"]) / ref[r["base"]] \
                if ref[r["base"]] > 0 else math.nan
    return out


def check_targets(name: str, s: dict, cov_rows: list[dict]) -> list[tuple[bool, str]]:
    """(passed, line) per target of set `name` (the module docstring lists them)."""
    t = TARGETS
    lines = []
    if "max_abs_copy_deviation" in s:
        lines.append((s["max_abs_copy_deviation"] <= t["copy_deviation"],
                      f"{name}: every copy's MAE/scale within +-{t['copy_deviation']:.0%} of scale 1 "
                      f"(max |ratio - 1| = {_fmt(s['max_abs_copy_deviation'], 3)})"))
    lines.append((s["worst_vs_persistence_lo90"] <= t["worst_vs_persistence"],
                  f"{name}: the worst series' MAE / persistence could be <= {t['worst_vs_persistence']} (its "
                  f"{BOOT_LEVEL:.0%} block-bootstrap interval reaches down to it; worst "
                  f"{_fmt(s['worst_vs_persistence'], 3)}, {s['worst_series']}, interval "
                  f"{_fmt(s['worst_vs_persistence_lo90'], 3)}..{_fmt(s['worst_vs_persistence_hi90'], 3)}; series "
                  f"whose whole interval is above: {s['n_above_worst_target']})"))
    lines.append((s["gm_vs_best_window"] <= t["gm_vs_best_window"],
                  f"{name}: geometric mean MAE / best window baseline <= {t['gm_vs_best_window']} "
                  f"({_fmt(s['gm_vs_best_window'], 3)}; references: best of all incl. ETS {_fmt(s['gm_vs_best'], 3)}, "
                  f"ETS {_fmt(s['gm_vs_ets'], 3)})"))
    lines.append((s["gm_vs_persistence"] <= t["gm_vs_persistence"],
                  f"{name}: geometric mean MAE / persistence <= {t['gm_vs_persistence']} "
                  f"({_fmt(s['gm_vs_persistence'], 3)})"))
    for q in ("50", "90"):
        lo, hi = t[f"cov{q}"]
        bad = [r["series"] for r in cov_rows if not in_band(r, q)]
        ok = bool(cov_rows) and s[f"cov{q}_off"] <= s[f"cov{q}_off_q95"]
        lines.append((ok, f"{name}: {q}% coverage: series off the level (binomial test at {COVERAGE_TEST_ALPHA:g} "
                          f"on n_eff rows) no more than exact intervals leave off at the "
                          f"{round(100 * COVERAGE_OFF_QUANTILE)}th percentile"
                          + (f" ({s[f'cov{q}_off']} off, bound {s[f'cov{q}_off_q95']}, exact intervals "
                             f"{_fmt(s[f'cov{q}_off_exact'], 2)} on average; without the n_eff correction "
                             f"{s[f'cov{q}_off_iid']} off; mean n_eff / n {_fmt(s[f'cov{q}_mean_neff_share'], 2)}; "
                             f"{len(cov_rows)} series with >= {MIN_COVERAGE_ROWS} test rows, range "
                             f"{_fmt(s[f'cov{q}_min'], 3)}..{_fmt(s[f'cov{q}_max'], 3)}, outside [{lo}, {hi}]: "
                             f"{len(bad)}" + (f" ({', '.join(bad)})" if bad else "")
                             + f", exact intervals {_fmt(s[f'cov{q}_out_exact'], 2)} on average)"
                             if cov_rows else f" (no series with >= {MIN_COVERAGE_ROWS} test rows)")))
    if s.get("mult_n_series"):
        lines.append((s["mult_gm_vs_ar"] <= t["mult_gm_vs_ar"],
                      f"{name}: geometric mean MAE / AR <= {t['mult_gm_vs_ar']} on the {s['mult_n_series']} series "
                      f"with a multiplying season ({_fmt(s['mult_gm_vs_ar'], 3)}; worst "
                      f"{_fmt(s['mult_worst_vs_ar'], 3)}, {s['mult_worst_series']}; additive series "
                      f"{_fmt(s.get('add_gm_vs_ar', math.nan), 3)})"))
    lines.append((s["neg_bounds90"] <= t["neg_bounds90"],
                  f"{name}: no negative 90% lower bound on a positive series ({s['neg_bounds90']} test rows on "
                  f"{s['neg_bound_series']} of {s['n_positive_series']} positive series)"))
    return lines


# ----------------------------------------------------------------------------- one set
def run_set(args, name: str, work: Path) -> dict:
    t0 = time.perf_counter()
    if name == "b":
        entries = set_b(args)
        parts = [e["parts"] for e in entries]
    else:
        entries = set_a(args) if name == "a" else synthetic_panel(args.synthetic_series, args.synthetic_lengths,
                                                                   args.seed, args.synthetic_window)
        parts = [split_rows(e) for e in entries]
    train_rows = [r for p in parts for r in last_rows(p["train"], args.max_train_rows)]
    val_rows = [r for p in parts for r in last_rows(p["validation"], args.max_val_rows)]
    test_rows = [r for p in parts for r in p["test"]]
    _log(f"== set {name}: {len(entries)} series; {len(train_rows)} train, {len(val_rows)} validation, "
         f"{len(test_rows)} test rows")
    preds, info = train_and_predict(args, name, train_rows, val_rows, test_rows, work)
    rows, start = [], 0
    for e, p in zip(entries, parts):
        n = len(p["test"])
        idx = {k: np.array([r["t_index"] for r in p[k]]) for k in ("validation", "test")}
        # the targets as written in the rows are the series' values at t_index: the baselines forecast the same
        assert np.allclose([r["target"] for r in p["test"]], e["y"][idx["test"]], rtol=1e-12, atol=0)
        rows.append(score_series(e, idx["validation"], idx["test"], preds[start:start + n]))
        start += n
    copies = copy_ratios(rows) if name == "a" else None
    summary = summarise(rows, copies)
    cov_rows = [r for r in rows if r["n_test"] >= MIN_COVERAGE_ROWS]
    info["seconds"] = time.perf_counter() - t0
    return {"series": rows, "summary": summary, "copies": copies, "run": info,
            "checks": check_targets(name, summary, cov_rows)}


# ----------------------------------------------------------------------------- report
TITLES = {"a": "a: bundled series at scales 1e-3 .. 1e5", "b": "b: chat corpus (conversations)",
          "c": "c: synthetic panel (levels 1e-2 .. 1e6)"}


def format_set(name: str, res: dict) -> str:
    s, info = res["summary"], res["run"]
    lines = [f"### {TITLES[name]}", "",
             f"{info['train_rows']} train / {info['validation_rows']} validation / {info['test_rows']} test rows, "
             f"{info['steps']} steps, train {info['train_seconds']:.0f} s, predict {info['predict_seconds']:.1f} s, "
             f"calibrated intervals: {info['calibrated']}; ETS fell back to persistence on {s['ets_fallbacks']} "
             "series.", "",
             "| series | kind | n test | MAE | MAE / persistence (90% CI) | best window baseline (validation) "
             "| MAE / best window | best baseline incl. ETS | MAE / best | MAE / AR | MAE / ETS | MASE | cov 50 "
             "| cov 90 | n_eff 50 / 90 | AR p | neg. lower 90 |", "| --- " * 17 + "|"]
    for r in res["series"]:
        kind = {True: "mult", False: "add"}.get(r.get("multiplicative"), "")
        lines.append(f"| {r['series']} | {kind} | {r['n_test']} | {_fmt(r['mae'])} | {_fmt(r['vs_persistence'], 3)} "
                     f"({_fmt(r['vs_persistence_lo90'], 3)}..{_fmt(r['vs_persistence_hi90'], 3)}) "
                     f"| {r['best_window_baseline']} | {_fmt(r['vs_best_window'], 3)} | {r['best_baseline']} "
                     f"| {_fmt(r['vs_best'], 3)} | {_fmt(r['vs_ar'], 3)} | {_fmt(r['vs_ets'], 3)} "
                     f"| {_fmt(r['mase'], 3)} | {_fmt(r['cov50'], 2)} | {_fmt(r['cov90'], 2)} "
                     f"| {_fmt(r['neff50'], 3)} / {_fmt(r['neff90'], 3)} | {r['ar_order']} | {r['neg_bounds90']} |")
    lines += ["", "| summary | value |", "| --- | --- |"]
    for k in ("gm_vs_persistence", "gm_vs_best_window", "gm_vs_best", "gm_vs_ar", "gm_vs_ets", "worst_vs_persistence",
              "worst_vs_persistence_lo90", "worst_vs_persistence_hi90", "worst_series", "n_above_worst_target",
              "n_series", "n_beat_persistence", "gm_mase", "n_positive_series", "neg_bounds90", "neg_bound_series",
              *KIND_KEYS, "mult_worst_series", "n_coverage_series", "cov50_min", "cov50_max", "cov90_min",
              "cov90_max", *COVERAGE_KEYS, "cov50_mean_neff_share", "cov90_mean_neff_share", "cov50_all_in_exact",
              "cov90_all_in_exact", "max_abs_copy_deviation"):
        if k in s:
            lines.append(f"| {k} | {s[k] if isinstance(s[k], str) else _fmt(s[k], 4)} |")
    if res["copies"]:
        labels = [scale_label(x) for x in SCALES if any(scale_label(x) in by for by in res["copies"].values())]
        lines += ["", "(MAE / scale) / (MAE at scale 1), per copy:", "",
                  "| series | " + " | ".join(labels) + " |", "| --- " * (len(labels) + 1) + "|"]
        for base, by in res["copies"].items():
            lines.append(f"| {base} | " + " | ".join(_fmt(by.get(x, math.nan), 3) for x in labels) + " |")
    return "\n".join(lines)


def result_line(results: dict) -> str:
    kv = {}
    for name, res in results.items():
        s = res["summary"]
        for k in ("gm_vs_persistence", "gm_vs_best_window", "gm_vs_best", "gm_vs_ar", "gm_vs_ets",
                  "worst_vs_persistence", "worst_vs_persistence_lo90", "worst_vs_persistence_hi90", "n_series",
                  "n_beat_persistence", "neg_bounds90", "cov50_min", "cov50_max", "cov90_min", "cov90_max",
                  *COVERAGE_KEYS, *KIND_KEYS, "max_abs_copy_deviation"):
            if k in s:
                kv[f"{name}_{k}"] = s[k]
    return "RESULT " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in kv.items())


def code_state() -> dict:
    """The commit and the files changed since it (the benchmark measures the working tree as it is)."""
    root = Path(__file__).resolve().parents[1]
    run = lambda *a: subprocess.run(["git", *a], cwd=root, capture_output=True, text=True).stdout.strip()
    try:
        return {"commit": run("rev-parse", "HEAD"), "changed": run("status", "--short").splitlines()}
    except OSError:
        return {}


# ----------------------------------------------------------------------------- main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--sets", default=",".join(SETS), help="comma-separated subset of a,b,c (default all)")
    ap.add_argument("--steps", type=int, default=None,
                    help="optimizer steps per adapter (default: TrainConfig's, max_steps -1: num_train_epochs 3)")
    ap.add_argument("--max-train-rows", type=int, default=None,
                    help="keep only the last N training rows of each series (default all)")
    ap.add_argument("--max-val-rows", type=int, default=None,
                    help="keep only the last N validation rows of each series in the adapter's validation file "
                    "(default all; the baselines are always chosen on every validation target)")
    ap.add_argument("--synthetic-series", type=int, default=50, help="series of set c")
    ap.add_argument("--synthetic-lengths", default=",".join(map(str, SYNTHETIC_LENGTHS)),
                    help="lengths the series of set c draw from (comma-separated)")
    ap.add_argument("--synthetic-window", type=int, default=SYNTHETIC_WINDOW,
                    help="values in each row of set c (default %(default)s); the baselines see the whole history")
    ap.add_argument("--recent-values", type=int, default=None,
                    help="TrainConfig.recent_values: how many of the text's most recent numbers the value head "
                    "reads (default: TrainConfig's). Dates count: a 'YYYY-MM: v' row gives one value in three")
    ap.add_argument("--quick", action="store_true", help="toy size for a smoke test: few short series, 2 steps")
    ap.add_argument("--output", default="/tmp/scales.md", help="markdown tables; the JSON goes beside it (.json)")
    ap.add_argument("--seed", type=int, default=42, help="TrainConfig.seed, the chat corpus and the synthetic panel")
    args = ap.parse_args(argv)
    args.sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    if not args.sets or any(s not in SETS for s in args.sets):
        ap.error(f"--sets: choose from {','.join(SETS)}")
    args.synthetic_lengths = tuple(int(x) for x in str(args.synthetic_lengths).split(","))
    args.a_series, args.a_scales, args.chat_series, args.tiny = tuple(BUNDLED), SCALES, None, {}
    if args.quick:
        args.steps = QUICK["steps"] if args.steps is None else args.steps
        args.a_series, args.a_scales, args.chat_series = QUICK["a_series"], QUICK["a_scales"], QUICK["chat_series"]
        args.synthetic_series, args.synthetic_lengths = QUICK["synthetic_series"], QUICK["synthetic_lengths"]
        args.max_train_rows = QUICK["max_train_rows"] if args.max_train_rows is None else args.max_train_rows
        args.max_val_rows = QUICK["max_val_rows"] if args.max_val_rows is None else args.max_val_rows
        args.tiny = QUICK["tiny"]
    if args.chat_series is None:
        from causal_adapter.data.corpora import CHAT_SERIES

        args.chat_series = tuple(CHAT_SERIES)
    if args.steps is not None and args.steps < 1:
        ap.error("--steps must be >= 1")
    for k in ("max_train_rows", "max_val_rows"):
        if getattr(args, k) is not None and getattr(args, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be >= 1")
    if (args.synthetic_series < 1 or args.synthetic_window < 1
            or min(args.synthetic_lengths) < args.synthetic_window + 20):
        ap.error("--synthetic-series >= 1, --synthetic-window >= 1 and lengths >= the window + 20")
    if args.recent_values is not None and args.recent_values < 1:
        ap.error("--recent-values must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    offline()
    t0 = time.perf_counter()
    results = {}
    with tempfile.TemporaryDirectory(prefix="scales_") as tmp:
        for name in args.sets:
            results[name] = run_set(args, name, Path(tmp))
            # this set's figures now: a long run that is stopped keeps the sets it finished
            _log(format_set(name, results[name]) + f"\n[set {name} done, {results[name]['run']['seconds']:.0f} s] "
                 + result_line({name: results[name]})[len("RESULT "):])
    checks = [c for name in args.sets for c in results[name]["checks"]]
    check_lines = [f"{'PASS' if ok else 'FAIL'} {line}" for ok, line in checks]
    steps = "TrainConfig default (3 epochs)" if args.steps is None else f"{args.steps}"
    tiny = f", tiny base {args.tiny}" if args.tiny else ""
    recent = "" if args.recent_values is None else f", recent_values {args.recent_values}"
    note = (f"Default TrainConfig (embedded tiny Qwen{tiny}{recent}, real tokenizer, seed {args.seed}), "
            f"steps: {steps}; "
            f"training / validation rows per series: the last {args.max_train_rows or 'all'} / "
            f"{args.max_val_rows or 'all'}; set c rows of {args.synthetic_window} values. Choices on validation, "
            "figures on test. "
            f"Coverage ranges over series with >= {MIN_COVERAGE_ROWS} test rows.")
    text = "\n\n".join([format_set(n, results[n]) for n in args.sets] + ["### targets\n\n" + "\n".join(check_lines),
                                                                        note])
    line = result_line(results)
    write_report(Path(args.output), text, line, time.perf_counter() - t0,
                 {"settings": dict(vars(args)), "code": code_state(),
                  "results": {n: {k: v for k, v in r.items() if k != "checks"} for n, r in results.items()},
                  "checks": [{"pass": ok, "line": ln} for ok, ln in checks]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
