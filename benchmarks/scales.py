"""Does the value head predict as well at 10^-3 as at 10^5? docs/numeric_quality.md, "Per-row units: the figures".

    python benchmarks/scales.py --steps 60             # sets a, b, c, every row (~20 min on 2 cores)
    python benchmarks/scales.py --steps 60 --max-train-rows 32 --max-val-rows 4 --synthetic-lengths 144   # ~5 min
    python benchmarks/scales.py --quick                # toy size (smoke test, ~60 s of CPU)
    python benchmarks/scales.py --holdout [--steps N]  # eleven real quarterly series no set holds (~3 min)

Three sets, each ONE training file and one adapter trained and predicted as the CLI does (`common.train_and_predict`):
``a`` the bundled series copied at `SCALES`, ``b`` the chat corpus's seven series, ``c`` a seeded synthetic panel
(additive and multiplicative seasons). Split 70/15/15 by time, choices on VALIDATION, figures on TEST against
`baselines.one_step_baselines`; the targets print one PASS / FAIL line each. Tables and JSON at ``--output``, then
ONE last line ``RESULT key=value ...`` (``<set>_<summary key>``).
"""
from __future__ import annotations

import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from baselines import (AR_MAX_P, BOOT_LEVEL, BUNDLED, CHAT_SEASON, COVERAGE_BANDS, COVERAGE_OFF_QUANTILE,
                       COVERAGE_TEST_ALPHA, MIN_COVERAGE_ROWS, SCALES, SPLIT, SYNTHETIC_LENGTHS, SYNTHETIC_WINDOW,
                       gmean, in_band, last_rows, scale_label, score_entries, series_entry, set_a, split_rows,
                       summarise, synthetic_panel)
from common import (check_run_arguments, code_state, fmt as _fmt, log as _log, offline, run_arguments,
                    train_and_predict, write_report)

SETS = ("a", "b", "c")
#: `coverage_reference`'s keys in the RESULT line (its all-inside probabilities go in the tables and check lines)
COVERAGE_KEYS = tuple(f"cov{q}_{part}" for q in ("50", "90")
                      for part in ("out", "out_exact", "off", "off_exact", "off_q95", "off_iid"))
#: set c's figures per kind of series (`kind_summary`), in the tables and the RESULT line
KIND_KEYS = ("mult_n_series", "mult_gm_vs_ar", "mult_worst_vs_ar", "mult_gm_vs_best_window", "mult_gm_vs_persistence",
             "add_n_series", "add_gm_vs_ar", "add_gm_vs_best_window", "add_gm_vs_persistence")
CHAT_WINDOW = 48  # chat_corpus's default longest window
#: cov50 / cov90: the band of `in_band` (the exact-interval reference's "out"); the coverage TARGET is the count
#: of series off the level (`coverage_reference`). worst_vs_persistence: the value the worst series' bootstrap
#: interval must reach down to
TARGETS = {"copy_deviation": 0.10, "worst_vs_persistence": 1.05, "gm_vs_best_window": 1.0, "gm_vs_persistence": 0.8,
           "mult_gm_vs_ar": 1.1, "neg_bounds90": 0, "cov50": COVERAGE_BANDS["50"], "cov90": COVERAGE_BANDS["90"]}
#: --quick: a few series, few training / validation rows, 2 steps on a smaller tiny base (the pipeline end to
#: end, not the figures); each set keeps one series with >= MIN_COVERAGE_ROWS test rows, so every key is finite
QUICK = dict(steps=2, a_series=("macro/unemp",), a_scales=(1e-1, 1.0, 1e3), chat_series=("macro/unemp",),
             synthetic_series=2, synthetic_lengths=(160,), max_train_rows=6, max_val_rows=4,
             tiny=dict(tiny_hidden_size=16, tiny_layers=1))


# ----------------------------------------------------------------------------- data
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


# ----------------------------------------------------------------------------- scoring
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
    rows = score_entries(entries, parts, preds)
    copies = copy_ratios(rows) if name == "a" else None
    summary = summarise(rows, copies, TARGETS["worst_vs_persistence"])
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


