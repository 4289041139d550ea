"""Intervals on ordered data (docs/predict.md, "Ordered data"): the CLI's default recipe, then `predict --targets-column`.

    python benchmarks/ordered_intervals.py --corpora co2 sunspots macro elnino --max-steps 300

Per corpus, through the commands a user runs (`causal-adapter data`, `train --train-file --validation-file
--max-steps N`, `predict`): the adapter's split-conformal intervals (no targets), the adaptive conformal ones
(`--targets-column target`, modeling/adaptive.py) and, on the same points, a constant-width split-conformal
interval (half-width = the conformal quantile of the validation |residuals|, the baseline).

The ACI step size is chosen on VALIDATION only, one for all the corpora (`choose_gamma`): per corpus the map
is fitted on the first half of the validation rows and ACI run on the second half, in order, for each gamma
of `--gammas`. The TEST figures use the adapter's own map (fitted on all the validation rows) and that gamma
(or `--gamma`). Last line: ``RESULT key=value ...``.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch

from causal_adapter.commands.main import main
from causal_adapter.modeling.adaptive import DEFAULT_GAMMA, adaptive_interval
from causal_adapter.saving.artifacts import CONFIG_NAME
from causal_adapter.modeling.intervals import conformal_multiplier, fit_calibration, interval, winkler

LEVELS = (0.5, 0.9)


def _rows(path: Path) -> dict:
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    return {k: torch.tensor([r[k] for r in rows], dtype=torch.float64) for k in ("target", "value", "scale")}


def scores(y, lo, hi, level) -> dict:
    return {"cov": float(((y >= lo) & (y <= hi)).double().mean()), "winkler": float(winkler(y, lo, hi, level).mean())}


def constant_width(val: dict, test: dict, level: float) -> tuple:
    cal = fit_calibration(val["target"], val["value"], torch.ones_like(val["value"]))
    c = conformal_multiplier(cal, level)
    return test["value"] - c, test["value"] + c


def validation_table(val: dict, gammas) -> dict:
    """{gamma: {level: scores}} of ACI on the second half of the validation rows, in order (map: the first half)."""
    h = len(val["target"]) // 2
    first = {k: v[:h] for k, v in val.items()}
    second = {k: v[h:] for k, v in val.items()}
    cal = fit_calibration(first["target"], first["value"], first["scale"])
    return {g: {q: scores(second["target"], *adaptive_interval(second["target"], second["value"], second["scale"],
                                                               q, cal, gamma=g), q) for q in LEVELS}
            for g in gammas}


def choose_gamma(tables: dict) -> tuple[float, dict]:
    """One gamma for all corpora from their validation tables: the smallest mean over corpora of
    (Winkler 50 + Winkler 90) / the same at the smallest gamma of the grid. The interval score is proper (its
    expectation is smallest at the true quantiles), so it already charges a gamma for missing coverage; a
    coverage filter on these halves (10 to 54 rows: a 50% coverage has a binomial sd of 0.07 to 0.16) would
    choose on noise. Returns (gamma, {gamma: that mean})."""
    gammas = sorted(next(iter(tables.values())))
    wsum = lambda t, g: sum(t[g][q]["winkler"] for q in LEVELS)  # noqa: E731
    crit = {g: sum(wsum(t, g) / wsum(t, gammas[0]) for t in tables.values()) / len(tables) for g in gammas}
    return min(gammas, key=crit.get), crit


def run_corpus(corpus: str, args, work: Path) -> dict:
    """Train (the CLI's default recipe; reused when `work` holds the run) and predict; returns
    {"validation": rows, "test": rows, "calibration": the adapter's map}."""
    data = work / "data"
    main(["data", corpus, str(data)])
    out = work / f"run_{corpus}"
    if not (out / "adapter").is_dir():  # a finished run in --work-dir is reused
        main(["train", "--train-file", str(data / f"{corpus}_train.jsonl"), "--validation-file",
              str(data / f"{corpus}_validation.jsonl"), "--max-steps", str(args.max_steps), "--output-dir", str(out),
              "--no-plot", *args.train_args])
    adapter = str(out / "adapter")
    preds = {}
    for split in ("validation", "test"):
        f = work / f"{corpus}_{split}_pred.jsonl"
        main(["predict", adapter, "--data-file", str(data / f"{corpus}_{split}.jsonl"), "--output", str(f),
              "--targets-column", "target"])  # the file's value / scale; the intervals are recomputed here
        preds[split] = _rows(f)
    preds["calibration"] = json.loads((Path(adapter) / CONFIG_NAME).read_text())["adapter_config"]["value_calibration"]
    return preds


def test_scores(p: dict, gamma: float) -> dict:
    val, test, cal = p["validation"], p["test"], p["calibration"]
    y, res = test["target"], {"mae": float((test["target"] - test["value"]).abs().mean()), "n_test": len(test["target"])}
    for q in LEVELS:
        res[f"split_{q}"] = scores(y, *interval(test["value"], test["scale"], q, cal), q)
        res[f"aci_{q}"] = scores(y, *adaptive_interval(y, test["value"], test["scale"], q, cal, gamma=gamma), q)
        res[f"constwidth_{q}"] = scores(y, *constant_width(val, test, q), q)
    return res


def main_(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpora", nargs="+", default=["co2", "sunspots", "macro", "elnino"])
    ap.add_argument("--max-steps", type=int, default=300)
    ap.add_argument("--gammas", nargs="+", type=float, default=[0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5])
    ap.add_argument("--gamma", type=float, default=None, help="test gamma (default: the one chosen on validation)")
    ap.add_argument("--work-dir", default=None)
    ap.add_argument("--train-args", nargs=argparse.REMAINDER, default=[], help="more `train` flags (last)")
    args = ap.parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="ordered_intervals_"))
    work.mkdir(parents=True, exist_ok=True)
    preds = {c: run_corpus(c, args, work) for c in args.corpora}
    tables = {c: validation_table(p["validation"], args.gammas) for c, p in preds.items()}
    g_val, crit = choose_gamma(tables)
    gamma = args.gamma if args.gamma is not None else g_val
    print(json.dumps({"validation": {c: {str(g): {str(q): v for q, v in t[g].items()} for g in t} for c, t in tables.items()},
                      "criterion": crit, "gamma_chosen_on_validation": g_val, "default_gamma": DEFAULT_GAMMA}, indent=1))
    kv = {"gamma_val": g_val, "gamma_test": gamma}
    for corpus, p in preds.items():
        r = test_scores(p, gamma)
        kv[f"{corpus}_n_test"] = r["n_test"]
        for q in LEVELS:
            n = round(100 * q)
            for kind in ("split", "aci", "constwidth"):
                kv[f"{corpus}_{kind}_cov{n}"] = round(r[f"{kind}_{q}"]["cov"], 3)
            for kind in ("split", "aci"):
                kv[f"{corpus}_{kind}_winkler{n}_vs_constwidth"] = round(r[f"{kind}_{q}"]["winkler"]
                                                                       / r[f"constwidth_{q}"]["winkler"], 3)
    print("RESULT " + " ".join(f"{k}={v}" for k, v in kv.items()))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main_()
