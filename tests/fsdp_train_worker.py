"""A process of `causal_adapter.training.loop.train` under FSDP1 or FSDP2, started by tests/test_fsdp_train.py
with `accelerate launch --config_file <CPU copy of examples/accelerate_configs/fsdp.yaml or fsdp2.yaml>`
(2 gloo processes).

On a CPU accelerate 1.15 keeps MULTI_CPU for an FSDP launch (state.py selects FSDP on an accelerator only):
`use_fsdp_on_cpu` sets the three state fields an FSDP launch on GPUs sets, before `train` builds its
Accelerator on that same state. That is this test's business only: the product never fakes its launcher.

    --job first    OUT/full: train RUN_STEPS steps (checkpoints every 2); OUT/bf16: LoRA in fp32 on a bf16
                   base (its adapter gathered whole into OUT/bf16/trained.safetensors); OUT/trainer:
                   CausalTrainer, RUN_STEPS steps (checkpoints every 2), save_model into OUT/trainer/adapter;
                   then OUT/killed: the run of OUT/full, SIGKILLed (both processes) after checkpoint 2, as a
                   kill -9 of the job
    --job resume   resume OUT/killed from its latest checkpoint to the end; OUT/trainer_resumed: CausalTrainer
                   resumed from OUT/trainer/checkpoint-2 to the end, save_model into OUT/trainer_resumed/adapter
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import torch

NUM_TOKEN_ID = 300
RUN_STEPS, KILL_AT = 4, 2


def use_fsdp_on_cpu() -> None:
    """What accelerate's state holds after an FSDP launch on GPUs (see the module docstring)."""
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    accelerator = Accelerator(cpu=True)
    plugin = FullyShardedDataParallelPlugin()  # from the FSDP_* variables `accelerate launch` set from the file
    PartialState().distributed_type = accelerator.state.distributed_type = DistributedType.FSDP
    PartialState().device = accelerator.state.device = torch.device("cpu")
    accelerator.state.fsdp_plugin = plugin


