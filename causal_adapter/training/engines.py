"""The launchers (engines) `training.loop.train` runs under: making the `Accelerator`, the launch checks,
and, per engine, its setup and where it keeps its checkpointed weights (docs/distributed.md).

* one process / DDP: `accelerator.prepare(model, optimizer)`; the checkpoint holds the adapter files and
  ``optimizer.pt`` written by the main process (every process holds the same state: `checkpoints`).
* FSDP1 (``fsdp_version: 1``, ``fsdp_use_orig_params: true``) and FSDP2 (``fsdp_version: 2``): `fsdp_engine`
  (sharded state through accelerate's ``save_state`` in ``ENGINE_SUBDIR``).
* DeepSpeed ZeRO-2 / ZeRO-3: `deepspeed_engine` (DeepSpeed's own sharded checkpoint through ``save_state`` in
  ``ENGINE_SUBDIR``; the heads and W_cls gathered under ZeRO-3).
* refused at start, naming what runs: FSDP1 without ``use_orig_params``, DeepSpeed ZeRO-0/1.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path
from typing import Sequence

import torch

from ..modeling.heads import full_precision
from ..saving.unwrap import unwrap_causal_model
from . import deepspeed_engine, fsdp_engine
from .config import TrainConfig

ENGINE_SUBDIR = "accelerate_state"  # inside checkpoint-STEP: accelerate's save_state (FSDP only)

SUPPORTED_LAUNCHERS = ("one process (python -m causal_adapter train / causal-adapter train), DDP (accelerate launch "
                       "with examples/accelerate_configs/multi_gpu_ddp.yaml or cpu_ddp.yaml), FSDP2 "
                       "(examples/accelerate_configs/fsdp2.yaml), FSDP1 (examples/accelerate_configs/fsdp.yaml) or "
                       "DeepSpeed ZeRO-2 / ZeRO-3 (examples/accelerate_configs/deepspeed_zero2.yaml, deepspeed_zero3.yaml)")


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


def deepspeed_launch(env: dict | None = None) -> bool:
    """Whether ``accelerate launch`` was given a DeepSpeed config (the variable it sets for one)."""
    env = os.environ if env is None else env
    return env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def process_group_backend(config: TrainConfig, world: int) -> str | None:
    """The torch.distributed backend to ask accelerate for: ``config.ddp_backend`` when set; else gloo for a
    multi-process DeepSpeed launch without a GPU (accelerate picks no backend there and records ONE
    process: docs/distributed.md); else None (accelerate's choice)."""
    if config.ddp_backend:
        return config.ddp_backend
    if world > 1 and deepspeed_launch() and not torch.cuda.is_available():
        return "gloo"
    return None


def make_accelerator(config: TrainConfig):
    """The run's `Accelerator`: CPU mode for a multi-process launch without a GPU (DeepSpeed: its own CPU
    accelerator, ``DS_ACCELERATOR=cpu``), the process-group backend (`process_group_backend`), DDP's
    unused-parameter search as configured, the trackers that are installed."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    cpu = config.cpu or (world > 1 and not torch.cuda.is_available() and not deepspeed_launch())
    log_with = _available_trackers(config.report_to)
    handlers = [DistributedDataParallelKwargs(find_unused_parameters=config.ddp_find_unused_parameters)]
    backend = process_group_backend(config, world)
    if backend:
        handlers.append(InitProcessGroupKwargs(backend=backend))
    kwargs = dict(cpu=cpu, mixed_precision=config.mixed_precision, kwargs_handlers=handlers)
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


def is_deepspeed(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.DEEPSPEED


def check_engine(accelerator) -> None:
    """Refuse the launchers this loop does not run, at start, naming the supported ones."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED and deepspeed_engine.zero_stage(accelerator) not in (2, 3):
        raise ValueError(f"causal_adapter.training.loop runs DeepSpeed ZeRO-2 and ZeRO-3 only (zero_stage: 2 or 3 "
                         f"in the accelerate config; got {deepspeed_engine.zero_stage(accelerator)}); supported "
                         f"launchers: {SUPPORTED_LAUNCHERS}")
    plugin = accelerator.state.fsdp_plugin if kind == DistributedType.FSDP else None
    if plugin is not None and plugin.fsdp_version == 1 and not plugin.use_orig_params:
        # the optimizer, the clipping and the LoRA gathering work on the original parameters
        raise ValueError("causal_adapter.training.loop runs FSDP1 with fsdp_use_orig_params: true only: set it in "
                         f"the accelerate config (or use fsdp_version: 2); supported launchers: {SUPPORTED_LAUNCHERS}")


# ---------------------------------------------------------------------------- per engine
def prepare(accelerator, model, optimizer, config: TrainConfig):
    """(prepared model, prepared optimizer), as the engine needs them."""
    if is_fsdp(accelerator):
        return fsdp_engine.prepare(accelerator, model, optimizer)
    if is_deepspeed(accelerator):
        return deepspeed_engine.prepare(accelerator, model, optimizer, config)
    return accelerator.prepare(model, optimizer)


@contextlib.contextmanager
def inference_precision(model):
    """Run `model` (the CausalModel, or the module whose forward runs it) as the saved adapter runs at inference (`eval`, `predict`,
    `generate`): the base in its own dtype, with no autocast, also when accelerate's mixed precision
    wrapped its forward in one (`prepare` keeps the plain forward as ``_original_forward``, the one
    ``unwrap_model(keep_fp32_wrapper=False)`` restores; here only for the duration of the context).

    Why: the value head reads differences between loc_U rows far smaller than bf16's resolution of
    the backbone's activations (sunspots, random tiny base: across-row sd of the last attention
    output 8e-4, bf16 rounding error 4e-5; docs/mixed_precision.md). A head fitted and calibrated on
    bf16-autocast features is scored by `eval` on float32 features and loses 2.2x; fitted on the
    features inference computes, a bf16-autocast run matches fp32. On a 16-bit base the features are
    16-bit at inference too, and this changes nothing."""
    inner = unwrap_causal_model(model) or model  # FSDP1: `model` is the root unit that wraps it
    original = inner.__dict__.get("_original_forward")
    patched = inner.__dict__.get("forward")
    if original is not None:
        inner.forward = original
    try:
        with full_precision(inner.device):
            yield model
    finally:
        if original is not None:
            inner.forward = patched


def no_sync(accelerator, model, sync: bool):
    """The context of a micro-batch's forward and backward: DDP / FSDP skip the gradient reduction before
    the step's last micro-batch (`sync`); DeepSpeed is told in `backward`."""
    if sync or is_deepspeed(accelerator):
        return contextlib.nullcontext()
    return accelerator.no_sync(model)


def backward(accelerator, model, loss: torch.Tensor, sync: bool) -> None:
    """One micro-batch's backward (`loss` already divided by the step's micro-batches); `sync`: the last
    micro-batch of the step (DDP / FSDP reduce the gradients then; DeepSpeed also steps then)."""
    if is_deepspeed(accelerator):
        deepspeed_engine.backward(model, loss, sync)
    else:
        accelerator.backward(loss)


def whole_heads(accelerator, inner, modify: bool = False):
    """A context in which the heads' parameters, W_cls and LoRA are whole (ZeRO-3 gathers them; a
    collective: every process enters it); `modify`: what is written into them inside is kept."""
    if is_deepspeed(accelerator):
        return deepspeed_engine.whole_heads(accelerator, inner, modify)
    return contextlib.nullcontext()
def eval_model(accelerator, model):
    """What evaluations and value-head fits call: the module without DDP's wrapper (no collective in its
    forward, so processes may run different numbers of batches), with accelerate's autocast forward. Under
    FSDP1 the root unit itself: only its forward gathers the root's parameters (embeddings, lm_head)."""
    return model if fsdp_engine.is_fsdp1(accelerator) else accelerator.unwrap_model(model)


def clip_grad_norm_(accelerator, model, trainable: list, max_norm: float):
    """Clip the gradients to a total norm of `max_norm`, counted once over the processes. Under FSDP1 the
    root's own `clip_grad_norm_` (accelerate calls it when given every parameter of the root): it sums
    the shards' norms over the processes and adds the replicated heads' once."""
    return accelerator.clip_grad_norm_(list(model.parameters()) if fsdp_engine.is_fsdp1(accelerator) else trainable,
                                       max_norm)


def whole_adapter_tensors(accelerator, model) -> dict[str, torch.Tensor] | None:
    """Under a sharding engine: the adapter's tensors gathered whole (a collective: call on every process);
    else None (the module's own tensors are whole)."""
    if is_fsdp(accelerator):
        return fsdp_engine.whole_adapter_tensors(model)
    if is_deepspeed(accelerator):
        return deepspeed_engine.whole_adapter_tensors(accelerator, accelerator.unwrap_model(model))
    return None


def pad_forwards(accelerator, model, batch: dict, count: int) -> None:
    """Under an engine whose forward is a collective (FSDP, ZeRO-3): `count` discarded forwards of `batch`,
    so a process with fewer evaluation batches does not leave the others waiting. Else nothing."""
    collective = is_fsdp(accelerator) or (is_deepspeed(accelerator) and deepspeed_engine.zero_stage(accelerator) == 3)
    if collective and count > 0:
        fsdp_engine.pad_forwards(model, batch, count)


def save_engine_state(accelerator, tmp_dir: Path) -> Path | None:
    """Under a sharding engine: its sharded weights + optimizer state written into `tmp_dir` by every
    process (a collective); the main process moves it into the checkpoint as ``ENGINE_SUBDIR``. Else None."""
    if is_fsdp(accelerator):
        return fsdp_engine.save_state(accelerator, tmp_dir)
    if is_deepspeed(accelerator):
        return deepspeed_engine.save_state(accelerator, tmp_dir)
    return None


def load_engine_state(accelerator, checkpoint: Path, optimizer) -> bool:
    """Under a sharding engine: the weights and the optimizer state from the checkpoint's ``ENGINE_SUBDIR``
    (every process). Returns whether it loaded them (False: the engine keeps no state of its own)."""
    if is_fsdp(accelerator):
        fsdp_engine.load_state(accelerator, checkpoint / ENGINE_SUBDIR, optimizer)
    elif is_deepspeed(accelerator):
        deepspeed_engine.load_state(accelerator, checkpoint / ENGINE_SUBDIR)
    else:
        return False
    return True
