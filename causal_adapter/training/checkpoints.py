"""Checkpoints of a training run and the RNG state they hold.

``OUTPUT_DIR/checkpoint-STEP``: adapter-only (the adapter's two files, loadable with
`CausalModel.from_pretrained`), plus ``optimizer.pt`` (under FSDP or DeepSpeed instead: ``accelerate_state/``,
accelerate's save_state of the sharded weights and optimizer, `engines` / `fsdp_engine` / `deepspeed_engine`), ``scheduler.pt``, ``rng_state_RANK.json``
(python, numpy, torch, cuda) and ``trainer_state.json`` (step, epoch, position in the epoch).
Without FSDP never the base weights. Under FSDP ``accelerate_state/`` holds every process's shard of the
whole model, the frozen base included (accelerate's save_state has no frozen-parameter filter): size
checkpoints with ``save_total_limit``.
Written atomically (`artifacts.atomic_write_dir`); the last ``save_total_limit`` are kept.
Resuming restores all of it and skips the batches of the current epoch already consumed (without
loading them): a run interrupted at step k and resumed ends with the same adapter as an
uninterrupted one (bit-identical on CPU).
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..saving.artifacts import atomic_write_dir, read_adapter_files, write_adapter_files
from .config import TrainConfig
from .engines import ENGINE_SUBDIR

CHECKPOINT_PREFIX = "checkpoint-"
TRAINER_STATE = "trainer_state.json"


@dataclass
class TrainState:
    """Position of a run: optimizer steps done, epoch, micro-batches of this epoch consumed."""

    global_step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0
    total_steps: int = 0
    batches_per_epoch: int = 0

    @property
    def epoch_float(self) -> float:
        return self.epoch + self.batches_in_epoch / max(1, self.batches_per_epoch)



def rng_state() -> dict:
    """JSON-safe states of the python, numpy, torch and cuda generators."""
    import numpy as np

    py = random.getstate()
    npk, npstate, nppos, nphg, npg = np.random.get_state()
    state = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [npk, npstate.tolist(), int(nppos), int(nphg), float(npg)],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    import numpy as np

    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    k, st, pos, hg, g = state["numpy"]
    np.random.set_state((k, np.array(st, dtype=np.uint32), pos, hg, g))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """``checkpoint-STEP`` directories of `output_dir`, oldest first."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = []
    for p in out.iterdir():
        m = re.fullmatch(re.escape(CHECKPOINT_PREFIX) + r"(\d+)", p.name)
        if m and p.is_dir() and (p / TRAINER_STATE).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def resolve_resume(config: TrainConfig) -> Path | None:
    """The checkpoint ``resume_from_checkpoint`` names (``'latest'``: the newest in ``output_dir``, or None)."""
    r = config.resume_from_checkpoint
    if r is None:
        return None
    if r == "latest":
        ckpts = list_checkpoints(config.output_dir)
        return ckpts[-1] if ckpts else None
    path = Path(r)
    if not (path / TRAINER_STATE).is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a training checkpoint (no {TRAINER_STATE})")
    return path


def check_same_resume(resumed: Path | None, accelerator) -> None:
    """Refuse, on every process, a resume where the processes did not find the same checkpoint: each resolves
    ``resume_from_checkpoint`` in its own ``output_dir``, and a directory not shared between nodes (or a
    checkpoint copied to some nodes only) used to start some ranks at step k and others at 0, which then
    waited in their collectives forever (docs/multinode.md). The checkpoints' names are gathered (one
    collective) and compared."""
    if accelerator.num_processes == 1:
        return
    from accelerate.utils import gather_object

    seen = gather_object([resumed.name if resumed is not None else None])
    if len(set(seen)) > 1:
        where = ", ".join(f"rank {r}: {name or 'no checkpoint'}" for r, name in enumerate(seen))
        raise RuntimeError(f"the processes would resume from different checkpoints ({where}): every node must see "
                           "the same output_dir (a shared filesystem), or copy the checkpoint to every node first")


def remove_old_checkpoints(out_dir: Path, keep: int) -> None:
    """Keep the newest `keep` checkpoints of `out_dir`. Each older one is renamed first (atomic), then
    deleted: a kill mid-delete leaves no half checkpoint behind (its ``.deleting-*`` goes next time)."""
    for stale in out_dir.glob(".deleting-*"):  # left by a process killed mid-delete
        shutil.rmtree(stale, ignore_errors=True)
    for old in list_checkpoints(out_dir)[:-keep]:
        trash = old.with_name(f".deleting-{old.name}")
        old.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)


