"""Series, baselines and scoring the series benchmarks share (not a benchmark; no script imports another script):
the series (`series_entry`, `split_bounds` / `split_rows` 70/15/15 by time, `set_a`, `synthetic_panel`), the
baselines fitted per series on its training part (`one_step_baselines`, `ar_fit` / `ar_forecasts`, `iterated` /
`choose_ar` H steps ahead, `window_ar` on rows' windows) and the scoring (`score_series`, `summarise`, `ratio`,
`gmean`, `effective_n`, `block_bootstrap_ratio`, `coverage_reference`, ...). Each function's docstring says how."""
from __future__ import annotations

import math
import warnings

import numpy as np
import torch

from common import ridge_fit, ridge_predict

SPLIT = (0.70, 0.15, 0.15)
AR_MAX_P = 12
SCALES = (1e-3, 1e-1, 1.0, 10.0, 1e3, 1e5)
#: the bundled series of set a: name -> (title, window, season); the titles and windows are the corpora's
BUNDLED = {
    "sunspots": ("Yearly sunspot numbers.", 10, None),
    "nile": ("Annual flow of the Nile at Aswan (10^8 m^3).", 10, None),
    "co2": ("Monthly mean CO2 at Mauna Loa (ppm).", 12, 12),
    "elnino": ("Monthly sea surface temperature, Pacific 0-10 S 90-80 W (deg C).", 12, 12),
    "macro/unemp": ("US quarterly unemployment rate (%).", 8, None),
}
CHAT_SEASON = {"co2": 12, "elnino": 12}
SYNTHETIC_WINDOW = 12
SYNTHETIC_LENGTHS = (96, 144, 240)
#: the share of the synthetic panel's series whose season and noise multiply with the level
MULT_FRACTION = 0.4
#: the candidates of the best WINDOW baseline: what sees only the row's window (never ETS nor the training drift)
WINDOW_BASELINES = ("persistence", "window_drift", "seasonal_naive", "ar")
#: MAE / persistence: a moving-block bootstrap over the test rows (blocks of ~sqrt(n) rows)
BOOT_RESAMPLES = 2000
BOOT_LEVEL = 0.90
BOOT_SEED = 0
#: coverage: the band of `in_band` per level, the exact binomial test's level, the quantile of the count of series
#: off the level under exact intervals that a coverage target allows
COVERAGE_BANDS = {"50": (0.30, 0.70), "90": (0.75, 0.98)}
COVERAGE_TEST_ALPHA = 0.01
COVERAGE_OFF_QUANTILE = 0.95
MIN_COVERAGE_ROWS = 20


# ----------------------------------------------------------------------------- series
def scale_label(s: float) -> str:
    return "1" if s == 1 else f"1e{round(math.log10(s))}"


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


# ----------------------------------------------------------------------------- baselines
def ar_fit(y: np.ndarray, train_end: int, p: int):
    """AR(p) with intercept by least squares on the standardised training part: (weights, mu, sd)."""
    z, mu, sd = standardise(y, train_end)
    idx = np.arange(p, train_end)
    X = torch.tensor(np.stack([z[idx - j] for j in range(1, p + 1)], 1), dtype=torch.float64)
    try:
        w = ridge_fit(X, torch.tensor(z[idx], dtype=torch.float64), 0.0)
    except RuntimeError:  # collinear lags (a constant stretch): the smallest penalty of the grid
        w = ridge_fit(X, torch.tensor(z[idx], dtype=torch.float64), 1e-8)
    return w, mu, sd


def iterated(entry: dict, first: int, H: int, ar=None) -> dict[str, np.ndarray]:
    """Each baseline's H forecasts from the row's window (values before `first`), iterated on its own forecasts."""
    y, w, season = entry["y"], entry["window"], entry["season"]
    hist = y[first - w:first]
    out = {"persistence": np.full(H, hist[-1])}
    if season and season <= w:
        out["seasonal_naive"] = np.array([hist[len(hist) - season + (h % season)] for h in range(H)])
    if w >= 2:
        out["window_drift"] = hist[-1] + (hist[-1] - hist[0]) / (w - 1) * np.arange(1, H + 1)
    if ar is not None:
        wts, mu, sd, p = ar
        z = list((y[first - p:first] - mu) / sd)
        f = []
        for _ in range(H):
            x = torch.tensor([z[-j] for j in range(1, p + 1)], dtype=torch.float64).unsqueeze(0)
            nxt = float(ridge_predict(wts, x)[0])
            z.append(nxt)
            f.append(mu + sd * nxt)
        out["ar"] = np.array(f)
    return out


