"""Quickstart: wrap a Qwen model, run a forward pass with a loss, save and reload the adapter.

    python examples/quickstart.py                 # embedded tiny Qwen2 + real Qwen tokenizer, offline
    python examples/quickstart.py --base DIR      # a local Qwen checkpoint directory
"""
import argparse
import tempfile

import torch

from causal_adapter import CausalAdapterConfig, CausalModel, get_causal_model


def load(base_dir):
    if base_dir is None:
        from causal_adapter.saving.assets import build_tiny_qwen, load_qwen_tokenizer

        return build_tiny_qwen("qwen2"), load_qwen_tokenizer(), lambda: build_tiny_qwen("qwen2")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    fresh = lambda: AutoModelForCausalLM.from_pretrained(base_dir)  # noqa: E731
    return fresh(), AutoTokenizer.from_pretrained(base_dir), fresh


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default=None)
    args = ap.parse_args()
    base, tok, fresh_base = load(args.base)

    model = get_causal_model(base, CausalAdapterConfig(), tokenizer=tok)
    model.print_trainable_parameters()
    ids = tok("The answer to everything is forty-two.", return_tensors="pt")["input_ids"]
    out = model(ids, labels=ids)
    print(f"loss {out.loss.item():.3f} = L_cls {out.loss_cls.item():.3f} + L_reg {out.loss_reg.item():.3f}")
    with torch.no_grad():
        same = torch.equal(model(ids, return_scores=True).loc_S.argmax(-1), base(input_ids=ids).logits.argmax(-1))
    print("greedy choices equal the base model's:", same)

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(f"{tmp}/adapter")
        again = CausalModel.from_pretrained(fresh_base(), f"{tmp}/adapter")
        with torch.no_grad():
            print("reloaded adapter gives identical loc_U:", torch.equal(again(ids).loc_U, model(ids).loc_U))


if __name__ == "__main__":
    main()
