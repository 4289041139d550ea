"""Fine-tune a causal adapter with the Python API, then reload it and predict.

    python examples/finetune.py                          # embedded tiny Qwen + sunspots, offline, ~1 min on CPU
    python examples/finetune.py --base /path/to/Qwen2.5-0.5B --lora
    accelerate launch examples/finetune.py ...           # the same script under any accelerate config

The same run from the command line: ``causal-adapter train --output-dir runs/sunspots``
(``python -m causal_adapter train --help`` lists every flag).
"""
import argparse

from accelerate import PartialState

from causal_adapter import CausalModel, get_causal_model
from causal_adapter.data.corpora import build_corpus
from causal_adapter.training.metrics import format_metrics_table
from causal_adapter.training.config import TrainConfig
from causal_adapter.training.loop import train


def load_base(path):
    """A fresh base model and its tokenizer (the embedded tiny Qwen by default)."""
    if path is None:
        from causal_adapter.saving.assets import build_tiny_qwen, load_qwen_tokenizer

        return build_tiny_qwen("qwen2"), load_qwen_tokenizer()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default=None, help="local Qwen checkpoint directory (default: embedded tiny Qwen)")
    ap.add_argument("--lora", action="store_true", help="LoRA on the backbone instead of a frozen backbone")
    ap.add_argument("--output-dir", default="runs/finetune-example")
    ap.add_argument("--epochs", type=float, default=2.0)
    args = ap.parse_args()

    # 1. the run's settings: TrainConfig's defaults are the recipe `causal-adapter train` uses
    config = TrainConfig(output_dir=args.output_dir, num_train_epochs=args.epochs, learning_rate=2e-2,
                         lora=args.lora, lora_r=8, lora_alpha=16, lora_learning_rate=2e-4,
                         per_device_train_batch_size=8, eval_steps=20, save_steps=20, warmup_ratio=0.05)

    # 2. wrap the base model (frozen backbone, or LoRA through peft) with that recipe's adapter config
    #    (gamma0, threshold, recent values); CausalAdapterConfig() alone is the SPEC's initial design
    base, tokenizer = load_base(args.base)
    model = get_causal_model(base, config.adapter_config(), tokenizer=tokenizer)
    model.print_trainable_parameters()

    # 3. data: any datasets.Dataset with a "text" column or "prompt" + "completion" columns
    #    (here the built-in sunspots corpus, split by time; data.load_text_dataset reads files)
    splits = build_corpus("sunspots")

    # 4. train (accelerate underneath: the same call runs single-process or under DDP)
    result = train(model, config, train_dataset=splits["train"], eval_dataset=splits["validation"],
                   tokenizer=tokenizer)
    print(format_metrics_table(result.eval_metrics))
    print("adapter saved in", result.adapter_dir)

    # 5. reload the adapter (a few hundred KB) on a fresh copy of the base and predict the next value
    fresh_base, _ = load_base(args.base)
    reloaded = CausalModel.from_pretrained(fresh_base, result.adapter_dir, tokenizer=tokenizer)
    row = splits["test"][0]
    out = reloaded.generate(row["prompt"], tokenizer=tokenizer, mode="deterministic", max_new_tokens=2)
    numbers = out.numbers[0]
    if numbers:  # the first number the model writes after the prompt: value = loc_Y, Cauchy intervals
        n = numbers[0]
        lo, hi = n["interval_90"]
        print(f"{row['prompt'][-40:]!r} -> {n['value']:.4g} (90% interval {lo:.4g} .. {hi:.4g}); "
              f"true{row['completion']}")
    else:
        print("no number generated:", repr(out.texts[0]))

    # under `accelerate launch`: close the process group before exit (accelerate's `end_training` does the same;
    # a gloo group left to the interpreter's exit can abort the process)
    PartialState().destroy_process_group()


if __name__ == "__main__":
    main()
