"""Generate with the three modes of a causal adapter, on a prompt with numbers.

    python examples/generate.py                  # embedded tiny Qwen2 + real Qwen tokenizer, offline
    python examples/generate.py --base DIR       # a local Qwen checkpoint directory
    python examples/generate.py --stream         # print the deterministic text as it is generated

The tiny default has random weights, so its text is gibberish; to show numbers being generated
and fed back, the example nudges the <NUM> score up (b_cls) and centres the regression head at
the prompt's scale (b_reg). A fresh adapter on a real checkpoint needs no nudging to produce
the base model's text in softmax mode; it emits <NUM> once trained.
"""
import argparse

import torch

from causal_adapter import CausalAdapterConfig, get_causal_model
from causal_adapter.modeling.generation import NumberStreamer
from causal_adapter.numbers import NumberTokenizer

PROMPT = "In 1749 the yearly sunspot number was 80.9; in 1750 it was"


def load(base_dir):
    if base_dir is None:
        from causal_adapter.saving.assets import build_tiny_qwen, load_qwen_tokenizer

        return build_tiny_qwen("qwen2"), load_qwen_tokenizer()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(base_dir), AutoTokenizer.from_pretrained(base_dir)


def show(title, out, ntok, max_numbers=3):
    print(f"\n== {title}")
    for i, text in enumerate(out.texts):
        n_new = int(out.lengths[i])
        marked = ntok.decode(out.new_tokens[i, :n_new].tolist(), out.new_values[i, :n_new].tolist(),
                             number_texts={n["position"]: f"[{n['text']}]" for n in out.numbers[i]},
                             skip_special_tokens=True)
        print(f"  text[{i}]:   {text!r}")
        print(f"  marked[{i}]: {marked!r}   (generated numbers in [ ])")
        for n in out.numbers[i][:max_numbers]:
            lo50, hi50 = n["interval_50"]
            lo90, hi90 = n["interval_90"]
            print(f"    <NUM> at step {n['position']}: {n['text']:>9}  loc_Y {n['loc']:.2f}, scale_Y {n['scale']:.2f}; "
                  f"50% [{lo50:.2f}, {hi50:.2f}]  90% [{lo90:.2f}, {hi90:.2f}]")
        if len(out.numbers[i]) > max_numbers:
            print(f"    ... {len(out.numbers[i]) - max_numbers} more")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default=None)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--stream", action="store_true")
    args = ap.parse_args()
    base, tok = load(args.base)
    model = get_causal_model(base, CausalAdapterConfig(gamma0=1.0), tokenizer=tok)
    ntok = NumberTokenizer(tok, model.num_token_id)
    if args.base is None:
        with torch.no_grad():
            model.action.b_cls[model.num_token_id] = 10.0  # make <NUM> a likely choice (demo only)
            model.action.b_reg.fill_(80.0)

    kw = dict(tokenizer=tok, max_new_tokens=args.max_new_tokens)
    show("softmax (greedy; = the base model's greedy text at initialisation)",
         model.generate(PROMPT, mode="softmax", **kw), ntok)
    show("softmax (sampled: temperature 0.8, top-p 0.9, seed 0)",
         model.generate(PROMPT, mode="softmax", do_sample=True, temperature=0.8, top_p=0.9, seed=0, **kw), ntok)
    streamer = NumberStreamer(tok) if args.stream else None
    if streamer:
        print("\n[streaming deterministic] ", end="")
    show("deterministic (argmax of the OvR probability; values = loc_Y)",
         model.generate(PROMPT, mode="deterministic", streamer=streamer, **kw), ntok)
    for seed in (0, 1):
        show(f"causal, seed {seed}, one individual for the whole text (shared_individual=True)",
             model.generate([PROMPT, PROMPT], mode="causal", seed=seed, shared_individual=True, **kw), ntok)
    show("causal, fresh noise at every step", model.generate(PROMPT, mode="causal", seed=0, **kw), ntok)


if __name__ == "__main__":
    main()
