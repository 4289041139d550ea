"""H values ahead with their intervals (`predict --horizon H --paths N`), per step: docs/predict.md, "A horizon".

    python benchmarks/horizon.py --speed                       # the path-sampling time alone (~1 min)
    python benchmarks/horizon.py --quick                       # toy size, every part (a few minutes on 2 cores)
    python benchmarks/horizon.py --steps 60 --max-train-rows 32 --max-val-rows 8 --synthetic-lengths 144

`scales.py`'s sets a, b, c cut as forecasting files (the prompt a window, the completion the next H values), one
adapter per set (the default `TrainConfig`, per-step maps fitted on validation). Per step: MAE against baselines
iterated from the row's window (persistence, seasonal naive, window drift, AR(p)) and the best of them chosen on
VALIDATION, 50% / 90% coverage, a scale-free Winkler 90. Speed (`--speed`, also part of every run): one row, H = 12,
the deterministic path alone against N = 100 paths in the same process (target <= 8x). Tables and JSON at
``--output``, then ONE last line ``RESULT ...``.
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from baselines import (BUNDLED, CHAT_SEASON, SCALES, SYNTHETIC_LENGTHS, SYNTHETIC_WINDOW, bundled_values,
                       choose_ar, gmean, iterated, last_rows, ratio, series_entry, set_a, synthetic_panel)
from common import fmt, log, offline, run_arguments, train_and_predict, write_report

SETS = ("a", "b", "c")
HORIZON = 12
PATHS = 100
SPEED_REPEATS = 15
LEVELS = (0.5, 0.9)
BASELINES = ("persistence", "seasonal_naive", "window_drift", "ar")
QUICK = dict(steps=2, a_series=("macro/unemp",), a_scales=(1e-1, 1.0, 1e3), chat_series=("macro/unemp",),
             synthetic_series=2, synthetic_lengths=(160,), max_train_rows=6, max_val_rows=6,
             tiny=dict(tiny_hidden_size=16, tiny_layers=1), horizon=4, paths=20)


# ----------------------------------------------------------------------------- data
def entries(args, name: str) -> list[dict]:
    """The set's series (`baselines.py`'s entries: y, window, season, train_end, val_end, rows with prompts)."""
    if name == "a":
        return set_a(args)
    if name == "c":
        return synthetic_panel(args.synthetic_series, args.synthetic_lengths, args.seed,
                                      args.synthetic_window)
    from causal_adapter.data.corpora import CHAT_SERIES

    return [series_entry(s, CHAT_SERIES[s][1] + ".", *CHAT_SERIES[s][0]("chat"), 12, CHAT_SEASON.get(s))
            for s in args.chat_series]


def forecast_rows(entry: dict, H: int) -> dict[str, list[dict]]:
    """The series' rows in the forecasting layout, by split (module docstring); each keeps ``first`` (the index of
    its first value), ``continuations`` (its H - 1 labels) and ``series``."""
    rows, y = entry["rows"], entry["y"]
    by_index = {r["t_index"]: r for r in rows}
    out: dict[str, list[dict]] = {"train": [], "validation": [], "test": []}
    for r in rows:
        i = r["t_index"]
        if i + H - 1 >= len(y):
            continue
        later = [by_index[j] for j in range(i + 1, i + H)]
        comp = r["completion"] + "".join(f"; {x['time']}: {x['completion'].strip()}" for x in later)
        split = ("train" if i + H - 1 < entry["train_end"] else
                 "validation" if i >= entry["train_end"] and i + H - 1 < entry["val_end"] else
                 "test" if i >= entry["val_end"] else None)
        if split is not None:
            out[split].append({"prompt": r["prompt"], "completion": comp, "first": i, "series": entry["name"],
                               "continuations": [f"; {x['time']}:" for x in later]})
    return out


# ----------------------------------------------------------------------------- the adapter
def train_and_forecast(args, name: str, split: dict, work: Path) -> tuple[list[dict], dict]:
    """Train one adapter on the set's files (default TrainConfig, `common.train_and_predict`), predict every test
    row with --horizon (the test file also carries the known labels: predict --horizon reads them); (the
    prediction rows in test order, run info)."""
    cols = {k: ("prompt", "completion") + (("continuations",) if k == "test" else ()) for k in split}
    rows = [[{c: r[c] for c in cols[k]} for r in split[k]] for k in ("train", "validation", "test")]
    preds, info = train_and_predict(args, name, *rows, work, levels=LEVELS, horizon=args.horizon, paths=args.paths,
                                    seed=args.seed)
    info["rows"] = {k: len(v) for k, v in split.items()}
    return preds, info


def score_set(entries_: list[dict], splits: dict[str, dict], preds: list[dict], test_rows: list[dict], H: int) -> dict:
    """Per step: gm MAE / best window baseline and / persistence over series, pooled coverage, scaled Winkler."""
    per_step = []
    by_series: dict[str, list[tuple[dict, dict]]] = {}
    for r, p in zip(test_rows, preds):
        by_series.setdefault(r["series"], []).append((r, p))
    choices = {}
    for e in entries_:
        if e["name"] not in by_series:
            continue
        val = splits[e["name"]]["validation"]
        ar = choose_ar(e, val, H)
        val_err = {b: np.zeros(H) for b in BASELINES}
        for r in val:
            fc = iterated(e, r["first"], H, ar)
            for b, f in fc.items():
                val_err[b] += np.abs(f - e["y"][r["first"]:r["first"] + H])
        avail = [b for b in BASELINES if b in iterated(e, e["window"], H, ar)]
        choices[e["name"]] = (ar, [min(avail, key=lambda b: val_err[b][h]) if val else "persistence" for h in range(H)])
    for h in range(H):
        ratios_best, ratios_pers, cov = [], [], {q: [] for q in LEVELS}
        wink = []
        for e in entries_:
            rows = by_series.get(e["name"])
            if not rows:
                continue
            ar, best = choices[e["name"]]
            y = e["y"]
            scale = float(np.mean(np.abs(np.diff(y[:e["train_end"]])))) or 1.0
            err, err_best, err_pers = [], [], []
            for r, p in rows:
                t = y[r["first"] + h]
                s = p["horizon"][h]
                fc = iterated(e, r["first"], H, ar)
                err.append(abs(s["value"] - t))
                err_best.append(abs(fc[best[h]][h] - t))
                err_pers.append(abs(fc["persistence"][h] - t))
                for q in LEVELS:
                    n = format(round(100 * q), "d")
                    cov[q].append(s[f"lower_{n}"] <= t <= s[f"upper_{n}"])
                lo, hi = s["lower_90"], s["upper_90"]
                wink.append(((hi - lo) + 20.0 * (max(lo - t, 0.0) + max(t - hi, 0.0))) / scale)
            ratios_best.append(ratio(np.mean(err), np.mean(err_best)))
            ratios_pers.append(ratio(np.mean(err), np.mean(err_pers)))
        per_step.append({"step": h + 1, "gm_vs_best_window": gmean(ratios_best),
                         "gm_vs_persistence": gmean(ratios_pers),
                         "cov50": float(np.mean(cov[0.5])), "cov90": float(np.mean(cov[0.9])),
                         "winkler90_scaled": float(np.mean(wink)), "n_rows": len(cov[0.5])})
    return {"per_step": per_step}


def run_set(args, name: str, work: Path) -> dict:
    t0 = time.perf_counter()
    ents = entries(args, name)
    splits = {}
    for e in ents:
        s = forecast_rows(e, args.horizon)
        s["train"] = last_rows(s["train"], args.max_train_rows)
        s["validation"] = last_rows(s["validation"], args.max_val_rows)
        splits[e["name"]] = s
    split = {k: [r for e in ents for r in splits[e["name"]][k]] for k in ("train", "validation", "test")}
    preds, info = train_and_forecast(args, name, split, work)
    res = score_set(ents, splits, preds, split["test"], args.horizon)
    step1 = check_step_one(info["adapter"], args, split["test"][:8], preds[:8])
    res["speed"] = speed(args, info["adapter"])
    return {**res, "run": {**info, "seconds": time.perf_counter() - t0, "step1_equals_predict": step1}}


def check_step_one(adapter: str, args, rows: list[dict], preds: list[dict]) -> bool:
    """Step 1 of the horizon rows is `predict_values`' value and intervals exactly."""
    from causal_adapter import CausalModel
    from causal_adapter.commands.predict import _lead
    from causal_adapter.training.config import TrainConfig
    from causal_adapter.training.loop import load_base_and_tokenizer

    base, tok = load_base_and_tokenizer(TrainConfig(**args.tiny))
    model = CausalModel.from_pretrained(base, adapter, tokenizer=tok)
    one = model.predict_values([r["prompt"] + _lead(r["completion"]) for r in rows], tokenizer=tok)
    return all(p["horizon"][0][k] == o[k] for p, o in zip(preds, one)
               for k in ("value", "lower_50", "upper_50", "lower_90", "upper_90"))


