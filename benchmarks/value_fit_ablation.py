"""Validation figures behind the value head's fit defaults (docs/values.md): the loss of the fit
(least squares, Huber, Cauchy IRLS) and the bf16 bound (`max_shift`), on the frozen random tiny
base's features at the <NUM> targets (the benchmark's ridge probe features, loc_U centred), with a
fraction of the training targets shuffled (the anchor experiment).

    python benchmarks/value_fit_ablation.py sunspots 0.4        # corpus, shuffled fraction
    MS=0.005,0.01,1e9 python benchmarks/value_fit_ablation.py sunspots
"""
import os
import sys

from causal_adapter import CausalAdapterConfig, get_causal_model
from causal_adapter.training.value_head.linear import LOSSES, fit_linear_head
from causal_adapter.training.value_head.warm_start import fit_value_units
from causal_adapter.data.corpora import build_corpus
from causal_adapter.saving.assets import build_tiny_qwen, load_qwen_tokenizer

from common import num_features, shuffle_labels

SEED = 42  # numeric_quality.py's defaults: --seed 42, the tiny base qwen2 64 hidden x 2 layers, --base-seed 0


def features(corpus: str, noise: float):
    """(value units, {split: centred loc_U [n, C]}, {split: standardised targets [n]}) of the benchmark's base."""
    tok = load_qwen_tokenizer()
    dd = build_corpus(corpus)
    splits = {k: dd[k] for k in ("train", "validation", "test")}
    if noise:
        splits["train"] = shuffle_labels(splits["train"], noise, SEED)
    loc, scale = fit_value_units([float(v) for v in splits["train"]["target"]])
    model = get_causal_model(build_tiny_qwen("qwen2", hidden_size=64, num_layers=2, seed=0),
                             CausalAdapterConfig(seed=SEED, value_loc=loc, value_scale=scale),
                             tokenizer=tok)
    F = {k: num_features(model, splits[k], tok) for k in splits}
    mu = F["train"][0].mean(0)
    sd = F["train"][0].std(0)
    print(f"loc_U at the training <NUM> targets: mean |loc_U| {float(F['train'][0].abs().mean()):.3g}, "
          f"per-feature sd {float(sd.min()):.3g} .. {float(sd.max()):.3g}")
    return scale, {k: v[0] - mu for k, v in F.items()}, {k: (v[1] - loc) / scale for k, v in F.items()}


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    corpus, noise = sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    scale, X, t = features(corpus, noise)
    print(f"{corpus}, {noise:g} of the training targets shuffled; value_scale {scale:.4g}")
    for loss in LOSSES:
        for ms in [float(x) for x in os.environ.get("MS", "0.005,0.01,0.05,1e9").split(",")]:
            f = fit_linear_head(X["train"], t["train"], X["validation"], t["validation"], loss=loss, max_shift=ms)
            mae = {k: float((X[k] @ f.w + f.b - t[k]).abs().mean()) * scale for k in ("validation", "test")}
            print(f"{loss:8s} max_shift {ms:g}: lam {f.lam:.3g} w_norm {float(f.w.norm()):.4g} "
                  f"bf16 shift {f.shift:.4f} validation MAE {mae['validation']:.4g} test MAE {mae['test']:.4g}")


if __name__ == "__main__":
    main()
