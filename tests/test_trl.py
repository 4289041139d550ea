"""TRL's SFTTrainer for a CausalModel (`causal_adapter.training.sft`, docs/integrations.md "TRL"), with the
real trl (an optional extra: skipped without it)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

trl = pytest.importorskip("trl")

from causal_adapter import CausalAdapterConfig, CausalModel, get_causal_model  # noqa: E402
from causal_adapter.data.corpora import build_corpus  # noqa: E402
from causal_adapter.saving.assets import build_tiny_qwen  # noqa: E402
from causal_adapter.training.sft import CausalSFTTrainer  # noqa: E402

DOCS = Path(__file__).resolve().parents[1] / "docs" / "integrations.md"
# what an adapter-only directory may hold: our files, peft's LoRA files, the card, the tokenizer, Trainer's args
ADAPTER_FILES = {"causal_adapter_config.json", "causal_adapter_model.safetensors", "adapter_config.json",
                 "adapter_model.safetensors", "README.md", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja", "special_tokens_map.json", "training_args.bin"}


def _documented_block() -> str:
    section = DOCS.read_text(encoding="utf-8").split("## TRL: SFTTrainer", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "the TRL section holds one python block: the recipe"
    return blocks[0]


def _sft_args(out, steps=4, **kw):
    return trl.SFTConfig(str(out), max_steps=steps, learning_rate=1e-2, use_cpu=True, bf16=False, report_to=[],
                         save_strategy="no", **kw)


def test_documented_recipe_runs_and_leaves_an_adapter_only_directory(tmp_path, monkeypatch):
    code = _documented_block()
    assert "max_steps=300" in code
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code.replace("max_steps=300", "max_steps=4"), str(DOCS), "exec"), namespace)
    adapter = tmp_path / "sft-out" / "adapter"
    files = {p.name for p in adapter.iterdir()}
    assert files <= ADAPTER_FILES and "causal_adapter_model.safetensors" in files, files
    weights = sum(p.stat().st_size for p in adapter.iterdir() if not p.name.startswith(("tokenizer", "chat_template")))
    assert weights < 2e6, weights  # the adapter (0.6 MB), not the base's 39 MB
    reloaded = CausalModel.from_pretrained(build_tiny_qwen("qwen2"), adapter)
    assert reloaded.causal_config.value_calibration is not None  # fitted after training, saved
    (row,) = namespace["reloaded"].predict_values([namespace["data"]["test"][0]["prompt"]], tokenizer=namespace["tok"])
    assert 0 <= row["value"] < 400 and row["lower_90"] < row["value"] < row["upper_90"], row


class _Spy(__import__("transformers").TrainerCallback):
    """Records, during training, what the value head looked like at step 1 and after the last step."""

    def __init__(self, model):
        self.model, self.at_step_begin, self.at_train_end = model, None, None

    def on_step_begin(self, args, state, control, **kw):
        if self.at_step_begin is None:
            self.at_step_begin = (self.model.causal_config.value_loc, self.model.action.w_reg.detach().clone())

    def on_train_end(self, args, state, control, **kw):
        self.at_train_end = self.model.action.w_reg.detach().clone()


def test_values_reach_forward_and_the_value_head_is_fitted_as_train_does(tmp_path, qwen_tokenizer):
    tok = qwen_tokenizer
    model = get_causal_model(build_tiny_qwen("qwen2"), CausalAdapterConfig(), tokenizer=tok)
    data = build_corpus("sunspots")
    seen = []

    def hook(module, args, kwargs):
        seen.append({k: kwargs.get(k) for k in ("input_ids", "numeric_values", "label_values", "labels")})
    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    spy = _Spy(model)
    trainer = CausalSFTTrainer(model=model, args=_sft_args(tmp_path), train_dataset=data["train"],
                               eval_dataset=data["validation"], processing_class=tok, callbacks=[spy])
    trainer.train()
    handle.remove()
    # the completions' values reach forward as values at their <NUM> labels (no digit tokens)
    targets = {round(float(t), 3) for t in data["train"]["target"]}
    batch = next(s for s in seen if s["labels"] is not None and s["label_values"] is not None)
    at_num = batch["labels"] == model.num_token_id
    assert at_num.any(), "no <NUM> label: numbers were tokenised as digits"
    assert {round(v, 3) for v in batch["label_values"][at_num].tolist()} <= targets
    assert batch["numeric_values"][batch["input_ids"] == model.num_token_id].abs().sum() > 0
    # value units and the warm start before step 1; refit + calibration after the last step
    value_loc, w_start = spy.at_step_begin
    assert value_loc == pytest.approx(float(torch.tensor(data["train"]["target"]).median()), rel=0.05)
    assert w_start.abs().sum() > 0
    assert not torch.equal(spy.at_train_end, model.action.w_reg), "no refit on the final features"
    assert model.causal_config.value_calibration is not None
    assert model.causal_config.number_prefix_id is not None  # the number layout, as train() records it
    trainer.save_model(str(tmp_path / "adapter"))
    again = CausalModel.from_pretrained(build_tiny_qwen("qwen2"), tmp_path / "adapter")
    torch.testing.assert_close(again.action.w_reg, model.action.w_reg)
    assert again.causal_config.value_calibration == model.causal_config.value_calibration


def test_refuses_what_it_cannot_train(tmp_path, qwen_tokenizer):
    base = build_tiny_qwen("qwen2")
    rows = build_corpus("sunspots")["train"].select(range(8))
    with pytest.raises(TypeError, match="CausalModel"):
        CausalSFTTrainer(model=base, args=_sft_args(tmp_path), train_dataset=rows, processing_class=qwen_tokenizer)
    model = get_causal_model(base, CausalAdapterConfig(), tokenizer=qwen_tokenizer)
    with pytest.raises(ValueError, match="packing"):
        CausalSFTTrainer(model=model, args=_sft_args(tmp_path, packing=True), train_dataset=rows,
                         processing_class=qwen_tokenizer)
    with pytest.raises(ValueError, match="processing_class"):
        CausalSFTTrainer(model=model, args=_sft_args(tmp_path), train_dataset=rows)
