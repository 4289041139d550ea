"""A CausalModel under FSDP (accelerate's FSDP1 / FSDP2, torch's `fully_shard`): the heads kept out of
FSDP and their gradients averaged, the values kept in their dtype, the adapter gathered whole and
saved adapter-only."""
from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Iterator

from torch import Tensor, nn

from .artifacts import atomic_write_dir, write_adapter_files
from .peft_lora import LORA_PREFIX
from .process_groups import keep_gloo_groups_to_process_end
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
    wrap whose heads FSDP manages (a missing `fsdp_ignored_modules`). On CPUs the process's gloo groups are kept to
    its end (`process_groups.keep_gloo_groups_to_process_end`): no teardown during the interpreter's exit."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor import DTensor

    heads = [p for m in fsdp_ignored_modules(model) for p in m.parameters()]
    ignored = getattr(model, "_ignored_params", set()) if isinstance(model, FSDP) else None  # FSDP1 root
    if any(isinstance(p, DTensor) or (ignored is not None and p not in ignored) for p in heads):
        raise ValueError(f"FSDP manages the adapter heads: set fsdp_ignored_modules: \"{FSDP_IGNORED_MODULES}\" in "
                         "the accelerate config (see examples/accelerate_configs/fsdp.yaml)")
    average_replicated_grads(model)
    keep_input_dtypes(model)
    keep_gloo_groups_to_process_end()  # FSDP2 holds the gloo group past destroy_process_group (distributed.md)


def set_lora_wrap_policy(accelerator, model) -> None:
    """Before `accelerator.prepare` under FSDP1 with LoRA: peft's wrap policy on accelerate's plugin
    (`peft.utils.other.fsdp_auto_wrap_policy`, as transformers' Trainer sets it for a PeftModel). Each LoRA
    matrix gets a unit of its own, so an fp32 LoRA on a bf16 base never shares a flat parameter with the
    base ("Must flatten tensors with uniform dtype"); the decoder layers stay units (the classes in
    FSDP_TRANSFORMER_CLS_TO_WRAP, which `accelerate launch` sets from fsdp_transformer_layer_cls_to_wrap,
    else the backbone's _no_split_modules). Nothing to do without LoRA or under FSDP2."""
    from accelerate.utils import DistributedType

    plugin = accelerator.state.fsdp_plugin if accelerator.distributed_type == DistributedType.FSDP else None
    inner = unwrap_causal_model(model)
    if plugin is None or plugin.fsdp_version != 1 or inner.causal_config.lora is None:
        return
    from peft.utils.other import fsdp_auto_wrap_policy

    plugin.auto_wrap_policy = fsdp_auto_wrap_policy(inner.backbone)


