"""The CLI recipe under bf16 autocast against fp32, per corpus (goal: test MAE <= 1.15x; docs/mixed_precision.md).

    OMP_NUM_THREADS=1 python benchmarks/bf16_corpora.py --corpora sunspots,co2,macro,nile --steps 300

For each corpus, `train`'s defaults (`causal-adapter train --dataset C --max-steps N --cpu`) with
``--mixed-precision no`` then ``bf16`` in this process; the validation MAE of the run's final
evaluation and the test MAE as `causal-adapter eval ADAPTER --split test` computes it (a fresh
float32 base, no autocast). One ``RESULT corpus=... steps=... test_ratio=... val_ratio=...`` line per
corpus. ``--device cuda``: training on the GPU accelerate picks (CUDA autocast), the test MAE as `eval`
computes it (CPU, float32) and again on the GPU under bf16 autocast (``gpu_autocast_ratio``).
``--variants``: more runs against the same fp32 one: ``fp16`` (fp16 mixed precision: on a GPU accelerate's
GradScaler; on CPU accelerate runs plain fp32) and ``bf16-base`` (the base held in bf16, bf16 mixed precision,
scored on a bf16 base: the fit sees the features it runs on). One ``RESULT variant=...`` line each.
docs/mixed_precision.md ("The value under bf16 autocast", "On a GPU") has the figures. The fp32 / bf16 pair is
`common.bf16_against_fp32` (benchmarks/mixed_precision.py runs it on sunspots).
"""
import argparse
import os
import tempfile
from pathlib import Path

from common import bf16_against_fp32, test_mae, train_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpora", default="sunspots,nile,co2,macro,diabetes")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--variants", default="", help="comma-separated: fp16, bf16-base (beside no / bf16)")
    parser.add_argument("--recent-values", type=int, default=None,
                        help="TrainConfig.recent_values (default: train's; 0: the head reads loc_U alone)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
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
                print(f"{corpus} {args.steps} steps on {args.device}, {variant}: {run['seconds']:.0f} s, value fit "
                      f"{run['ridge']}, validation MAE {run['val_mae']:.4g}, test MAE {v_test:.4g} (base {dtype})",
                      flush=True)
                print(f"RESULT corpus={corpus} variant={variant} device={args.device} test_ratio={v_test / test['no']:.4g} "
                      f"val_ratio={run['val_mae'] / val['no']:.4g}", flush=True)
        gpu = f" gpu_autocast_ratio={amp['bf16'] / amp['no']:.4g}" if amp else ""
        k = "" if args.recent_values is None else f" recent_values={args.recent_values}"
        print(f"RESULT corpus={corpus} steps={args.steps} device={args.device}{k} test_ratio={test['bf16'] / test['no']:.4g} "
              f"val_ratio={val['bf16'] / val['no']:.4g}{gpu}", flush=True)


if __name__ == "__main__":
    main()
