"""The model card (README.md) that `save_pretrained` writes beside the adapter files."""
from __future__ import annotations

import json

from ..config import METRIC_LABELS
from .assets import TINY_NAME
from .peft_lora import PEFT_CONFIG_NAME, PEFT_WEIGHTS_NAME

MODEL_CARD_NAME = "README.md"


def model_card(model, metrics: dict | None = None, directory: str = "<this directory or repo id>") -> str:
    """A short README.md: base model, adapter configuration, metrics by split when known, and a Usage
    snippet that loads the adapter from `directory` as written."""
    meta = model.adapter_metadata()
    base = meta.get("base_model_name_or_path")
    tiny = base is not None and TINY_NAME.fullmatch(str(base)) is not None
    lora = model.causal_config.lora
    tags = ["causal_adapter", "cauchy", "numbers"] + (["peft", "lora"] if lora is not None else [])
    front = ["---", "library_name: causal_adapter"] + ([f"base_model: {base}"] if base and not tiny else [])
    front += ["tags:"] + [f"- {t}" for t in tags] + ["---", ""]
    where = (f"`{base}`: the embedded random tiny Qwen, rebuilt locally by `causal_adapter.saving.assets."
             "build_tiny_qwen` (no hub repo)") if tiny else (f"[`{base}`](https://huggingface.co/{base})" if base
                                                            else "not recorded (pass it to from_pretrained)")
    lines = [
        f"# Causal adapter for `{base or 'a Qwen model'}`",
        "",
        "Cauchy causal heads (abduction, OvR classification, regression of `<NUM>` values) on a "
        f"{'LoRA-tuned' if lora is not None else 'frozen'} `{meta['model_type']}` backbone, made with "
        f"causal_adapter {meta['library_version']}.",
        "",
        f"- base model: {where} (model_type `{meta['model_type']}`, hidden size {meta['hidden_size']}, "
        f"{meta['vocab_size']} vocabulary rows, tied embeddings: {meta['tie_word_embeddings']})",
        f"- `<NUM>` token id: {meta['num_token_id']}",
        f"- adapter parameters: {model.trainable_at_init:,d} trainable as `get_causal_model` sets them "
        "(a run's `freeze` may have trained fewer)",
    ]
    if lora is not None:
        lines.append(f"- LoRA: r={lora.r}, alpha={lora.alpha}, targets {list(lora.target_modules)}, in peft's "
                     f"files (`{PEFT_CONFIG_NAME}`, `{PEFT_WEIGHTS_NAME}`)")
    lines += ["", "## Configuration", "", "```json", json.dumps(model.causal_config.to_dict(), indent=2, sort_keys=True), "```"]
    lines += _card_metrics(metrics or {})
    lines += ["", "## Usage", "", "```python", "from causal_adapter import CausalModel", "",
              f"model = CausalModel.from_pretrained({base!r}, {directory!r})  # or the hub repo id it was pushed to",
              "```", ""]
    return "\n".join(front + lines)


#: a metric key's prefix -> the split it was measured on (train() logs the validation split as eval_*)
SPLIT_PREFIXES = (("eval_", "validation"), ("validation_", "validation"), ("test_", "test"), ("train_", "train"))


def _card_metrics(metrics: dict) -> list[str]:
    """The card's metrics table: one row per scalar metric with the split it was measured on."""
    rows = []
    for key, v in metrics.items():
        if not (isinstance(v, (int, float, str, bool)) or v is None):
            continue
        split, name = next(((s, key[len(p):]) for p, s in SPLIT_PREFIXES if key.startswith(p)), ("run", key))
        shown = f"{v:.6g}" if isinstance(v, float) else str(v)
        rows.append(f"| {split} | {METRIC_LABELS.get(name, name)} | {shown} |")
    if not rows:
        return []
    return ["", "## Metrics", "", "Measured by the run that saved the adapter. Its calibration map was fitted on "
            "the validation split, so validation coverage is in-sample. Perplexity is that of softmax(loc_S) "
            "over the whole vocabulary (large for a random base).", "", "| split | metric | value |",
            "|---|---|---|", *rows]