def write_checkpoint(path: Path, inner, optimizer, scheduler, state: TrainState, config: TrainConfig,
                     rngs: list[dict], world: int, n_train: int, history: list[dict], *,
                     tensors: dict | None = None, engine_dir: Path | None = None) -> None:
    """Write the checkpoint `path` atomically: the adapter's two files, optimizer / scheduler states,
    one RNG state per process (`rngs`) and the trainer state (position, settings, log history).
    Under FSDP (`engines`): `tensors` are the adapter's tensors gathered whole and `engine_dir` is
    accelerate's save_state of the sharded weights and optimizer, moved into the checkpoint as
    ``ENGINE_SUBDIR`` in place of ``optimizer.pt``."""
    meta, tensors = inner.adapter_metadata(), tensors if tensors is not None else inner.adapter_state_dict()
    opt_state = optimizer.state_dict() if engine_dir is None else None
    sched_state = scheduler.state_dict()
    trainer_state = {
        "global_step": state.global_step, "epoch": state.epoch, "batches_in_epoch": state.batches_in_epoch,
        "total_steps": state.total_steps, "batches_per_epoch": state.batches_per_epoch, "num_processes": world,
        "per_device_train_batch_size": config.per_device_train_batch_size,
        "gradient_accumulation_steps": config.gradient_accumulation_steps, "seed": config.seed,
        "train_examples": n_train, "train_config": config.to_dict(), "log_history": history,
    }

    def write(tmp: Path) -> None:
        write_adapter_files(tmp, meta, tensors)
        if engine_dir is None:
            torch.save(opt_state, tmp / "optimizer.pt")
        else:
            os.rename(engine_dir, tmp / ENGINE_SUBDIR)
        torch.save(sched_state, tmp / "scheduler.pt")
        for r, s in enumerate(rngs):
            (tmp / f"rng_state_{r}.json").write_text(json.dumps(s))
        (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=1) + "\n")

    atomic_write_dir(path, write)


def load_checkpoint(path: Path, inner, optimizer, scheduler, state: TrainState, config: TrainConfig,
                    world: int, rank: int, n_train: int, *, weights_loaded: bool = False) -> list[dict]:
    """Restore a checkpoint into the adapter, optimizer, scheduler, `state` and this process's RNGs
    (a warning when the run's settings differ); returns the log history it holds. `weights_loaded`:
    the adapter's weights and the optimizer already came from the engine's state (FSDP: accelerate's
    load_state of the sharded ones, `engines.load_engine_state`); the adapter files give the value units."""
    ts = json.loads((path / TRAINER_STATE).read_text())
    meta, tensors = read_adapter_files(path)
    if meta.get("num_token_id") != inner.num_token_id or meta.get("vocab_size") != inner.vocab_size:
        raise ValueError(f"checkpoint {str(path)!r} was made for num_token_id={meta.get('num_token_id')}, "
                         f"vocab_size={meta.get('vocab_size')}; this model has num_token_id={inner.num_token_id}, "
                         f"vocab_size={inner.vocab_size}")
    if not weights_loaded:
        inner.load_adapter_state_dict(tensors)
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True))
    saved = meta.get("adapter_config", {})
    if saved.get("value_loc") is not None:
        inner.set_value_units(saved["value_loc"], saved["value_scale"], saved.get("value_decimals"))
        inner.set_value_transform(saved.get("value_transform", "identity"), saved.get("value_log_units"),
                                  bool(saved.get("value_positive", False)), saved.get("value_range"))
        inner.causal_config.value_series = saved.get("value_series")
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", map_location="cpu", weights_only=True))
    mismatch = {k: (ts.get(k), v) for k, v in (
        ("num_processes", world), ("per_device_train_batch_size", config.per_device_train_batch_size),
        ("gradient_accumulation_steps", config.gradient_accumulation_steps), ("seed", config.seed),
        ("train_examples", n_train), ("total_steps", state.total_steps)) if ts.get(k) != v}
    if mismatch:
        warnings.warn(f"resuming from {str(path)!r} with different settings {mismatch} (checkpoint, now): "
                      "the run will not be identical to an uninterrupted one", stacklevel=3)
    state.global_step, state.epoch, state.batches_in_epoch = ts["global_step"], ts["epoch"], ts["batches_in_epoch"]
    if state.batches_in_epoch >= state.batches_per_epoch:
        state.epoch, state.batches_in_epoch = state.epoch + 1, 0
    rng_file = path / f"rng_state_{rank}.json"
    if rng_file.is_file():
        set_rng_state(json.loads(rng_file.read_text()))
    else:
        warnings.warn(f"{rng_file} missing: random streams (dropout) restart from the seed", stacklevel=3)
    return list(ts.get("log_history", []))