def choose_ar(entry: dict, val_rows: list[dict], H: int):
    """The AR order (1..min(12, window)) with the smallest validation MAE of its iterated forecasts."""
    y, te = entry["y"], entry["train_end"]
    best = None
    for p in range(1, min(AR_MAX_P, entry["window"], (te - 2) // 3) + 1):
        fit = (*ar_fit(y, te, p), p)
        err = [abs(iterated(entry, r["first"], H, fit)["ar"] - y[r["first"]:r["first"] + H]).mean() for r in val_rows]
        score = float(np.mean(err)) if err else math.inf
        if best is None or score < best[0]:
            best = (score, fit)
    return None if best is None else best[1]


def standardise(y: np.ndarray, train_end: int) -> tuple[np.ndarray, float, float]:
    """The series in units of its training part: AR and ETS are affine-equivariant, and their fits (least
    squares, statsmodels' optimiser) are then the same at every scale of set a."""
    mu, sd = float(y[:train_end].mean()), float(y[:train_end].std())
    sd = sd if sd > 0 else 1.0
    return (y - mu) / sd, mu, sd


def ar_forecasts(y: np.ndarray, train_end: int, p: int) -> np.ndarray:
    """One-step forecasts f[i] (i >= p; nan before) of AR(p) with intercept, least squares on the training part."""
    w, mu, sd = ar_fit(y, train_end, p)
    z, idx = (y - mu) / sd, np.arange(p, len(y))
    f = np.full(len(y), np.nan)
    f[idx] = mu + sd * ridge_predict(w, torch.tensor(np.stack([z[idx - j] for j in range(1, p + 1)], 1),
                                                      dtype=torch.float64)).numpy()
    return f


def ets_forecasts(y: np.ndarray, train_end: int, season) -> np.ndarray:
    """Holt-Winters (additive trend, additive season where there is one) fitted on the training part, then run
    over the whole series with its parameters and initial states fixed: the fitted values are one-step forecasts."""
    from statsmodels.tsa.holtwinters import ExponentialSmoothing

    z, mu, sd = standardise(y, train_end)
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


def one_step_baselines(entry: dict, idx: dict[str, np.ndarray]) -> dict:
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


def window_ar(windows: dict[str, list], y: dict[str, list], max_p: int):
    """AR(p) by least squares (intercept, no penalty) on the last p values of each row's window (oldest first),
    fitted on the ``train`` rows, p in 1..`max_p` with the smallest ``validation`` MAE: (p, weights, {split: the
    rows' [n, p] lag matrix})."""
    best = None
    for p in range(1, max_p + 1):
        X = {k: torch.tensor([list(h)[-p:] for h in v], dtype=torch.float64) for k, v in windows.items()}
        w = ridge_fit(X["train"], torch.tensor(y["train"], dtype=torch.float64), 0.0)
        target = torch.tensor(y["validation"], dtype=torch.float64)
        val = float((ridge_predict(w, X["validation"]) - target).abs().mean())
        if best is None or val < best[0]:
            best = (val, p, w, X)
    return best[1:]


# ----------------------------------------------------------------------------- scoring
def score_series(entry: dict, val_idx: np.ndarray, test_idx: np.ndarray, preds: list[dict]) -> dict:
    y = entry["y"]
    base = one_step_baselines(entry, {"validation": val_idx, "test": test_idx})
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


def score_entries(entries: list[dict], parts: list[dict], preds: list[dict]) -> list[dict]:
    """`score_series` of each series, whose test rows (`parts[i]["test"]`, in that order) the prediction rows
    `preds` follow; the targets as written in the rows are the series' values at their t_index (asserted)."""
    rows, start = [], 0
    for e, p in zip(entries, parts):
        n = len(p["test"])
        idx = {k: np.array([r["t_index"] for r in p[k]]) for k in ("validation", "test")}
        assert np.allclose([r["target"] for r in p["test"]], e["y"][idx["test"]], rtol=1e-12, atol=0)
        rows.append(score_series(e, idx["validation"], idx["test"], preds[start:start + n]))
        start += n
    return rows


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else (1.0 if a == 0 else math.inf)


def gmean(v) -> float:
    v = [x for x in v if x > 0 and math.isfinite(x)]
    return math.exp(sum(map(math.log, v)) / len(v)) if v else math.nan


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


def in_band(r: dict, q: str) -> bool:
    """Series `r`'s coverage at level q ("50", "90") lies in the target band `COVERAGE_BANDS[q]`."""
    lo, hi = COVERAGE_BANDS[q]
    return lo <= r[f"cov{q}"] <= hi


def coverage_reference(cov_rows: list[dict]) -> dict:
    """What exact intervals would give on these series, per level q (50, 90). A series' test rows are consecutive
    steps, so its misses may cluster: it counts as n_e = max(1, round(``neff{q}``)) independent rows
    (`effective_n`; a row without ``neff{q}`` counts its n_test), and its covered count as round(cov * n_e). Under
    exact intervals that count is Binomial(n_e, q), so some series fall outside the band `COVERAGE_BANDS[q]`, or
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
        lo, hi = COVERAGE_BANDS[q]
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


def summarise(rows: list[dict], copies: dict | None = None, worst_target: float = 1.05) -> dict:
    """A set's figures over its `score_series` rows: geometric means of the ratios, the worst series vs
    persistence (``n_above_worst_target``: series whose whole bootstrap interval lies above `worst_target`), coverage
    ranges and `coverage_reference` over the series with >= `MIN_COVERAGE_ROWS` test rows, negative bounds,
    `kind_summary` where rows are marked ``multiplicative``, and set a's `copies` deviation."""
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
           "n_above_worst_target": sum(r["vs_persistence_lo90"] > worst_target for r in rows),
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