# ----------------------------------------------------------------------------- speed
def speed(args, adapter: str | None = None) -> dict:
    """N = `PATHS` paths at H = `HORIZON` against the deterministic path alone (module docstring); with `adapter`,
    that trained adapter on its base (`args.tiny`), else a fresh one on the embedded default base."""
    from causal_adapter.model import CausalModel, get_causal_model
    from causal_adapter.saving.assets import load_base, load_qwen_tokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tok = load_qwen_tokenizer()
    size = (args.tiny.get("tiny_hidden_size", 64), args.tiny.get("tiny_layers", 2)) if adapter else (64, 2)
    base, _ = load_base(None, "qwen2", "float32", *size)  # 64 x 2: the embedded default of train / predict
    if adapter:
        model = CausalModel.from_pretrained(base, adapter, tokenizer=tok)
    else:
        model = get_causal_model(base, tokenizer=tok)
        model.set_value_units(39.0, 38.0, 1)
    model.eval()
    e = series_entry("sunspots", "Yearly sunspot numbers.", *bundled_values("sunspots"), 10, None)
    row = forecast_rows(e, HORIZON)["test"][0]
    kw = dict(tokenizer=tok, horizon=HORIZON, continuations=[row["continuations"]], seed=0)
    prompt = [row["prompt"] + " "]
    model.predict_horizon(prompt, paths=PATHS, **kw)  # warm
    one, many = [], []
    for _ in range(SPEED_REPEATS):
        t = time.perf_counter()
        model.predict_horizon(prompt, paths=0, levels=None, **kw)
        one.append(time.perf_counter() - t)
        t = time.perf_counter()
        model.predict_horizon(prompt, paths=PATHS, **kw)
        many.append(time.perf_counter() - t)
    torch.set_num_threads(threads)
    return {"one_path_s": min(one), "paths_s": min(many), "ratio": min(many) / min(one), "paths": PATHS,
            "horizon": HORIZON, "base": f"{size[0]} hidden x {size[1]} layers",
            "adapter": "trained (set's)" if adapter else "fresh, value units set"}


