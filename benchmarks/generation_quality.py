"""Generation that makes sense (docs/predict.md, "The number layout"), on the demo's recipe.

    python benchmarks/generation_quality.py                      # the demo: 200 steps on sunspots
    python benchmarks/generation_quality.py --steps 50 --gamma0 1 --threshold-init 1

Trains the demo's recipe (`demo.demo_train_config`: embedded tiny base, sunspots train split, 200
steps; `--gamma0` / `--threshold-init` / `--freeze` override its adapter settings), then on the
test split (and the validation split, where a default is chosen):

* ``token_accuracy``: next-token accuracy of the deterministic mode (argmax_k P_k) on the
  completions (``" "`` then ``<NUM>``), as `causal-adapter eval` reports it;
* ``eval_value_mae``: |loc_Y - y| at the ``<NUM>`` target (teacher forced);
* greedy deterministic generation (`--new-tokens`) from each prompt as the data writes it,
  ending ``":"`` (the corpus prompt) and ending ``": "``:
  ``first_value_mae`` (the first generated number against the target; a prompt that generates
  none counts as the train median), ``has_number`` (share that generates a number) and
  ``well_formed`` (share whose text is, after at most one space, a number then the data's
  separator ``";"``).

The last line is ``RESULT demo_token_accuracy=... gen_first_value_mae_vs_eval=... gen_well_formed=...``
(``gen_*`` for the ``":"`` prompts, ``*_space`` for the ``": "`` ones; ``*_vs_eval`` = the first
generated value's MAE / eval_value_mae).
"""
from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import time

import torch

from causal_adapter.saving.assets import load_base
from causal_adapter.data.corpora import build_corpus
from causal_adapter.data.pipeline import tokenize_dataset
from causal_adapter.training.demo import demo_train_config
from causal_adapter.training.metrics import evaluate_dataset
from causal_adapter.model import get_causal_model
from causal_adapter.numbers import NumberTokenizer, find_numbers
from causal_adapter.training.loop import train

SEPARATOR = ";"


def well_formed(text: str, eos: str | None = None) -> bool:
    """At most one space, a number, then the separator or the end of the answer (`eos`, the text
    of the EOS token, when the row stopped on it: the data's completion ends after the number)."""
    nums = find_numbers(text)
    if not nums or not re.fullmatch(r" ?", text[:nums[0].start]):
        return False
    rest = text[nums[0].end:]
    return rest.startswith(SEPARATOR) or (eos is not None and rest in ("", eos))


def generation_scores(model, tokenizer, rows, fallback: float, new_tokens: int, suffix: str) -> dict:
    prompts = [r["prompt"] + suffix for r in rows]
    out = model.generate(prompts, tokenizer=tokenizer, max_new_tokens=new_tokens, mode="deterministic",
                         eos_token_id=[tokenizer.eos_token_id])
    firsts = [nums[0]["value"] if nums else None for nums in out.numbers]
    errors = [abs((v if v is not None else fallback) - r["target"]) for v, r in zip(firsts, rows)]
    return {"first_value_mae": sum(errors) / len(errors),
            "has_number": sum(v is not None for v in firsts) / len(firsts),
            "well_formed": sum(well_formed(t, tokenizer.eos_token if f else None)
                           for t, f in zip(out.texts, out.finished.tolist())) / len(out.texts), "example": out.texts[0]}


