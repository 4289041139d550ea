"""Does bf16 (or fp16) mixed precision keep the CLI recipe's test MAE of fp32? docs/mixed_precision.md.

    python benchmarks/mixed_precision.py                      # sunspots, 60 steps, CPU autocast
    python benchmarks/mixed_precision.py --corpora sunspots,co2,macro --steps 300 [--device cuda] [--variants fp16,bf16-base]

Per corpus, the CLI's default recipe (`common.bf16_against_fp32`) with ``--mixed-precision no`` then ``bf16`` in this
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
import tempfile
from pathlib import Path

from common import bf16_against_fp32, offline, test_mae, train_run


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
                run = train_run(mp, args.steps, Path(tmp) / variant, corpus, args.device, torch_dtype=dtype, **overrides)
                v_test = test_mae(run["adapter"], False, corpus, args.device, base_dtype=dtype)
                print(f"{corpus} {variant}: {run['seconds']:.0f} s, value fit {run['ridge']}, validation MAE "
                      f"{run['val_mae']:.4g}, test MAE {v_test:.4g} (base {dtype})", flush=True)
                print(f"RESULT corpus={corpus} variant={variant} device={args.device} test_ratio={v_test / test['no']:.4g} "
                      f"val_ratio={run['val_mae'] / val['no']:.4g}", flush=True)
        gpu = f" gpu_autocast_ratio={amp['bf16'] / amp['no']:.4g}" if amp else ""
        k = "" if args.recent_values is None else f" recent_values={args.recent_values}"
        print(f"RESULT corpus={corpus} steps={args.steps} device={args.device}{k} test_ratio={test['bf16'] / test['no']:.4g} "
              f"val_ratio={val['bf16'] / val['no']:.4g}{gpu}", flush=True)


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