# ----------------------------------------------------------------------------- report
def format_set(name: str, res: dict) -> str:
    run = res["run"]
    sp = res["speed"]
    lines = [f"### set {name}: {run['rows']} rows, u per {run['individual']}, calibrated steps "
             f"1..{run['calibrated_steps']}, step 1 == predict: {run['step1_equals_predict']}; speed with its adapter: "
             f"{sp['paths']} paths x {sp['horizon']} steps / one path = {sp['ratio']:.2f}x", "",
             "| step | gm MAE / best window | gm MAE / persistence | cov50 | cov90 | Winkler90 / scale | test rows |",
             "|---|---|---|---|---|---|---|"]
    for s in res["per_step"]:
        lines.append(f"| {s['step']} | {fmt(s['gm_vs_best_window'])} | {fmt(s['gm_vs_persistence'])} | "
                     f"{fmt(s['cov50'], 3)} | {fmt(s['cov90'], 3)} | {fmt(s['winkler90_scaled'])} | {s['n_rows']} |")
    return "\n".join(lines)


def result_line(results: dict, sp: dict | None) -> str:
    parts = []
    for name, res in results.items():
        for s in res["per_step"]:
            h = s["step"]
            parts += [f"{name}_h{h}_gm_vs_best_window={fmt(s['gm_vs_best_window'])}",
                      f"{name}_h{h}_cov50={fmt(s['cov50'], 3)}", f"{name}_h{h}_cov90={fmt(s['cov90'], 3)}"]
        parts.append(f"{name}_step1_equals_predict={res['run']['step1_equals_predict']}")
        parts.append(f"{name}_speed_vs_one={fmt(res['speed']['ratio'], 3)}")
    if sp is not None:
        parts += [f"speed_paths{sp['paths']}_h{sp['horizon']}_vs_one={fmt(sp['ratio'], 3)}",
                  f"one_path_s={fmt(sp['one_path_s'], 3)}", f"paths_s={fmt(sp['paths_s'], 3)}"]
    return "RESULT " + " ".join(parts)