@torch.no_grad()
def diagnose(model, tokenizer, prompt: str) -> dict:
    """Why the token side does (not) learn: the top OvR probabilities at the last position of `prompt`
    ending ":" and ": ", and the sizes the OvR probability depends on."""
    from causal_adapter.modeling.cauchy import ovr_probability

    ntok = NumberTokenizer(tokenizer, model.num_token_id)
    k, act = model.num_token_id, model.action
    for suffix in ("", " "):
        enc = ntok([prompt + suffix])
        out = model(enc["input_ids"], enc["numeric_values"], enc["attention_mask"], return_scores=True)
        P = ovr_probability(out.loc_S[0, -1], out.scale_S[0, -1], act.thresholds)
        top = P.topk(3)
        names = [tokenizer.decode([i]) if i < len(tokenizer) else "<NUM>" for i in top.indices.tolist()]
        print(f"  last position {(prompt + suffix)[-6:]!r}: top P " + ", ".join(
            f"{n!r} {p:.2e}" for n, p in zip(names, top.values.tolist())) + f"; P(' ') {float(P[220]):.2e}, "
            f"loc_Y {float(out.loc_Y[0, -1]):.4g}")
    info = {"threshold": float(act.thresholds.reshape(-1)[0]), "b_cls_num": float(act.b_cls[k]),
            "b_cls_space": float(act.b_cls[220]),
            "num_row_norm": float(act.num_row.norm()) if act.num_row is not None else None,
            "space_row_norm": float(model.W_cls[220].float().norm()),
            "mean_scale_U": float(torch.nn.functional.softplus(model.abduction.scale.bias).mean()),
            "mean_b_noise": float(act.b_noise.abs().mean())}
    print("  " + ", ".join(f"{a} {b:.3g}" for a, b in info.items() if b is not None))
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=6)
    ap.add_argument("--gamma0", type=float, default=None, help="override the recipe's initial abduction scale")
    ap.add_argument("--threshold-init", type=float, default=None, help="override the recipe's OvR threshold")
    ap.add_argument("--freeze", nargs="*", default=None, help="override the recipe's frozen groups")
    ap.add_argument("--prompt-loss", default=None, choices=["none", "text"], help="override the recipe's prompt_loss")
    ap.add_argument("--add-eos-token", default=None, choices=["yes", "no"],
                    help="override the recipe's add_eos_token (EOS after every completion)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    base, tokenizer = load_base(None)
    ntok = NumberTokenizer(tokenizer)
    corpus = build_corpus("sunspots")
    extra = {k: v for k, v in (("gamma0", args.gamma0), ("threshold_init", args.threshold_init),
                               ("freeze", args.freeze), ("prompt_loss", args.prompt_loss),
                               ("add_eos_token", None if args.add_eos_token is None else args.add_eos_token == "yes"))
             if v is not None}
    with tempfile.TemporaryDirectory() as tmp:
        config = demo_train_config(tmp, args.steps, plot=False, progress=False, **extra)
        model = get_causal_model(base, config.adapter_config(), tokenizer=tokenizer)
        t0 = time.perf_counter()
        model = train(model, config, tokenizer=tokenizer).model
        seconds = time.perf_counter() - t0
    print(f"trained {args.steps} steps in {seconds:.0f} s; the first test prompt:")
    diagnose(model, tokenizer, corpus["test"][0]["prompt"])
    fallback = statistics.median(corpus["train"]["target"])
    res: dict = {}
    for split in ("validation", "test"):
        ev = evaluate_dataset(model, tokenize_dataset(corpus[split], ntok), ntok.pad_token_id, batch_size=16)
        rows = list(corpus[split])
        colon = generation_scores(model, tokenizer, rows, fallback, args.new_tokens, "")
        space = generation_scores(model, tokenizer, rows, fallback, args.new_tokens, " ")
        print(f"{split}: token accuracy {ev['accuracy']:.3f}, eval value MAE {ev['value_mae']:.2f}")
        for name, g in ((":", colon), (": ", space)):
            print(f"  prompts ending {name!r}: first value MAE {g['first_value_mae']:.2f}, has a number "
                  f"{g['has_number']:.2f}, well formed {g['well_formed']:.2f}, e.g. {g['example']!r}")
        tag = "" if split == "test" else "_val"
        res.update({f"demo_token_accuracy{tag}": ev["accuracy"], f"eval_value_mae{tag}": ev["value_mae"],
                    f"gen_first_value_mae_vs_eval{tag}": colon["first_value_mae"] / ev["value_mae"],
                    f"gen_first_value_mae_vs_eval_space{tag}": space["first_value_mae"] / ev["value_mae"],
                    f"gen_well_formed{tag}": colon["well_formed"], f"gen_well_formed_space{tag}": space["well_formed"]})
    res["train_seconds"] = seconds
    print("RESULT " + " ".join(f"{k}={v:.4g}" for k, v in res.items()))


if __name__ == "__main__":
    main()