def rows(n: int, seed: int, seq: int = 10) -> list[dict]:
    """Rows of one length with one <NUM> each at the same place, so every process's mean loss weighs the
    same number of tokens as one process's over their union (the equivalence needs it)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids, vals = torch.randint(0, 280, (seq,), generator=g), torch.zeros(seq)
        ids[5], vals[5] = NUM_TOKEN_ID, float(ids[0] % 7) * 3.0 + 10.5
        out.append({"input_ids": ids.tolist(), "numeric_values": vals.tolist(), "labels": ids.tolist()})
    return out


def datasets_():
    import datasets

    return datasets.Dataset.from_list(rows(16, 0)), datasets.Dataset.from_list(rows(5, 1))  # 5: shards 3 and 2


def base(dtype=torch.float32):
    from causal_adapter.saving.assets import build_tiny_qwen

    return build_tiny_qwen("qwen2", vocab_size=320, hidden_size=32, num_layers=2, dtype=dtype)


def model(lora: bool = True, dtype=torch.float32):
    """The CausalModel every run starts from (seeded: the heads' initialisation draws from torch's RNG)."""
    from causal_adapter import CausalAdapterConfig, LoraSettings, get_causal_model

    torch.manual_seed(0)
    settings = LoraSettings(r=4, target_modules=["q_proj", "v_proj"]) if lora else None
    return get_causal_model(base(dtype), CausalAdapterConfig(num_token_id=NUM_TOKEN_ID, lora=settings))


def config(out: Path, batch: int, **kw):
    """SGD-like AdamW (epsilon far above |g|: the update is lr * m / eps, proportional to the gradient, so a
    doubled head gradient shows) with clipping at work, 2 micro-batches per step, evaluation every 2 steps
    (with the value head refitted on the LoRA-moved features) and at the end (calibration)."""
    from causal_adapter.training.config import TrainConfig

    settings = dict(output_dir=str(out), max_steps=RUN_STEPS, per_device_train_batch_size=batch,
                    gradient_accumulation_steps=2, per_device_eval_batch_size=2, learning_rate=0.5, adam_epsilon=1.0,
                    max_grad_norm=0.5, lr_scheduler_type="constant", eval_steps=2, save_steps=2, save_total_limit=0,
                    logging_steps=1, plot=False, progress=False, seed=7, mixed_precision="no")
    return TrainConfig(**{**settings, **kw})


def main() -> None:
    from accelerate import PartialState

    from causal_adapter.saving.process_groups import exit_without_teardown
    from causal_adapter.training.loop import train

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--job", choices=["first", "resume"], required=True)
    ap.add_argument("--batch", type=int, default=2)
    args = ap.parse_args()
    use_fsdp_on_cpu()
    train_ds, eval_ds = datasets_()
    if args.job == "first":
        train(model(), config(args.out / "full", args.batch), train_dataset=train_ds, eval_dataset=eval_ds)
        bf16_lora(args.out / "bf16", args.batch, train_ds, eval_ds)
        trainer_run(args.out / "trainer", args.batch, train_ds)
        # a frozen backbone (no LoRA): the own loop and CausalTrainer
        train(model(lora=False), config(args.out / "frozen", args.batch), train_dataset=train_ds, eval_dataset=eval_ds)
        trainer_run(args.out / "trainer_frozen", args.batch, train_ds, lora=False)

        def kill(state, logs):
            if state.global_step == KILL_AT:  # checkpoint-2 is in place
                os.kill(os.getpid(), signal.SIGKILL)
        train(model(), config(args.out / "killed", args.batch), train_dataset=train_ds, eval_dataset=eval_ds,
              callbacks=[kill])
    else:
        train(model(), config(args.out / "killed", args.batch, resume_from_checkpoint="latest"),
              train_dataset=train_ds, eval_dataset=eval_ds)
        trainer_run(args.out / "trainer_resumed", args.batch, train_ds, args.out / "trainer" / "checkpoint-2")

    PartialState().destroy_process_group()  # as accelerate's end_training(); the gloo group itself lives to the end (saving/process_groups.py)
    exit_without_teardown()  # no teardown to race gloo's threads (saving/process_groups.py)


def trainer_run(out: Path, batch: int, train_ds, resume_from: Path | None = None, lora: bool = True) -> None:
    """`CausalTrainer` under the same launch: RUN_STEPS steps of 2 micro-batches, clipping, checkpoints every 2
    steps (Trainer's sharded model and optimizer beside the adapter files); the adapter-only `save_model`."""
    from safetensors.torch import save_file
    from transformers import TrainingArguments

    from causal_adapter.data.pipeline import NumericCollator
    from causal_adapter.saving.hf_trainer import CausalTrainer

    targs = TrainingArguments(output_dir=str(out), max_steps=RUN_STEPS, per_device_train_batch_size=batch,
                              gradient_accumulation_steps=2, learning_rate=1e-2, max_grad_norm=0.5,
                              lr_scheduler_type="constant", save_strategy="steps", save_steps=2, logging_steps=1,
                              use_cpu=True, report_to=[], seed=0, data_seed=0, dataloader_num_workers=0,
                              disable_tqdm=True,
                              # the state `use_fsdp_on_cpu` set as an FSDP launch on GPUs does (else Trainer resets it)
                              accelerator_config={"use_configured_state": True})
    trainer = CausalTrainer(model=model(lora), args=targs, train_dataset=train_ds, data_collator=NumericCollator(0))
    trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    trainer.save_model(str(out / "adapter"))
    save_file({k: v.contiguous() for k, v in trainer.model.adapter_state_dict(lora=False).items()},  # replicated
              str(out / f"heads_rank{os.environ['RANK']}.safetensors"))


def bf16_lora(out: Path, batch: int, train_ds, eval_ds) -> None:
    """LoRA in fp32 on a bf16 base (autocast_adapter_dtype, as peft's get_peft_model); the trained adapter
    gathered whole (every process) and written by the main process, for the test to compare the reload with."""
    from safetensors.torch import save_file

    from causal_adapter.saving.fsdp import full_adapter_state_dict
    from causal_adapter.training.loop import train

    result = train(model(dtype=torch.bfloat16), config(out, batch, max_steps=2, eval_steps=0, save_steps=0),
                   train_dataset=train_ds, eval_dataset=eval_ds)
    tensors = full_adapter_state_dict(result.model)
    if int(os.environ["RANK"]) == 0:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "trained.safetensors"))

if __name__ == "__main__":
    sys.exit(main())
