"""The launchers (engines) `training.loop.train` runs under: making the `Accelerator`, the launch checks,
and, per engine, its setup and where it keeps its checkpointed weights (docs/distributed.md).

* one process / DDP: `accelerator.prepare(model, optimizer)`; the checkpoint holds the adapter files and
  ``optimizer.pt`` written by the main process (every process holds the same state: `checkpoints`).
* FSDP2 (``fsdp_version: 2``): `fsdp_engine` (sharded state through accelerate's ``save_state`` in
  ``ENGINE_SUBDIR``).
* refused at start, naming what runs: DeepSpeed and FSDP1.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path
from typing import Sequence

import torch

from ..modeling.heads import full_precision
from . import fsdp_engine
from .config import TrainConfig

ENGINE_SUBDIR = "accelerate_state"  # inside checkpoint-STEP: accelerate's save_state (FSDP only)

SUPPORTED_LAUNCHERS = ("one process (python -m causal_adapter train / causal-adapter train), DDP (accelerate launch "
                       "with examples/accelerate_configs/multi_gpu_ddp.yaml or cpu_ddp.yaml) or FSDP2 "
                       "(examples/accelerate_configs/fsdp2.yaml)")


# ---------------------------------------------------------------------------- the accelerator and the launch
class LaunchWarning(UserWarning):
    """The launch did not give the processes that were asked for."""



def launch_warnings(num_processes: int, expected: int | None = None, env: dict | None = None) -> list[str]:
    """Messages for a launch that did not give the processes that were asked for."""
    env = os.environ if env is None else env
    msgs = []
    cpu_recipe = ("for N CPU processes (DDP over gloo) use: ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu "
                  "--num_processes N --num_machines 1 --mixed_precision no --dynamo_backend no "
                  "-m causal_adapter train ...")
    if expected is not None and expected != num_processes:
        msgs.append(f"expected {expected} processes but this run has {num_processes}; {cpu_recipe}")
    if num_processes == 1:
        world = int(env.get("WORLD_SIZE", "1") or 1)
        if world > 1:
            msgs.append(f"WORLD_SIZE={world} but accelerate set up ONE process (no GPU and not in CPU mode?): "
                        f"pass --cpu or set ACCELERATE_USE_CPU=1; {cpu_recipe}")
        elif "MASTER_ADDR" in env and "ACCELERATE_USE_CPU" in env and "LOCAL_RANK" not in env:
            # accelerate's simple launcher sets MASTER_ADDR only for --num_processes > 1, and starts one process
            msgs.append("accelerate launch was asked for several processes but started ONE "
                        "(`accelerate launch --cpu --num_processes N` does not start DDP); " + cpu_recipe)
    return msgs


def make_accelerator(config: TrainConfig):
    """The run's `Accelerator`: CPU mode for a multi-process launch without a GPU, DDP's unused-parameter
    search as configured, the trackers that are installed."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedDataParallelKwargs

    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    cpu = config.cpu or (world > 1 and not torch.cuda.is_available())
    log_with = _available_trackers(config.report_to)
    kwargs = dict(cpu=cpu, mixed_precision=config.mixed_precision,
                  kwargs_handlers=[DistributedDataParallelKwargs(
                      find_unused_parameters=config.ddp_find_unused_parameters)])
    if log_with:
        kwargs.update(log_with=log_with, project_dir=config.output_dir)
    try:
        return Accelerator(**kwargs)
    except ValueError as e:
        # a previous run in this (single) process fixed another mixed precision: start afresh
        if "already been initialized" not in str(e) or world > 1:
            raise
        AcceleratorState._reset_state()
        return Accelerator(**kwargs)


_TRACKER_MODULES = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",), "mlflow": ("mlflow",),
                    "comet_ml": ("comet_ml",), "aim": ("aim",), "clearml": ("clearml",), "dvclive": ("dvclive",),
                    "swanlab": ("swanlab",), "trackio": ("trackio",)}


