"""A CausalModel under FSDP (accelerate's FSDP1 / FSDP2, torch's `fully_shard`): the heads kept out of
FSDP and their gradients averaged, the values kept in their dtype, the adapter gathered whole and
saved adapter-only."""
from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Any, Iterator

from torch import nn

from .artifacts import atomic_write_dir, write_adapter_files
from .peft_lora import LORA_PREFIX
from .unwrap import unwrap_causal_model

# The heads stay outside FSDP (replicated on every process, in their own dtype): their parameters are
# used outside their own forward (W_cls-based scores, the fused loss), which FSDP1 units cannot serve,
# and a bf16 base next to fp32 heads in one FSDP1 unit is refused ("Must flatten tensors with uniform
# dtype"). W_cls stays in the root unit, which is unsharded for the whole forward and backward.
# accelerate reads this regex from `fsdp_ignored_modules` (examples/accelerate_configs/fsdp*.yaml).
FSDP_IGNORED_MODULES = "numeric_embedding|abduction|action"


def fsdp_ignored_modules(model) -> list[nn.Module]:
    """The CausalModel's heads, to pass as FSDP1 `ignored_modules` (FSDP2: their parameters as
    `ignored_params`); accelerate selects the same modules from `FSDP_IGNORED_MODULES`."""
    inner = unwrap_causal_model(model)
    return [inner.numeric_embedding, inner.abduction, inner.action]


def average_replicated_grads(model) -> int:
    """After an FSDP wrap that leaves the heads replicated (ignored), average their gradients over the
    processes after each backward (a post-accumulate-grad hook per trainable head parameter), so that
    a plain optimizer step keeps the replicas equal; FSDP reduces the sharded parameters itself.
    Idempotent; call on every process after `accelerator.prepare`. Returns the number of hooked tensors."""
    import torch.distributed as dist

    world = dist.get_world_size()

    def average(p):
        dist.all_reduce(p.grad)
        p.grad.div_(world)

    hooked = 0
    for module in fsdp_ignored_modules(model):
        for p in module.parameters():
            if p.requires_grad and not getattr(p, "_causal_adapter_grad_averaged", False):
                p.register_post_accumulate_grad_hook(average)
                p._causal_adapter_grad_averaged = True
                hooked += 1
    return hooked


def keep_input_dtypes(model) -> None:
    """Stop FSDP's mixed precision from casting the root forward's floating inputs (numeric_values,
    label_values) to the compute dtype: values in bf16 keep 3 significant digits (1234.5 -> 1232).
    The layers still compute in FSDP's param_dtype. FSDP1 root (`cast_root_forward_inputs`) or
    FSDP2 root (`cast_forward_inputs`); anything else is left as it is."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if isinstance(model, FSDP):
        model.mixed_precision = dataclasses.replace(model.mixed_precision, cast_root_forward_inputs=False)
    elif isinstance(model, FSDPModule):
        state = model._get_fsdp_state()
        state._mp_policy = dataclasses.replace(state._mp_policy, cast_forward_inputs=False)


def finish_fsdp_wrap(model) -> None:
    """What a CausalModel needs after `accelerator.prepare` under FSDP (FSDP1 or FSDP2, the heads ignored
    as `FSDP_IGNORED_MODULES` says): head gradients averaged over the processes
    (`average_replicated_grads`) and the values kept in their dtype (`keep_input_dtypes`). Refuses a
    wrap whose heads FSDP manages (a missing `fsdp_ignored_modules`)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor import DTensor

    heads = [p for m in fsdp_ignored_modules(model) for p in m.parameters()]
    ignored = getattr(model, "_ignored_params", set()) if isinstance(model, FSDP) else None  # FSDP1 root
    if any(isinstance(p, DTensor) or (ignored is not None and p not in ignored) for p in heads):
        raise ValueError(f"FSDP manages the adapter heads: set fsdp_ignored_modules: \"{FSDP_IGNORED_MODULES}\" in "
                         "the accelerate config (see examples/accelerate_configs/fsdp.yaml)")
    average_replicated_grads(model)
    keep_input_dtypes(model)


def fully_shard_causal_model(model, **fsdp_kwargs):
    """Shard a CausalModel with torch's FSDP2 `fully_shard` (works on CPU with gloo), as accelerate's
    `fsdp_version: 2` with `fsdp_ignored_modules` does: each decoder layer is its own unit, the root
    unit holds the embeddings / lm_head (W_cls); the heads stay replicated (ignored), their gradients
    averaged over the processes (`average_replicated_grads`). Call on every process after
    `torch.distributed.init_process_group`; returns the model."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.decoder.layers:
        fully_shard(layer, **fsdp_kwargs)
    heads = {p for m in fsdp_ignored_modules(model) for p in m.parameters()}
    fully_shard(model, ignored_params=heads, **fsdp_kwargs)
    finish_fsdp_wrap(model)
    return model


@contextlib.contextmanager
def _whole_parameters(model) -> Iterator[Any]:
    """Inside: the CausalModel in `model` with FSDP1's flat parameters summoned whole (a collective;
    W_cls has its [V, H] shape again). FSDP2 and unwrapped models are yielded as they are."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    fsdp1 = next((m for m in (model, getattr(model, "module", None)) if isinstance(m, FSDP)), None)
    ctx = FSDP.summon_full_params(fsdp1, writeback=False) if fsdp1 is not None else contextlib.nullcontext()
    with ctx:
        yield unwrap_causal_model(model)


def full_adapter_state_dict(model) -> dict:
    """`adapter_state_dict()` of a (possibly FSDP1- or FSDP2-wrapped) CausalModel with every tensor
    whole: FSDP2 DTensors gathered, FSDP1 flat parameters summoned (a collective: call it on every
    process). Tensors are copies."""
    from torch.distributed.tensor import DTensor

    with _whole_parameters(model) as inner:
        state = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                 for k, v in inner.adapter_state_dict().items()}
    if inner.causal_config.lora is not None and not any(k.startswith(LORA_PREFIX) for k in state):
        # peft's get_peft_model_state_dict finds no LoRA layer through FSDP1's wrapped units (measured)
        raise NotImplementedError("saving LoRA from an FSDP1-wrapped model is not supported (peft finds no LoRA "
                                  "tensor through FSDP1's units): use FSDP2 (fsdp2.yaml) or DDP for LoRA")
    return state


def save_fsdp_adapter(model, directory: str | os.PathLike) -> Path:
    """Adapter-only checkpoint of an FSDP-wrapped CausalModel (FSDP1 or FSDP2, accelerate's or torch's):
    the adapter tensors are gathered on every process (collective), the main process writes our two
    files atomically."""
    import torch.distributed as dist


    tensors = full_adapter_state_dict(model)
    with _whole_parameters(model) as inner:  # FSDP1: W_cls (hence vocab_size) is a flat shard outside
        meta = inner.adapter_metadata()
    if dist.get_rank() == 0:
        atomic_write_dir(directory, lambda tmp: write_adapter_files(tmp, meta, tensors))
    dist.barrier()
    return Path(directory)
