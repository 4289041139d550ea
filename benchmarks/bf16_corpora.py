"""The CLI recipe under bf16 autocast against fp32, per corpus (issue 27 item 2: test MAE <= 1.15x).

    OMP_NUM_THREADS=1 python benchmarks/bf16_corpora.py --corpora sunspots,co2,macro,nile --steps 300

For each corpus, `train`'s defaults (`causal-adapter train --dataset C --max-steps N --cpu`) with
``--mixed-precision no`` then ``bf16`` in this process; the validation MAE of the run's final
evaluation and the test MAE as `causal-adapter eval ADAPTER --split test` computes it (a fresh
float32 base, no autocast). One ``RESULT corpus=... steps=... test_ratio=... val_ratio=...`` line per
corpus. docs/mixed_precision.md ("The value under bf16 autocast") has the figures.
"""
import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mixed_precision import test_mae, train_run  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpora", default="sunspots,nile,co2,macro,diabetes")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for corpus in args.corpora.split(","):
        val, test = {}, {}
        with tempfile.TemporaryDirectory() as tmp:
            for mp in ("no", "bf16"):
                run = train_run(mp, args.steps, Path(tmp) / mp, corpus)
                val[mp], test[mp] = run["val_mae"], test_mae(run["adapter"], False, corpus)
                print(f"{corpus} {args.steps} steps, mixed_precision={mp}: {run['seconds']:.0f} s, value fit "
                      f"{run['ridge']}, validation MAE {val[mp]:.4g}, test MAE {test[mp]:.4g}", flush=True)
        print(f"RESULT corpus={corpus} steps={args.steps} test_ratio={test['bf16'] / test['no']:.4g} "
              f"val_ratio={val['bf16'] / val['no']:.4g}", flush=True)


if __name__ == "__main__":
    main()