def _available_trackers(report_to: Sequence[str]) -> list[str] | str | None:
    import importlib.util

    names = [r for r in report_to if r and r != "none"]
    if not names:
        return None
    if "all" in names:
        return "all"
    ok = []
    for n in names:
        mods = _TRACKER_MODULES.get(n, (n,))
        if any(importlib.util.find_spec(m) is not None for m in mods):
            ok.append(n)
        else:
            warnings.warn(f"tracker {n!r} is not installed: skipped (pip install {mods[0]})")
    return ok or None


def is_fsdp(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP


def check_engine(accelerator) -> None:
    """Refuse the launchers this loop does not run, at start, naming the supported ones."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED:
        raise ValueError(f"causal_adapter.training.loop does not support DeepSpeed yet (issue 26); supported "
                         f"launchers: {SUPPORTED_LAUNCHERS}")
    if kind == DistributedType.FSDP and accelerator.state.fsdp_plugin.fsdp_version != 2:
        raise ValueError("causal_adapter.training.loop does not support FSDP1 (fsdp_version: 1): set fsdp_version: 2 "
                         f"in the accelerate config; supported launchers: {SUPPORTED_LAUNCHERS}")


# ---------------------------------------------------------------------------- per engine
def prepare(accelerator, model, optimizer):
    """(prepared model, prepared optimizer), as the engine needs them."""
    if is_fsdp(accelerator):
        return fsdp_engine.prepare(accelerator, model, optimizer)
    return accelerator.prepare(model, optimizer)


@contextlib.contextmanager
def inference_precision(model):
    """Run `model` (the unwrapped CausalModel) as the saved adapter runs at inference (`eval`, `predict`,
    `generate`): the base in its own dtype, with no autocast, also when accelerate's mixed precision
    wrapped its forward in one (`prepare` keeps the plain forward as ``_original_forward``, the one
    ``unwrap_model(keep_fp32_wrapper=False)`` restores; here only for the duration of the context).

    Why: the value head reads differences between loc_U rows far smaller than bf16's resolution of
    the backbone's activations (sunspots, random tiny base: across-row sd of the last attention
    output 8e-4, bf16 rounding error 4e-5; docs/mixed_precision.md). A head fitted and calibrated on
    bf16-autocast features is scored by `eval` on float32 features and loses 2.2x; fitted on the
    features inference computes, a bf16-autocast run matches fp32. On a 16-bit base the features are
    16-bit at inference too, and this changes nothing."""
    original = model.__dict__.get("_original_forward")
    patched = model.__dict__.get("forward")
    if original is not None:
        model.forward = original
    try:
        with full_precision(model.device):
            yield model
    finally:
        if original is not None:
            model.forward = patched


def whole_adapter_tensors(accelerator, model) -> dict[str, torch.Tensor] | None:
    """Under a sharding engine: the adapter's tensors gathered whole (a collective: call on every process);
    else None (the module's own tensors are whole)."""
    return fsdp_engine.whole_adapter_tensors(model) if is_fsdp(accelerator) else None


def pad_forwards(accelerator, model, batch: dict, count: int) -> None:
    """Under an engine whose forward is a collective: `count` discarded forwards of `batch`, so a process
    with fewer evaluation batches does not leave the others waiting. Else nothing."""
    if is_fsdp(accelerator) and count > 0:
        fsdp_engine.pad_forwards(model, batch, count)


def save_engine_state(accelerator, tmp_dir: Path) -> Path | None:
    """Under a sharding engine: its sharded weights + optimizer state written into `tmp_dir` by every
    process (a collective); the main process moves it into the checkpoint as ``ENGINE_SUBDIR``. Else None."""
    return fsdp_engine.save_state(accelerator, tmp_dir) if is_fsdp(accelerator) else None


def load_engine_state(accelerator, checkpoint: Path) -> bool:
    """Under a sharding engine: the weights and the optimizer state from the checkpoint's ``ENGINE_SUBDIR``
    (every process). Returns whether it loaded them (False: the engine keeps no state of its own)."""
    if not is_fsdp(accelerator):
        return False
    fsdp_engine.load_state(accelerator, checkpoint / ENGINE_SUBDIR)
    return True
