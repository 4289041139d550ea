"""Training-step throughput at the Qwen2.5-0.5B shape: causal adapter (frozen backbone and LoRA)
vs a plain LoRA cross-entropy fine-tune.

    python benchmarks/train_step.py                 # 4 of the 24 layers, batch 2 x 128 tokens
    python benchmarks/train_step.py --layers 24     # the full depth

Run time on 2 shared CPU cores: 4 layers ~3-5 min, 24 layers ~12 min (building the three
models and a warm-up step included); 24 layers do not fit in a minute, hence the default.

Shapes: hidden 896, 14 query / 2 key-value heads, intermediate 4864, vocab 151,936, tied
embeddings, random weights (float32, CPU). Every position carries a label (plain text).
One timed step (the fastest of --steps) = forward + loss + backward + AdamW step + zero_grad, as `causal_adapter.training.loop`
does it:

* ``frozen``: `get_causal_model` with a frozen backbone: the backbone runs under no_grad,
  only the heads train (the fused OvR loss over all 151,936 rows, `loss.fused_ovr_loss`).
* ``causal_lora``: the same with peft LoRA (r=8, alpha=16, q/k/v/o/gate/up/down): normal
  backward through the backbone.
* ``plain_lora``: peft `get_peft_model` with the same LoRA and the base model's own
  cross-entropy loss (its logits and softmax over the vocabulary): the usual LoRA fine-tune.

Ends with ONE line ``RESULT key=value ...`` (tokens/s and the ratios to plain LoRA).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def build_base(layers: int, seed: int = 0, vocab_size: int = 151_936):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
                      num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                      max_position_embeddings=4096)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg).eval()


def lora_settings(r: int):
    from causal_adapter import LoraSettings

    return LoraSettings(r=r, alpha=2 * r, dropout=0.0)


def make_step(mode: str, layers: int, r: int, ids: torch.Tensor):
    """(model, step function, trainable parameter count) for one mode; a step is one optimizer update."""
    base = build_base(layers)
    labels = ids.clone()
    if mode in ("frozen", "causal_lora"):
        from causal_adapter import CausalAdapterConfig, get_causal_model

        cfg = CausalAdapterConfig(num_token_id=151_665, lora=lora_settings(r) if mode == "causal_lora" else None)
        model = get_causal_model(base, cfg)
        model.train()
        params = [p for _, p in model.trainable_parameters()]
        assert model.backbone_needs_grad() == (mode == "causal_lora")

        def loss_fn():
            return model(ids, labels=labels).loss
    else:
        from peft import LoraConfig, get_peft_model

        s = lora_settings(r)
        model = get_peft_model(base, LoraConfig(r=s.r, lora_alpha=s.alpha, lora_dropout=s.dropout,
                                                target_modules=list(s.target_modules)))
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]

        def loss_fn():
            return model(input_ids=ids, labels=labels).loss

    opt = torch.optim.AdamW(params, lr=1e-4)

    def step():
        loss = loss_fn()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    n_train = sum(p.numel() for p in params)
    return model, step, n_train


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (Qwen2.5-0.5B has 24)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per mode (the fastest is reported)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--lora-r", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 151_000, (args.batch, args.seq), generator=g)
    tokens = args.batch * args.seq
    print(f"Qwen2.5-0.5B shape with {args.layers} layer(s); batch {args.batch} x {args.seq} = {tokens} tokens/step; "
          f"{torch.get_num_threads()} threads; fastest of {args.steps} steps after {args.warmup} warm-up "
          "(the minimum is the least disturbed by other processes on a shared machine)")
    modes = ("frozen", "causal_lora", "plain_lora")
    steps, n_train = {}, {}
    for mode in modes:  # all three live at once (3 x 2 GB at 24 layers) so that they can be interleaved
        _, steps[mode], n_train[mode] = make_step(mode, args.layers, args.lora_r, ids)
        for _ in range(args.warmup):
            steps[mode]()
    times = {m: [] for m in modes}
    losses = {}
    for _ in range(args.steps):  # round robin: a burst of load from other processes hits every mode alike
        for mode in modes:
            t = time.perf_counter()
            losses[mode] = steps[mode]()
            times[mode].append(time.perf_counter() - t)
    result = {}
    for mode in modes:
        sec = min(times[mode])
        result[mode] = tokens / sec
        print(f"{mode:12s} {sec:7.3f} s/step  {tokens / sec:9.1f} tokens/s  trainable {n_train[mode]:,d}  "
              f"loss {losses[mode]:.4g}  (median {statistics.median(times[mode]):.2f} s; "
              f"steps: {', '.join(f'{t:.2f}' for t in times[mode])})")
    print(f"frozen / plain LoRA: {result['frozen'] / result['plain_lora']:.2f}x   "
          f"causal LoRA / plain LoRA: {result['causal_lora'] / result['plain_lora']:.2f}x")
    print("RESULT " + " ".join([
        f"layers={args.layers}", f"tokens_per_step={tokens}",
        f"frozen_tok_s={result['frozen']:.1f}", f"causal_lora_tok_s={result['causal_lora']:.1f}",
        f"plain_lora_tok_s={result['plain_lora']:.1f}",
        f"frozen_vs_plain={result['frozen'] / result['plain_lora']:.3f}",
        f"causal_lora_vs_plain={result['causal_lora'] / result['plain_lora']:.3f}",
    ]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