def init_fsdp1_optimizer_state(optimizer) -> None:
    """Before accelerate's `load_fsdp_optimizer` under FSDP1 (`load_state`, Trainer's resume): give a fresh
    optimizer its state tensors. accelerate loads FSDP1's sharded optimizer state into
    `FSDP.optim_state_dict` of the optimizer as it is: fresh, that is empty, and nothing is loaded (measured:
    Adam restarted from zero moments, and the resumed run left the uninterrupted one at its next step).
    torch's own initialisation for this: one step at lr 0 on zero gradients, what `get_optimizer_state_dict`
    does for FSDP2. `optimizer`: a torch optimizer or accelerate's wrapper of one."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(getattr(optimizer, "optimizer", optimizer))


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


def _fsdp1_root(model):
    """The FSDP1 root unit in `model` (accelerate's prepared model or its `.module`), or None."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return next((m for m in (model, getattr(model, "module", None)) if isinstance(m, FSDP)), None)


@contextlib.contextmanager
def whole_root_parameters(model) -> Iterator[None]:
    """Inside: the own parameters of an FSDP1 root unit (embeddings, lm_head = W_cls) whole, read-only (a
    collective: every process enters it as often). FSDP1 turns them back into shards after each forward,
    and the heads read W_cls outside the forward (the metrics' token scores, the value head's centring).
    Anything else (FSDP2 keeps its root whole after the forward, DDP, one process): nothing is done."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    root = _fsdp1_root(model)
    if root is None:
        yield
        return
    with FSDP.summon_full_params(root, recurse=False, writeback=False):
        yield


def _fsdp1_lora_state(model) -> dict[str, Tensor] | None:
    """The backbone's LoRA tensors whole from an FSDP1-wrapped model (its root unit, or the CausalModel
    inside it; ``use_orig_params``), under the keys `get_peft_model_state_dict` gives an unwrapped backbone
    (``model.layers.0.self_attn.q_proj.lora_A.weight``); None when no FSDP1 unit is in `model`. peft cannot
    produce them itself here: it selects LoRA keys by module names, which FSDP1 prefixes with
    ``_fsdp_wrapped_module.`` inside the backbone while the state-dict keys are cleaned, so it finds none
    (the "bf16 LoRA cannot be saved under FSDP1" failure). Each unit that holds LoRA parameters is summoned
    alone (``recurse=False``, a collective, in the same order on every process): at most one unit is whole
    at a time (with peft's wrap policy, one LoRA matrix)."""
    from peft.tuners.tuners_utils import _remove_adapter_name_from_state_dict_key
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    units = {name: m for name, m in model.named_modules() if isinstance(m, FSDP)}
    if not units:
        return None
    adapter_name = getattr(unwrap_causal_model(model), "active_adapter", "default")  # peft's name of the LoRA
    owned: dict[str, list[str]] = {}
    for name, _ in nn.Module.named_parameters(model):  # the raw names, FSDP's wrapper prefixes kept
        if "lora_" in name:
            owners = [u for u in units if u == "" or name.startswith(u + ".")]
            if not owners:  # sharded by a root unit this module is inside of
                raise ValueError(f"{name} belongs to the FSDP1 root unit: pass the root (accelerate's prepared "
                                 "model), or wrap the LoRA modules in units of their own (peft's fsdp_auto_wrap_policy)")
            owned.setdefault(max(owners, key=len), []).append(name)
    state = {}
    for owner in sorted(owned):
        with FSDP.summon_full_params(units[owner], recurse=False, writeback=False):
            for name in owned[owner]:
                key = clean_tensor_name(name).split("backbone.", 1)[1]
                state[_remove_adapter_name_from_state_dict_key(key, adapter_name)] = model.get_parameter(name).detach().clone()
    return state


def full_adapter_state_dict(model) -> dict:
    """`adapter_state_dict()` of a (possibly FSDP1- or FSDP2-wrapped) CausalModel with every tensor
    whole: FSDP2 DTensors gathered, FSDP1's LoRA summoned unit by unit (`_fsdp1_lora_state`); the heads
    are replicated (ignored by FSDP). A collective: call it on every process. Tensors are copies."""
    from torch.distributed.tensor import DTensor

    inner = unwrap_causal_model(model)
    lora = _fsdp1_lora_state(model) if inner.causal_config.lora is not None else None
    if lora is None:
        state = inner.adapter_state_dict()
    else:
        state = {**inner.adapter_state_dict(lora=False), **{LORA_PREFIX + k: v for k, v in lora.items()}}
    state = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}
    if inner.causal_config.lora is not None and not any(k.startswith(LORA_PREFIX) for k in state):
        raise RuntimeError("no LoRA tensor found in this FSDP1-wrapped model: FSDP1 keeps the LoRA parameters only "
                           "with fsdp_use_orig_params: true (set it in the accelerate config)")
    return state


def save_fsdp_adapter(model, directory: str | os.PathLike) -> Path:
    """Adapter-only checkpoint of an FSDP-wrapped CausalModel (FSDP1 or FSDP2, accelerate's or torch's):
    the adapter tensors are gathered on every process (collective), the main process writes our two
    files atomically."""
    import torch.distributed as dist


    tensors = full_adapter_state_dict(model)
    meta = unwrap_causal_model(model).adapter_metadata()
    if dist.get_rank() == 0:
        atomic_write_dir(directory, lambda tmp: write_adapter_files(tmp, meta, tensors))
    dist.barrier()
    return Path(directory)
