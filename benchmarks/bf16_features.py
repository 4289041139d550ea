"""Where bf16 autocast loses the value (docs/mixed_precision.md), on the features of the value fit, no training.

    OMP_NUM_THREADS=1 python benchmarks/bf16_features.py sunspots [--qk-scale 1,10] [--direction-norm 0.1,2]

The CLI's base and adapter at init (`train`'s defaults), loc_U at the positions that predict a <NUM>
target, computed in fp32 and under CPU bf16 autocast; `fit_linear_head` (least squares, penalty on
validation, no bf16 bound) on each. Rows: fit and score on fp32 / bf16; the cross scores (a head fitted
on one, scored on the other); the controls: fp32 features plus Gaussian noise with the bf16 error's
per-feature sd, and fp32 features restricted to the principal directions whose variance exceeds the
bf16 error's. ``--qk-scale`` multiplies the q, k projections (sharper attention than a random base's),
``--direction-norm`` sets |d| of the numeric embedding. docs/mixed_precision.md has the figures.
"""
import argparse
import math
import os

import torch

from causal_adapter import get_causal_model
from causal_adapter.data.corpora import build_corpus
from causal_adapter.saving.assets import load_base
from causal_adapter.training.config import TrainConfig
from causal_adapter.training.value_head.linear import fit_linear_head
from causal_adapter.training.value_head.warm_start import fit_value_units

from common import num_features

SPLITS = ("train", "validation", "test")


def features(corpus: str, qk_scale: float, direction_norm: float | None):
    """({precision: {split: centred loc_U [n, C]}}, {split: standardised targets [n]}, value_scale)."""
    config = TrainConfig(dataset=corpus)
    base, tok = load_base(None, config.tiny_arch, "float32", config.tiny_hidden_size, config.tiny_layers)
    with torch.no_grad():
        for layer in base.model.layers:
            layer.self_attn.q_proj.weight.mul_(qk_scale)
            layer.self_attn.k_proj.weight.mul_(qk_scale)
    acfg = config.adapter_config()
    acfg.direction_norm = direction_norm
    dd = build_corpus(corpus)
    acfg.value_loc, acfg.value_scale = fit_value_units([float(v) for v in dd["train"]["target"]])
    model = get_causal_model(base, acfg, tokenizer=tok)
    X, t = {}, {}
    for precision in ("fp32", "bf16"):
        X[precision] = {}
        for split in SPLITS:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                X[precision][split], y, _ = num_features(model, dd[split], tok, 16, config.add_eos_token)
            t[split] = (y - acfg.value_loc) / acfg.value_scale
    mu = X["fp32"]["train"].mean(0)
    return {p: {s: x - mu for s, x in X[p].items()} for p in X}, t, acfg.value_scale


def fit_and_score(X_fit: dict, t: dict, scale: float, X_score: dict | None = None) -> tuple[float, float]:
    """(validation MAE, test MAE) in value units of a head fitted on X_fit, scored on X_score (default X_fit)."""
    f = fit_linear_head(X_fit["train"], t["train"], X_fit["validation"], t["validation"], loss="squared",
                        max_shift=math.inf)
    X_score = X_score or X_fit
    return tuple(float((X_score[s] @ f.w + f.b - t[s]).abs().mean()) * scale for s in ("validation", "test"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("corpus", nargs="?", default="sunspots")
    parser.add_argument("--qk-scale", default="1")
    parser.add_argument("--direction-norm", default="", help="comma-separated |d| values (default: the model's)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    norms = [float(v) for v in args.direction_norm.split(",") if v] or [None]
    for qk in (float(v) for v in args.qk_scale.split(",")):
        for norm in norms:
            X, t, scale = features(args.corpus, qk, norm)
            err = torch.cat([X["bf16"][s] - X["fp32"][s] for s in SPLITS])
            g = torch.Generator().manual_seed(0)
            noisy = {s: x + torch.randn(x.shape, generator=g, dtype=x.dtype) * err.std(0) for s, x in X["fp32"].items()}
            train = X["fp32"]["train"]
            _, S, Vh = torch.linalg.svd(train - train.mean(0), full_matrices=False)
            above = Vh[S ** 2 / (train.shape[0] - 1) > ((err - err.mean(0)) @ Vh.T).var(0)]  # variance per direction
            rows = {"fp32": fit_and_score(X["fp32"], t, scale), "bf16": fit_and_score(X["bf16"], t, scale),
                    "fit fp32, score bf16": fit_and_score(X["fp32"], t, scale, X["bf16"]),
                    "fit bf16, score fp32": fit_and_score(X["bf16"], t, scale, X["fp32"]),
                    "fp32 + gauss(bf16 error sd)": fit_and_score(noisy, t, scale),
                    f"fp32, {above.shape[0]} dirs above the bf16 error": fit_and_score(
                        {s: x @ above.T for s, x in X["fp32"].items()}, t, scale)}
            for name, (val, test) in rows.items():
                print(f"{args.corpus} qk x{qk:g} |d| {norm or 'default'}: {name:38s} validation MAE {val:.2f} "
                      f"test MAE {test:.2f}", flush=True)


if __name__ == "__main__":
    main()