def parse_args(argv=None):
    ap = run_arguments(__doc__, "/tmp/horizon.md", "TrainConfig.seed, the paths' draws, the chat corpus, the panel")
    ap.add_argument("--sets", default=",".join(SETS), help="comma-separated subset of a,b,c")
    ap.add_argument("--speed", action="store_true", help="the path-sampling time alone")
    ap.add_argument("--quick", action="store_true", help="toy size: few short series, 2 steps, H = 4, 20 paths")
    ap.add_argument("--horizon", type=int, default=HORIZON)
    ap.add_argument("--paths", type=int, default=PATHS)
    ap.add_argument("--synthetic-series", type=int, default=50)
    ap.add_argument("--synthetic-lengths", default=",".join(map(str, SYNTHETIC_LENGTHS)))
    ap.add_argument("--synthetic-window", type=int, default=SYNTHETIC_WINDOW)
    args = ap.parse_args(argv)
    args.sets = [s for s in args.sets.split(",") if s]
    args.synthetic_lengths = tuple(int(x) for x in str(args.synthetic_lengths).split(","))
    args.a_series, args.a_scales = tuple(BUNDLED), SCALES
    args.chat_series = ("sunspots", "nile", "co2", "elnino", "macro/unemp", "macro/infl", "macro/realgdp")
    args.tiny = {}
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    offline()
    t0 = time.perf_counter()
    sp = speed(args)
    log(f"speed: {PATHS} paths x {HORIZON} steps {sp['paths_s']:.3f} s, one path {sp['one_path_s']:.3f} s: "
        f"{sp['ratio']:.2f}x")
    results = {}
    if not args.speed:
        with tempfile.TemporaryDirectory(prefix="horizon_") as tmp:
            for name in args.sets:
                results[name] = run_set(args, name, Path(tmp))
                log(format_set(name, results[name]))
    text = "\n\n".join([format_set(n, r) for n, r in results.items()]
                       + [f"speed: {PATHS} paths x {HORIZON} steps / one deterministic path = {sp['ratio']:.2f}x "
                          f"({sp['paths_s']:.3f} s / {sp['one_path_s']:.3f} s, one thread)"])
    write_report(Path(args.output), text, result_line(results, sp), time.perf_counter() - t0,
                 {"settings": {k: v for k, v in vars(args).items()}, "results": results, "speed": sp})
    return 0


if __name__ == "__main__":
    sys.exit(main())
