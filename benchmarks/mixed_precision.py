"""Does bf16 (or fp16) mixed precision keep the CLI recipe's test MAE of fp32? docs/mixed_precision.md.

    python benchmarks/mixed_precision.py                      # sunspots, 60 steps, CPU autocast
    python benchmarks/mixed_precision.py --corpora sunspots,co2,macro --steps 300 [--device cuda]
    python benchmarks/mixed_precision.py --corpora sunspots --device cuda --variants fp16,bf16-base

Per corpus, the CLI's default recipe (`bf16_against_fp32`) with ``--mixed-precision no`` then ``bf16`` in this
process; validation MAE and test MAE as `causal-adapter eval` computes it (a fresh float32 model, no autocast).
``--device cuda`` trains on the GPU (CUDA autocast) and scores the test split again there under bf16 autocast
(``gpu_autocast_ratio``); ``--variants fp16,bf16-base``: more runs against the same fp32 one (fp16: accelerate's
GradScaler on a GPU; a base held in bf16, scored on a bf16 base). One ``RESULT corpus=... test_ratio=...
val_ratio=...`` line per corpus (and per variant). The gradients and loc_Y under autocast are checked by
tests/test_mixed_precision.py; the earlier default run (gradients, GEMM precision, sunspots) was measured here up to
commit 1c2f799 (docs/design-notes/benchmarks.md).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import re
import tempfile
import time
from pathlib import Path

import torch

from common import offline


def train_run(mixed_precision: str, steps: int, out_dir: Path, corpus: str = "sunspots", device: str = "cpu",
              **overrides) -> dict:
    """The CLI's default recipe for `steps` steps; the value-head summary it prints; the adapter dir.
    device "cpu" forces CPU (CPU autocast); "cuda": accelerate's own device choice (a GPU's autocast).
    overrides: other TrainConfig fields (e.g. recent_values=0)."""
    from causal_adapter.training.config import TrainConfig
    from causal_adapter.training.loop import train

    config = TrainConfig(dataset=corpus, max_steps=steps, mixed_precision=mixed_precision, output_dir=str(out_dir),
                         cpu=device == "cpu", plot=False, progress=False, eval_steps=0, **overrides)
    err = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stderr(err):
        result = train(config=config)
    seconds = time.perf_counter() - t0
    summary = dict(re.findall(r"(\w+)=([^,\s]+)", next((line for line in err.getvalue().splitlines()
                                                         if line.startswith("value head:")), "")))
    return {"adapter": result.adapter_dir, "seconds": seconds, "val_mae": (result.eval_metrics or {}).get("value_mae"),
            "ridge": {k: summary.get(k) for k in ("ridge_lambda", "w_norm", "loo_mae", "inputs")}}


def test_mae(adapter_dir: Path, autocast: bool, corpus: str = "sunspots", device: str = "cpu",
             base_dtype: str = "float32") -> float:
    """Test-split value MAE of a saved adapter, as `causal-adapter eval` computes it (fresh float32
    model), optionally under bf16 autocast; on `device` ("cpu" as `eval` runs, or "cuda"); `base_dtype`:
    the base's weights (as `eval --dtype`)."""
    from causal_adapter.saving.assets import load_base
    from causal_adapter.data.corpora import build_corpus
    from causal_adapter.data.pipeline import tokenize_dataset
    from causal_adapter.training.metrics import evaluate_dataset
    from causal_adapter.model import CausalModel
    from causal_adapter.numbers import NumberTokenizer

    base, tokenizer = load_base(None, "qwen2", base_dtype, 64, 2)
    model = CausalModel.from_pretrained(base, adapter_dir, tokenizer=tokenizer).to(device)
    ntok = NumberTokenizer(tokenizer, model.num_token_id)
    ds = tokenize_dataset(build_corpus(corpus)["test"], ntok)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=autocast):
        return float(evaluate_dataset(model, ds, ntok.pad_token_id, batch_size=16)["value_mae"])


def bf16_against_fp32(corpus: str, steps: int, work: Path, device: str = "cpu", device_eval: bool = False,
                      **overrides) -> dict[str, dict]:
    """The CLI recipe on `corpus` for `steps` steps with mixed_precision "no", then "bf16" (accelerate's autocast
    on `device`): per run ("no", "bf16") `train_run`'s dict plus ``test_mae`` (as `causal-adapter eval` computes
    it: CPU, float32, no autocast) and, with `device_eval`, ``device_test_mae`` (on `device`, the bf16 run under
    bf16 autocast, the fp32 run without). One line per run on stdout."""
    runs = {}
    for mp in ("no", "bf16"):
        run = runs[mp] = train_run(mp, steps, work / mp, corpus, device, **overrides)
        run["test_mae"] = test_mae(run["adapter"], False, corpus)
        if device_eval:
            run["device_test_mae"] = test_mae(run["adapter"], mp == "bf16", corpus, device)
        print(f"{corpus} {steps} steps on {device}, mixed_precision={mp}: {run['seconds']:.0f} s, value fit "
              f"{run['ridge']}, validation MAE {run['val_mae']:.4g}, test MAE {run['test_mae']:.4g}"
              + (f" (on {device}{' under bf16 autocast' if mp == 'bf16' else ''}: {run['device_test_mae']:.4g})"
                 if device_eval else ""), flush=True)
    return runs


def corpora_main(args) -> None:
    """The recipe per corpus, fp32 against bf16 (and --variants), one RESULT line each."""
    overrides = {} if args.recent_values is None else {"recent_values": args.recent_values}
    for corpus in args.corpora.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            runs = bf16_against_fp32(corpus, args.steps, Path(tmp), args.device, args.device != "cpu", **overrides)
            val = {mp: r["val_mae"] for mp, r in runs.items()}
            test = {mp: r["test_mae"] for mp, r in runs.items()}
            amp = {mp: r["device_test_mae"] for mp, r in runs.items() if "device_test_mae" in r}
            for variant in filter(None, args.variants.split(",")):
                mp, dtype = {"fp16": ("fp16", "float32"), "bf16-base": ("bf16", "bfloat16")}[variant]
                run = train_run(mp, args.steps, Path(tmp) / variant, corpus, args.device, torch_dtype=dtype,
                                **overrides)
                v_test = test_mae(run["adapter"], False, corpus, args.device, base_dtype=dtype)
                print(f"{corpus} {variant}: {run['seconds']:.0f} s, value fit {run['ridge']}, validation MAE "
                      f"{run['val_mae']:.4g}, test MAE {v_test:.4g} (base {dtype})", flush=True)
                print(f"RESULT corpus={corpus} variant={variant} device={args.device} "
                      f"test_ratio={v_test / test['no']:.4g} val_ratio={run['val_mae'] / val['no']:.4g}", flush=True)
        gpu = f" gpu_autocast_ratio={amp['bf16'] / amp['no']:.4g}" if amp else ""
        k = "" if args.recent_values is None else f" recent_values={args.recent_values}"
        print(f"RESULT corpus={corpus} steps={args.steps} device={args.device}{k} "
              f"test_ratio={test['bf16'] / test['no']:.4g} val_ratio={val['bf16'] / val['no']:.4g}{gpu}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpora", default="sunspots", help="comma-separated corpora")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per training run")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--variants", default="", help="comma-separated: fp16, bf16-base")
    parser.add_argument("--recent-values", type=int, default=None,
                        help="TrainConfig.recent_values (default: train's; 0: the head reads loc_U alone)")
    args = parser.parse_args()
    offline()
    corpora_main(args)


if __name__ == "__main__":
    main()
