"""accelerate's own FSDP wrap of an accelerate config for a CausalModel in 2 gloo processes on CPU: the worker
and the check tests/test_distributed.py runs (was benchmarks/fsdp_wrap.py).

`check(config, dtype, out, lora)` runs `accelerate launch --config_file <CPU copy of config>` of this file: 2
processes, each builds a tiny random Qwen2 (base in `dtype`, heads fp32), calls `accelerator.prepare(model,
optimizer)` (accelerate's own FSDP1 `FullyShardedDataParallel(...)` / FSDP2 `fully_shard` calls, from the FSDP_*
settings `accelerate launch` read from the config), then `saving.fsdp.finish_fsdp_wrap`, trains 4 steps, gathers
the adapter (`full_adapter_state_dict`) and saves it (`save_fsdp_adapter`). The launching process then checks: the
loss went down, both replicas hold the same adapter, the saved adapter reloads onto a fresh base with those
tensors, the heads are fp32 and the values reached `forward` in fp32.

On CPU two settings differ from the file: accelerate selects FSDP only on an accelerator (state.py), so the
worker sets the three state fields a GPU launch sets (distributed type, plugin, device; `use_fsdp_on_cpu`), and
`fsdp_sync_module_states` / `fsdp_cpu_ram_efficient_loading` are false (they need a GPU).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
NUM_TOKEN_ID, STEPS = 300, 4


def tiny_base(dtype: torch.dtype):
    from causal_adapter.saving.assets import build_tiny_qwen

    return build_tiny_qwen("qwen2", vocab_size=320, hidden_size=32, num_layers=2, dtype=dtype)


def cpu_config(config: Path, out: Path) -> Path:
    """A copy of `config` with the two GPU-only settings off."""
    text = config.read_text()
    for key in ("fsdp_sync_module_states", "fsdp_cpu_ram_efficient_loading"):
        text = text.replace(f"{key}: true", f"{key}: false")
    path = out / "cpu_config.yaml"
    path.write_text(text)
    return path


def use_fsdp_on_cpu(accelerator) -> None:
    """Set what accelerate's state sets for an FSDP launch on GPUs (it keeps MULTI_CPU on CPU)."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    if accelerator.distributed_type == DistributedType.FSDP:
        return
    plugin = FullyShardedDataParallelPlugin()  # from the FSDP_* variables `accelerate launch` set
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    PartialState().distributed_type = accelerator.state.distributed_type = DistributedType.FSDP
    PartialState().device = accelerator.state.device = torch.device("cpu")  # FSDP1 wants "cpu", not "cpu:0"
    accelerator.state.fsdp_plugin = plugin


def toy_batch(rank: int) -> dict:
    from causal_adapter.data.pipeline import NumericCollator

    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(8):
        ids, vals = torch.randint(0, 280, (10,), generator=g), torch.zeros(10)
        ids[5] = NUM_TOKEN_ID
        vals[5] = 1234.567 + float(ids[0] % 7)  # not a bf16 number: a cast to bf16 would show
        rows.append({"input_ids": ids.tolist(), "numeric_values": vals.tolist(), "labels": ids.tolist()})
    return NumericCollator(0)(rows[rank * 4:(rank + 1) * 4])


def worker(out: Path, dtype: torch.dtype, lora: str) -> None:
    from accelerate import Accelerator
    from safetensors.torch import save_file

    from causal_adapter import CausalAdapterConfig, LoraSettings, get_causal_model
    from causal_adapter.saving.fsdp import finish_fsdp_wrap, full_adapter_state_dict, save_fsdp_adapter, set_lora_wrap_policy
    from causal_adapter.saving.process_groups import exit_without_teardown

    accelerator = Accelerator()
    use_fsdp_on_cpu(accelerator)
    settings = LoraSettings(r=4, target_modules=["q_proj", "v_proj"]) if lora != "none" else None
    model = get_causal_model(tiny_base(dtype), CausalAdapterConfig(num_token_id=NUM_TOKEN_ID, lora=settings))
    if lora == "fp32":  # LoRA weights upcast, as peft's get_peft_model does (autocast_adapter_dtype)
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.data = p.data.float()
    model.set_value_units(1234.0, 10.0)
    seen = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append(str(kw["numeric_values"].dtype)), with_kwargs=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    set_lora_wrap_policy(accelerator, model)  # FSDP1 + LoRA: LoRA matrices in units of their own (peft's policy)
    model, optimizer = accelerator.prepare(model, optimizer)
    finish_fsdp_wrap(model)
    rank = accelerator.process_index
    batch = toy_batch(rank)
    losses = []
    for _ in range(STEPS):
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach().float(), "mean").item())
    tensors = full_adapter_state_dict(model)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / f"full_rank{rank}.safetensors"))
    save_fsdp_adapter(model, out / "adapter")
    if rank == 0:
        inner = accelerator.unwrap_model(model)
        (out / "result.json").write_text(json.dumps({
            "losses": losses, "values_dtype": sorted(set(seen)), "batch_values_dtype": str(batch["numeric_values"].dtype), "wrapper": type(model).__name__,
            "fsdp_version": accelerator.state.fsdp_plugin.fsdp_version,
            "head_dtype": str(inner.action.b_cls.dtype), "base_dtype": str(inner.W_cls.dtype)}))
    accelerator.end_training()
    exit_without_teardown()  # no teardown to race gloo's threads (docs/distributed.md, "Exit")


def launch(config: Path, dtype: str, out: Path, lora: str = "none", timeout: float = 300
           ) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file <CPU copy of config>` of this file's worker (2 gloo processes)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(cpu_config(config, out)),
           "--main_process_port", str(port), __file__, "--dtype", dtype, "--out", str(out), "--lora", lora]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the launcher and both workers (their own session)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def check(config: Path, dtype: str, out: Path, lora: str = "none") -> tuple[bool, str]:
    """Launch, then verify the run's files; (ok, reason)."""
    from safetensors.torch import load_file

    from causal_adapter import CausalModel

    proc = launch(config, dtype, out, lora)
    if proc.returncode != 0:
        errors = [line for line in proc.stderr.splitlines() if "Error:" in line and "ChildFailedError" not in line]
        errors = errors or proc.stderr.splitlines()[-1:] or ["(no output)"]
        return False, f"launch failed: {errors[-1][:300]}\n--- the launch's stderr, last lines:\n{proc.stderr[-3000:]}"
    res = json.loads((out / "result.json").read_text())
    a, b = (load_file(str(out / f"full_rank{r}.safetensors")) for r in (0, 1))
    loaded = CausalModel.from_pretrained(tiny_base(getattr(torch, dtype)), out / "adapter").adapter_state_dict()
    problems = {
        "loss did not go down": not res["losses"][-1] < res["losses"][0],
        "replicas differ": any(not torch.equal(a[k], b[k]) for k in a),
        "reloaded adapter differs": set(loaded) != set(a) or any(not torch.equal(loaded[k], a[k]) for k in a),
        "heads not fp32": res["head_dtype"] != "torch.float32",
        "values cast": res["values_dtype"] != [res["batch_values_dtype"]],
    }
    bad = [k for k, v in problems.items() if v]
    return not bad, ", ".join(bad) or f"{res['wrapper']} fsdp_version={res['fsdp_version']} losses={res['losses']}"


if __name__ == "__main__":  # the worker, as `accelerate launch` starts it
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--lora", default="none", choices=["none", "base-dtype", "fp32"])
    args = ap.parse_args()
    worker(args.out, getattr(torch, args.dtype), args.lora)
