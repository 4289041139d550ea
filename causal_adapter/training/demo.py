"""The main job (`causal-adapter demo`); adapter evaluation (`causal-adapter eval`) is `evaluate.py`.

demo, on the embedded default (tiny Qwen2 with the real vocabulary + the real Qwen tokenizer,
fixed seed, nothing downloaded) or on `--base DIR`:
  1. wrap the base, evaluate the fresh adapter on the sunspots test split (before);
  2. fine-tune the adapter on the train split (`train.train`, progress bar, metrics log, plot);
  3. evaluate again (after) against the constant and persistence baselines;
  4. reload the saved adapter into a fresh base and check the predictions are identical;
  5. generate a continuation of a test prompt with the predicted number and its intervals;
  6. print the final table and write it to OUTPUT_DIR/demo_metrics.{md,json}.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from ..config import METRIC_LABELS
from ..data.corpora import build_corpus
from ..data.pipeline import tokenize_dataset
from ..numbers import NumberTokenizer
from ..saving.assets import load_base
from ..model import CausalModel, get_causal_model
from .config import TrainConfig
from .loop import train
from .metrics import evaluate_dataset
from .metrics import format_value as _fmt

# Metrics shown side by side before / after training.
_ROWS = tuple((key, METRIC_LABELS[key]) for key in (
    "loss", "accuracy", "num_recall", "num_f1", "value_mae", "value_median_ae", "coverage_50", "coverage_90"))


def comparison_table(before: dict, after: dict, split: str = "test") -> str:
    lines = [f"| sunspots {split} split | before training | after training |", "| --- | --- | --- |"]
    lines += [f"| {label} | {_fmt(before.get(k))} | {_fmt(after.get(k))} |" for k, label in _ROWS]
    lines.append(f"| constant baseline MAE (train median) | {_fmt(after.get('baseline_constant_mae'))} | |")
    lines.append(f"| persistence baseline MAE (previous value) | {_fmt(after.get('baseline_persistence_mae'))} | |")
    return "\n".join(lines)


def interval_summary(model, predictions: dict, levels=(0.5, 0.9)) -> dict:
    """Coverage and width range of the intervals the adapter reports (`value_interval`: calibrated when it
    has a calibration map, else raw Cauchy) on `predictions` (y_true / loc / scale lists)."""
    import torch

    y, loc, scale = (torch.tensor(predictions[k], dtype=torch.float64) for k in ("y_true", "loc", "scale"))
    out: dict = {"calibrated": model.causal_config.value_calibration is not None, "n": int(y.numel())}
    for q in levels:
        n = round(100 * q)
        lo, hi = model.value_interval(loc, scale, q)
        width = hi - lo
        out[f"coverage_{n}"] = float(((y >= lo) & (y <= hi)).double().mean()) if y.numel() else None
        out[f"width_{n}"] = [float(width.min()), float(width.median()), float(width.max())] if y.numel() else None
    return out


def format_interval_summary(s: dict) -> str:
    kind = "calibrated (split-conformal on validation)" if s["calibrated"] else "raw Cauchy (no calibration map)"
    parts = [f"{n}%: coverage {s[f'coverage_{n}']:.2f}, width {s[f'width_{n}'][0]:.3g} to {s[f'width_{n}'][2]:.3g} "
             f"(median {s[f'width_{n}'][1]:.3g})" for n in (50, 90) if s.get(f"coverage_{n}") is not None]
    return f"      intervals on the test split, {kind}, n={s['n']}: " + "; ".join(parts)


def describe_base(base_model, base: str | None) -> str:
    """One line saying what the base is (the embedded default has random weights)."""
    c = getattr(base_model.config, "get_text_config", lambda: base_model.config)()
    size = (f"{type(base_model).__name__}, hidden {c.hidden_size}, {c.num_hidden_layers} layers, "
            f"{base_model.get_output_embeddings().weight.shape[0]:,} vocabulary rows")
    if base is None:
        return (f"base: the embedded tiny model with RANDOM weights ({size}); no real Qwen weights, so what the adapter "
                "knows of the values is what the numeric embedding puts in and the random layers mix")
    return f"base: {base} ({size})"


#: what the demo sets beyond `TrainConfig`'s defaults: nothing. The token-side settings it used to set (gamma0
#: 0.1, threshold 1, W_loc trained, EOS after every completion; docs/predict.md, chosen on the validation split,
#: docs/design-notes/predict.md) are `train`'s defaults (docs/predict.md, "The number layout"): one recipe
DEMO_RECIPE: dict = {}


def demo_train_config(output_dir: str, steps: int = 200, *, base: str | None = None, arch: str = "qwen2",
                      seed: int = 42, batch_size: int = 16, learning_rate: float = 1e-2, lora: bool = False, **kw):
    """The demo's training recipe (docs/design-notes/predict.md measured it); `kw`: other
    TrainConfig fields (they override `DEMO_RECIPE`)."""
    return TrainConfig(base_model=base, tiny_arch=arch, output_dir=output_dir, max_steps=steps,
                       per_device_train_batch_size=batch_size, learning_rate=learning_rate, lora=lora, seed=seed,
                       eval_steps=steps // 5 if steps >= 50 else 0, warmup_ratio=0.05, lr_scheduler_type="cosine",
                       **{**DEMO_RECIPE, **kw})


def run_demo(output_dir: str = "causal_adapter_demo", steps: int = 200, base: str | None = None,
             arch: str = "qwen2", seed: int = 42, batch_size: int = 16, learning_rate: float = 1e-2,
             lora: bool = False, dtype: str = "float32", tiny_hidden_size: int = 64, tiny_layers: int = 2) -> int:
    t0 = time.time()
    out = Path(output_dir)
    base_model, tokenizer = load_base(base, arch, dtype, tiny_hidden_size, tiny_layers)
    out.mkdir(parents=True, exist_ok=True)  # after the base loaded: a failed load leaves no empty folder
    ntok = NumberTokenizer(tokenizer)
    corpus = build_corpus("sunspots")
    test = tokenize_dataset(corpus["test"], ntok)
    train_targets = list(corpus["train"]["target"])
    config = demo_train_config(str(out / "train"), steps, base=base, arch=arch, seed=seed, batch_size=batch_size,
                               learning_rate=learning_rate, lora=lora)
    model = get_causal_model(base_model, config.adapter_config(), tokenizer=tokenizer)
    print(describe_base(base_model, base))
    print("baselines: constant = the median of the train years' values; persistence = the previous year's value")
    model.print_trainable_parameters()

    print("[1/5] evaluating the fresh adapter (= the base model) on the test split")
    before = evaluate_dataset(model, test, ntok.pad_token_id, batch_size=batch_size, train_targets=train_targets)
    print(f"[2/5] training {steps} steps on the sunspots train split")
    result = train(model, config, tokenizer=tokenizer)
    print("[3/5] evaluating the trained adapter on the test split")
    after, preds = evaluate_dataset(result.model, test, ntok.pad_token_id, batch_size=batch_size,
                                    train_targets=train_targets, return_predictions=True)

    intervals = interval_summary(result.model, preds)
    print(format_interval_summary(intervals))

    print(f"[4/5] reloading {result.adapter_dir} into a fresh base model")
    fresh_base, _ = load_base(base, arch, dtype, tiny_hidden_size, tiny_layers)
    reloaded = CausalModel.from_pretrained(fresh_base, result.adapter_dir, tokenizer=tokenizer)
    _, preds_reloaded = evaluate_dataset(reloaded, test, ntok.pad_token_id, batch_size=batch_size,
                                         train_targets=train_targets, return_predictions=True)
    identical = json.dumps(preds_reloaded) == json.dumps(preds)  # NaN-safe (a missing recent number), exact floats
    print("      predictions of the reloaded adapter identical:", identical)

    print("[5/5] generating the next value of a test prompt")
    row = corpus["test"][0]
    # the prompt as the data writes it ("...; 1979:"); the completion is " " then the number
    # (docs/predict.md: the demo's token side learns that order; the regression reads the value at the space)
    prompt = row["prompt"]
    gen = reloaded.generate(prompt, tokenizer=tokenizer, max_new_tokens=4, mode="deterministic")
    print(f"      prompt ...{prompt[-60:]!r}  (true next value {row['completion'].strip()})")
    print(f"      generated {gen.texts[0]!r}")
    for n in gen.numbers[0]:
        print(f"      <NUM> {n['text']} (exact {n['exact']:.6g}): 50% interval [{n['interval_50'][0]:.4g}, "
              f"{n['interval_50'][1]:.4g}], 90% interval [{n['interval_90'][0]:.4g}, {n['interval_90'][1]:.4g}]")

    table = comparison_table(before, after)
    print()
    print(table)
    (out / "demo_metrics.md").write_text(table + "\n")
    summary = {"before": before, "after": after, "reload_identical": identical, "steps": steps,
               "adapter_dir": str(result.adapter_dir), "plot": str(result.plot_path) if result.plot_path else None,
               "intervals": intervals, "generated": gen.texts[0], "seconds": round(time.time() - t0, 1)}
    (out / "demo_metrics.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(f"\nadapter: {result.adapter_dir}\nplot: {result.plot_path}\nmetrics: {out / 'demo_metrics.md'}"
          f"\ntime: {time.time() - t0:.0f} s")
    return 0 if identical else 1
