"""accelerate's `save_state` / `load_state` writing and reading a prepared CausalModel as its adapter
only (`register_accelerate_hooks`)."""
from __future__ import annotations

from pathlib import Path

from .adapter_io import load_adapter_into, save_adapter_into
from .artifacts import CONFIG_NAME
from .unwrap import unwrap_causal_model

ACCELERATE_SUBDIR = "causal_adapter"  # inside an accelerate save_state directory (model index 0)


def _accelerate_subdir(index: int) -> str:
    return ACCELERATE_SUBDIR if index == 0 else f"{ACCELERATE_SUBDIR}_{index}"


def register_accelerate_hooks(accelerator) -> tuple:
    """Make `accelerator.save_state` / `load_state` write and read every prepared CausalModel as its
    adapter only (``<state dir>/causal_adapter`` for the first prepared model, ``causal_adapter_<i>``
    for the i-th), through accelerate's `register_save_state_pre_hook` / `register_load_state_pre_hook`.
    Other prepared models, optimizers, schedulers, RNG states are saved by accelerate as usual.
    Loading is strict: a state directory without the adapter, or an adapter of another shape, raises.
    Returns the two `RemovableHandle`s."""
    from accelerate.utils import DistributedType

    def causal_positions(models) -> list[int]:
        return [i for i, m in enumerate(models) if unwrap_causal_model(m) is not None]

    def index_of(model) -> int:
        return next(i for i, m in enumerate(accelerator._models) if m is model)

    def save_hook(models, weights, output_dir):
        positions = causal_positions(models)
        if positions and accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
            raise NotImplementedError(
                f"adapter-only save_state under {accelerator.distributed_type} is not supported by these hooks "
                "(accelerate saves the sharded model before any hook runs): save the adapter with "
                "causal_adapter.saving.fsdp.save_fsdp_adapter / CausalModel.save_pretrained instead")
        for i in reversed(positions):
            if accelerator.is_main_process:
                inner = unwrap_causal_model(models[i])
                save_adapter_into(inner, Path(output_dir) / _accelerate_subdir(i))
            del weights[i]  # weights[i] is models[i]'s state dict: accelerate must not write it

    def load_hook(models, input_dir):
        for j in reversed(causal_positions(models)):
            path = Path(input_dir) / _accelerate_subdir(index_of(models[j]))
            if not (path / CONFIG_NAME).is_file():
                raise FileNotFoundError(f"{str(path)!r} has no causal adapter ({CONFIG_NAME}): {str(input_dir)!r} "
                                        "was not saved with causal_adapter's accelerate hooks")
            load_adapter_into(unwrap_causal_model(models[j]), path)
            del models[j]

    return accelerator.register_save_state_pre_hook(save_hook), accelerator.register_load_state_pre_hook(load_hook)
