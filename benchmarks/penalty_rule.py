"""How the value head's ridge penalty is chosen (docs/values.md, "Choosing the penalty"), decided on
validation rows only.

    python benchmarks/penalty_rule.py                       # every corpus below, 300 steps each
    python benchmarks/penalty_rule.py --corpora engel nile --steps 100

For each corpus: `train()` with its defaults (the CLI's recipe, embedded tiny base) for `--steps`,
then the trained adapter's loc_U at the <NUM> targets of the training and validation rows and one
ridge path over `value_head.linear.RIDGE_GRID`. Each rule chooses a penalty with one half of the validation
rows (the training rows' exact LOO residuals too, where the rule uses them) and is scored on the other
half (interleaved halves and first / second halves, each both ways; the four MAEs averaged):

* ``validation``: the validation MAE alone (the earlier rule);
* ``loo``: the mean |LOO residual| alone;
* ``both``: their mean (`value_head.linear.penalty_score`, the rule now).

Corpora: the bundled ones (sunspots, nile, co2, macro, diabetes, heteroscedastic) and three
statsmodels data sets the package does not ship as corpora, written as prompt / completion rows here:
engel (income -> food expenditure, shuffled split), grunfeld (firm value and capital -> investment,
shuffled) and elnino (monthly sea temperature from the 6 previous months, split by time).
The last line: ``RESULT both_vs_validation_geomean=... worst=...``.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
from pathlib import Path

import torch
from datasets import load_dataset

from causal_adapter.data.corpora import build_corpus
from causal_adapter.data.pipeline import NumericCollator, tokenize_dataset
from causal_adapter.numbers import NumberTokenizer, format_number
from causal_adapter.saving.assets import load_qwen_tokenizer
from causal_adapter.training.config import TrainConfig
from causal_adapter.training.loop import train
from causal_adapter.training.value_head.linear import RIDGE_GRID, ridge_path, standardized
from causal_adapter.training.value_head.warm_start import num_label_features

BUNDLED = ("sunspots", "nile", "co2", "macro", "diabetes", "heteroscedastic")
STATSMODELS = ("engel", "grunfeld", "elnino")


def statsmodels_rows(name: str) -> tuple[list[dict], bool]:
    """(prompt / completion rows, whether they are time-ordered) of a statsmodels data set."""
    import statsmodels.api as sm

    def fmt(v: float) -> str:
        return format_number(round(float(v), 2))
    d = getattr(sm.datasets, name).load_pandas().data
    if name == "engel":
        return [{"prompt": f"Household income {fmt(r.income)}; food expenditure:", "completion": f" {fmt(r.foodexp)}"}
                for r in d.itertuples()], False
    if name == "grunfeld":
        return [{"prompt": f"Firm value {fmt(r.value)}, capital {fmt(r.capital)}; gross investment:",
                 "completion": f" {fmt(r.invest)}"} for r in d.itertuples()], False
    months = ["JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC"]
    series = [(int(r.YEAR), m, float(getattr(r, m))) for r in d.itertuples() for m in months]
    rows = []
    for i in range(12, len(series)):
        history = "; ".join(f"{y} {m}: {fmt(v)}" for y, m, v in series[i - 6:i])
        y, m, v = series[i]
        rows.append({"prompt": f"Sea surface temperature (C). {history}; {y} {m}:", "completion": f" {fmt(v)}"})
    return rows, True


def write_splits(name: str, directory: Path) -> dict[str, str]:
    """{split: jsonl path}: 70 / 15 / 15 (shuffled with seed 0 unless time-ordered)."""
    rows, ordered = statsmodels_rows(name)
    if not ordered:
        random.Random(0).shuffle(rows)
    a, b = int(len(rows) * 0.7), int(len(rows) * 0.85)
    paths = {}
    for split, part in (("train", rows[:a]), ("validation", rows[a:b])):
        paths[split] = str(directory / f"{name}_{split}.jsonl")
        Path(paths[split]).write_text("".join(json.dumps(r) + "\n" for r in part))
    return paths


def features(model, dataset, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """(loc_U [n, C], standardised targets [n]) at the <NUM> targets of a raw or tokenised dataset."""
    ntok = NumberTokenizer(tokenizer, model.num_token_id)
    if "input_ids" not in dataset.column_names:
        dataset = tokenize_dataset(dataset, ntok, add_eos_token=True)
    collate = NumericCollator(tokenizer.pad_token_id or 0)
    rows = [dataset[i] for i in range(len(dataset))]
    X, t, _ = num_label_features(model, [collate(rows[i:i + 16]) for i in range(0, len(rows), 16)], "cpu")
    return X, (t - model.causal_config.value_loc) / model.causal_config.value_scale


def nested_scores(X, t, Xv, tv) -> dict[str, float]:
    """{rule: held-out MAE (standardised units)}, each rule choosing on half the validation rows."""
    mean, sd, Xs, unit = standardized(X)
    path = []
    for _, w, b, loo in ridge_path(Xs, t, torch.ones_like(t), [g * unit for g in RIDGE_GRID]):
        w_raw = w / sd
        path.append((loo.abs(), (Xv @ w_raw + b - mean @ w_raw - tv).abs()))
    n = len(tv)
    halves = [(torch.arange(0, n, 2), torch.arange(1, n, 2)), (torch.arange(n // 2, n), torch.arange(0, n // 2))]
    halves += [(b, a) for a, b in halves]
    scores = {"validation": [], "loo": [], "both": []}
    for choose, score in halves:
        rules = {"validation": lambda loo, val: float(val[choose].mean()),
                 "loo": lambda loo, val: float(loo.mean()),
                 "both": lambda loo, val: 0.5 * (float(loo.mean()) + float(val[choose].mean()))}
        for name, rule in rules.items():
            k = min(range(len(path)), key=lambda i: rule(*path[i]))
            scores[name].append(float(path[k][1][score].mean()))
    return {name: sum(v) / len(v) for name, v in scores.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpora", nargs="+", default=list(STATSMODELS + BUNDLED))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ratios, tokenizer = {}, load_qwen_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.corpora:
            files = write_splits(name, Path(tmp)) if name in STATSMODELS else {}
            config = TrainConfig(dataset=name if name not in STATSMODELS else "sunspots",
                                 train_file=[files["train"]] if files else [],
                                 validation_file=[files["validation"]] if files else [],
                                 max_steps=args.steps, output_dir=f"{tmp}/{name}", plot=False, progress=False)
            model = train(config=config).model.eval()
            splits = load_dataset("json", data_files=files) if files else build_corpus(name)
            X, t = features(model, splits["train"], tokenizer)
            Xv, tv = features(model, splits["validation"], tokenizer)
            s = nested_scores(X, t, Xv, tv)
            ratios[name] = {k: v / s["validation"] for k, v in s.items()}
            print(f"{name:16s} n_train {len(t):4d} n_val {len(tv):4d}  " +
                  "  ".join(f"{k} {v:.3f}" for k, v in ratios[name].items()), flush=True)
    both = [r["both"] for r in ratios.values()]
    print(f"RESULT both_vs_validation_geomean={math.exp(sum(map(math.log, both)) / len(both)):.3f} "
          f"worst={max(both):.3f}")


if __name__ == "__main__":
    main()
