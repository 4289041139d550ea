"""A process of `causal_adapter.training.loop.train` under DeepSpeed ZeRO-2 / ZeRO-3, started by
tests/test_deepspeed_train.py with `accelerate launch --config_file <CPU copy of
examples/accelerate_configs/deepspeed_zero{2,3}.yaml>` (2 gloo processes, DS_ACCELERATOR=cpu). Nothing in
accelerate's state is set by hand: DeepSpeed runs on CPUs as it is launched (train() asks for gloo).

The model, data and settings are tests/fsdp_train_worker.py's.

    --job first    OUT/full: train RUN_STEPS steps (checkpoints every 2); then OUT/killed: the same run,
                   SIGKILLed (both processes) after checkpoint 2, as a kill -9 of the job
    --job resume   resume OUT/killed from its latest checkpoint to the end
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp_train_worker import KILL_AT, config, datasets_, model  # noqa: E402


def skip_the_shared_memory_op() -> None:
    """DeepSpeed's CPU accelerator JIT-compiles its shared-memory all-reduce (deepspeed_shm_comm: two C++ files, 80 s
    of g++ each in a fresh install, 2 x 112 s of a CI run's 2 cores) when a process group opens. Only
    `inference_all_reduce` calls it, never ZeRO training, and a GPU's accelerator has no such op: marked not
    compatible (DeepSpeed's own table, which it keeps for edits), DeepSpeed skips the build."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def main() -> None:
    from accelerate import PartialState

    from causal_adapter.saving.process_groups import exit_without_teardown
    from causal_adapter.training.loop import train

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--job", choices=["first", "resume"], required=True)
    ap.add_argument("--batch", type=int, default=2)
    args = ap.parse_args()
    skip_the_shared_memory_op()
    train_ds, eval_ds = datasets_()
    if args.job == "first":
        train(model(), config(args.out / "full", args.batch), train_dataset=train_ds, eval_dataset=eval_ds)

        def kill(state, logs):
            if state.global_step == KILL_AT:  # checkpoint-2 is in place
                os.kill(os.getpid(), signal.SIGKILL)
        train(model(), config(args.out / "killed", args.batch), train_dataset=train_ds, eval_dataset=eval_ds,
              callbacks=[kill])
    else:
        train(model(), config(args.out / "killed", args.batch, resume_from_checkpoint="latest"),
              train_dataset=train_ds, eval_dataset=eval_ds)

    PartialState().destroy_process_group()  # as accelerate's end_training(); the gloo group itself lives to the end (saving/process_groups.py)
    exit_without_teardown()  # no teardown to race gloo's threads (saving/process_groups.py)


if __name__ == "__main__":
    sys.exit(main())
