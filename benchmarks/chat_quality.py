"""Conversations end to end (docs/chat.md): `causal-adapter train` on a ``messages`` file, then `causal-adapter predict`
on the test conversations, against least squares on the prompt's numbers.

    python benchmarks/chat_quality.py                           # the bundled chat corpus, 200 steps
    python benchmarks/chat_quality.py --series sunspots --steps 300
    python benchmarks/chat_quality.py --quick                   # toy size (a smoke run)

Every choice is made on the VALIDATION split, every figure is reported on the TEST split:

* ``causal``: the CLI as a user runs it (`train` with its defaults on chat_train.jsonl / chat_validation.jsonl,
  `predict` on chat_test.jsonl): the value where the last assistant reply's first number stands, its
  calibrated 50% / 90% intervals.
* ``least_squares``: ordinary least squares with intercept on the K numbers just before that position in the
  conversation (the prompt's numbers: the window's years and values, the earlier replies), K chosen on
  validation among 1, 2, 4, 8, 16, 32 (rows with fewer numbers repeat their first).
* ``persistence``: the value of the step before (the corpus's ``previous``); ``constant``: the train median.

Prints one table and a RESULT line: the causal MAE as a ratio of least squares' (below 1 = better), and the
coverages.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CLI = [sys.executable, "-m", "causal_adapter"]
K_CHOICES = (1, 2, 4, 8, 16, 32)


def write_corpus(out: Path, series: list[str] | None) -> dict[str, Path]:
    from causal_adapter.data.corpora import chat_corpus

    dd = chat_corpus(**({"series": series} if series else {}))
    paths = {}
    for split, ds in dd.items():
        paths[split] = out / f"chat_{split}.jsonl"
        ds.to_json(str(paths[split]), lines=True)
    return paths


def prompt_numbers(messages: list[dict]) -> list[float]:
    """The numbers before the last reply's first number, in order (user, system and earlier assistant turns,
    then the reply's text before its first number)."""
    from causal_adapter.numbers import find_numbers

    out = []
    for m in messages[:-1]:
        out += [n.value for n in find_numbers(m["content"])]
    reply = messages[-1]["content"]
    first = find_numbers(reply)
    lead = reply[:first[0].start] if first else reply
    return out + [n.value for n in find_numbers(lead)]


def features(rows: list[dict], k: int) -> np.ndarray:
    X = np.zeros((len(rows), k + 1))
    for i, r in enumerate(rows):
        nums = prompt_numbers(r["messages"]) or [0.0]
        last = nums[-k:]
        last = [last[0]] * (k - len(last)) + last
        X[i, :k], X[i, k] = last, 1.0
    return X


def least_squares(train: list[dict], val: list[dict], test: list[dict]) -> tuple[int, np.ndarray]:
    """(K chosen on validation, test predictions)."""
    y_tr, y_va = np.array([r["target"] for r in train]), np.array([r["target"] for r in val])
    best = None
    for k in K_CHOICES:
        coef = np.linalg.lstsq(features(train, k), y_tr, rcond=None)[0]
        mae = float(np.mean(np.abs(features(val, k) @ coef - y_va)))
        if best is None or mae < best[0]:
            best = (mae, k, coef)
    _, k, coef = best
    return k, features(test, k) @ coef


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[2:5])}... failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--series", nargs="*", default=None, help="chat corpus series (default: all)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="toy size: 4 steps on sunspots")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--adapter", type=Path, default=None,
                    help="an adapter `train` already made on OUT's files (OUT/chat_*.jsonl): skip training")
    args = ap.parse_args()
    if args.quick:
        args.series, args.steps = args.series or ["sunspots"], 4
    out = args.out or Path(tempfile.mkdtemp(prefix="chat_quality_"))
    out.mkdir(parents=True, exist_ok=True)
    if args.adapter is None:
        paths = write_corpus(out, args.series)
        t_train = run(CLI + ["train", "--train-file", str(paths["train"]), "--validation-file",
                             str(paths["validation"]), "--output-dir", str(out / "run"), "--max-steps", str(args.steps),
                             "--no-progress", "--no-plot", "--overwrite"])
    else:
        paths, t_train = {s: out / f"chat_{s}.jsonl" for s in ("train", "validation", "test")}, float("nan")
    adapter = args.adapter or out / "run" / "adapter"
    t_pred = run(CLI + ["predict", str(adapter), "--data-file", str(paths["test"]),
                        "--output", str(out / "pred.jsonl")])
    train, val, test = (read_jsonl(paths[s]) for s in ("train", "validation", "test"))
    pred = {r["row"]: r for r in read_jsonl(out / "pred.jsonl")}
    y = np.array([r["target"] for r in test])
    causal = np.array([pred[i]["value"] for i in range(len(test))])
    k, ls = least_squares(train, val, test)
    persistence = np.array([r["previous"] for r in test])
    constant = np.full_like(y, statistics.median(r["target"] for r in train))
    cover = {q: float(np.mean([(pred[i][f"lower_{q}"] <= t <= pred[i][f"upper_{q}"]) for i, t in enumerate(y)]))
             for q in ("50", "90")}
    mae = {name: float(np.mean(np.abs(p - y))) for name, p in
           (("causal", causal), ("least_squares", ls), ("persistence", persistence), ("constant", constant))}
    print(f"chat corpus ({', '.join(args.series) if args.series else 'all series'}): train {len(train)}, "
          f"validation {len(val)}, test {len(test)} conversations; {args.steps} steps ({t_train:.0f} s), "
          f"predict {t_pred:.0f} s")
    print("| method | test MAE | 50% coverage | 90% coverage |\n| --- | --- | --- | --- |")
    print(f"| causal (CLI train + predict) | {mae['causal']:.4g} | {cover['50']:.3f} | {cover['90']:.3f} |")
    print(f"| least squares on the prompt's last {k} numbers (K chosen on validation) | {mae['least_squares']:.4g} | | |")
    print(f"| persistence | {mae['persistence']:.4g} | | |\n| constant (train median) | {mae['constant']:.4g} | | |")
    per_series = {}
    for s in sorted({r["series"] for r in test}):
        idx = [i for i, r in enumerate(test) if r["series"] == s]
        per_series[s] = (float(np.mean(np.abs(causal[idx] - y[idx]))), float(np.mean(np.abs(ls[idx] - y[idx]))))
    if len(per_series) > 1:
        print("per series (causal / least squares MAE): " + ", ".join(f"{s} {a:.4g} / {b:.4g}"
                                                                         for s, (a, b) in per_series.items()))
    print(f"RESULT chat_quality causal_mae/least_squares_mae={mae['causal'] / mae['least_squares']:.3f} "
          f"coverage50={cover['50']:.3f} coverage90={cover['90']:.3f} (test, {len(test)} conversations)")


if __name__ == "__main__":
    main()