# ----------------------------------------------------------------------------- hold-out
def holdout_series():
    """--holdout: statsmodels' macrodata columns other than unemp / infl / realgdp and the German
    interest_inflation data, levels 0.016 .. 5,000, in ONE training file, windows of 8, split 70/15/15."""
    import statsmodels.api as sm

    m = sm.datasets.macrodata.load_pandas().data
    t = [f"{int(y)} Q{int(q)}" for y, q in zip(m.year, m.quarter)]
    titles = {"realcons": "US real personal consumption (bn 2005 USD)",
              "realinv": "US real private investment (bn 2005 USD)",
              "realgovt": "US real government spending (bn 2005 USD)",
              "realdpi": "US real disposable income (bn 2005 USD)",
              "cpi": "US consumer price index", "m1": "US M1 money stock (bn USD)",
              "tbilrate": "US 3-month T-bill rate (%)",
              "pop": "US population (millions)", "realint": "US real interest rate (%)"}
    out = [(k, v + ".", t, [float(x) for x in m[k]]) for k, v in titles.items()]
    ii = sm.datasets.interest_inflation.load_pandas().data
    t2 = [f"{int(y)} Q{int(q)}" for y, q in zip(ii.year, ii.quarter)]
    out += [("de/Dp", "German quarterly inflation (log difference of the deflator).", t2,
             [round(float(x), 5) for x in ii.Dp]),
            ("de/R", "German long-term interest rate (fraction).", t2, [round(float(x), 5) for x in ii.R])]
    return out


def run_holdout(args) -> int:
    """Scored as a set is (`score_entries`), trained with every training setting the default."""
    entries = [series_entry(n, title, t, v, 8, None) for n, title, t, v in holdout_series()]
    parts = [split_rows(e) for e in entries]
    tr, va, te = ([r for p in parts for r in p[k]] for k in ("train", "validation", "test"))
    print(f"{len(entries)} series, {len(tr)}/{len(va)}/{len(te)} rows")
    preds, info = train_and_predict(args, "holdout", tr, va, te, Path(tempfile.mkdtemp(prefix="scales_holdout_")))
    rows = score_entries(entries, parts, preds)
    print("| series | level | n test | MAE / persistence | MAE / best (validation) | cov 50 | cov 90 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r, e in zip(rows, entries):
        print(f"| {r['series']} | {np.median(np.abs(e['y'])):.4g} | {r['n_test']} | {r['vs_persistence']:.3f} "
              f"| {r['vs_best']:.3f} ({r['best_baseline']}) | {r['cov50']:.2f} | {r['cov90']:.2f} |")
    gm = gmean(r["vs_persistence"] for r in rows)
    gb = gmean(r["vs_best"] for r in rows)
    print(f"RESULT holdout_gm_vs_persistence={gm:.4g} holdout_gm_vs_best={gb:.4g} "
          f"min_cov90={min(r['cov90'] for r in rows):.3g} n_beat_persistence="
          f"{sum(r['vs_persistence'] < 1 for r in rows)}/{len(rows)} calibrated={info['calibrated']} "
          f"steps={info['steps']}")
    return 0


# ----------------------------------------------------------------------------- main
def parse_args(argv=None):
    ap = run_arguments(__doc__, "/tmp/scales.md", "TrainConfig.seed, the chat corpus and the synthetic panel")
    ap.add_argument("--sets", default=",".join(SETS), help="comma-separated subset of a,b,c (default all)")
    ap.add_argument("--synthetic-series", type=int, default=50, help="series of set c")
    ap.add_argument("--synthetic-lengths", default=",".join(map(str, SYNTHETIC_LENGTHS)),
                    help="lengths the series of set c draw from (comma-separated)")
    ap.add_argument("--synthetic-window", type=int, default=SYNTHETIC_WINDOW,
                    help="values in each row of set c (default %(default)s); the baselines see the whole history")
    ap.add_argument("--recent-values", type=int, default=None,
                    help="TrainConfig.recent_values: how many of the text's most recent numbers the value head "
                    "reads (default: TrainConfig's). Dates count: a 'YYYY-MM: v' row gives one value in three")
    ap.add_argument("--quick", action="store_true", help="toy size for a smoke test: few short series, 2 steps")
    ap.add_argument("--holdout", action="store_true", help="the hold-out set instead: eleven real quarterly series "
                    "(statsmodels) no set holds, every training setting the default, 60 steps unless --steps")
    args = ap.parse_args(argv)
    if args.holdout:
        args.steps, args.tiny, args.recent_values = args.steps or 60, {}, None
        return args
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
    check_run_arguments(ap, args)
    if (args.synthetic_series < 1 or args.synthetic_window < 1
            or min(args.synthetic_lengths) < args.synthetic_window + 20):
        ap.error("--synthetic-series >= 1, --synthetic-window >= 1 and lengths >= the window + 20")
    if args.recent_values is not None and args.recent_values < 1:
        ap.error("--recent-values must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    offline()
    if args.holdout:
        return run_holdout(args)
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
