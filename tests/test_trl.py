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


def test_documented_chat_recipe_runs(tmp_path, monkeypatch):
    """docs/chat.md's CausalSFTTrainer recipe on the bundled chat corpus, at 2 steps: messages rows trained,
    the adapter saved alone, reloaded, a value read where the last reply's number stands."""
    from causal_adapter.data.corpora import chat_corpus

    doc = (DOCS.parent / "chat.md").read_text(encoding="utf-8").split("## Recipes", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", doc, flags=re.S)
    assert "max_steps=200" in code
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for split, ds in chat_corpus(series=["sunspots"]).items():  # the `causal-adapter data chat data` files, one series
        ds.to_json(str(tmp_path / "data" / f"chat_{split}.jsonl"), lines=True)
    namespace: dict = {}
    exec(compile(code.replace("max_steps=200", "max_steps=2"), str(DOCS.parent / "chat.md"), "exec"), namespace)
    adapter = tmp_path / "chat-sft" / "adapter"
    assert {p.name for p in adapter.iterdir()} <= ADAPTER_FILES
    (row,) = namespace["reloaded"].predict_values(
        [namespace["inference_prompt"](namespace["tok"], namespace["chat"], to_first_number=True)],
        tokenizer=namespace["tok"])
    assert row["lower_90"] < row["value"] < row["upper_90"], row


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
    with pytest.raises(ValueError, match="packing_strategy"):  # rows cut, attending across (test_packing.py: "bfd")
        CausalSFTTrainer(model=model, args=_sft_args(tmp_path, packing=True, packing_strategy="wrapped"),
                         train_dataset=rows, processing_class=qwen_tokenizer)
    with pytest.raises(ValueError, match="processing_class"):
        CausalSFTTrainer(model=model, args=_sft_args(tmp_path), train_dataset=rows)


# --------------------------------------------------------------------------- which tokens the trainer trains
def _trained_runs(row, ntok) -> list[str]:
    """The decoded text of each run of consecutive labelled positions of a tokenised row."""
    runs, current = [], []
    for i, label in enumerate(row["labels"]):
        if label != -100:
            current.append(i)
        elif current:
            runs.append(current)
            current = []
    runs += [current] if current else []
    return [ntok.decode([row["input_ids"][i] for i in r], [row["numeric_values"][i] for i in r]) for r in runs]


@pytest.fixture(scope="module")
def small_model(qwen_tokenizer):
    return get_causal_model(build_tiny_qwen("qwen2", hidden_size=32, num_layers=1), CausalAdapterConfig(),
                            tokenizer=qwen_tokenizer)


def test_prompt_tokens_get_no_loss_unless_completion_only_loss_is_false(tmp_path, qwen_tokenizer, small_model):
    from datasets import Dataset

    from causal_adapter.numbers import NumberTokenizer

    tok, k = qwen_tokenizer, small_model.num_token_id
    rows = Dataset.from_dict({"prompt": ["Sales in 2024: 12.5; in 2025:"], "completion": [" 14"]})
    ntok = NumberTokenizer(tok, k)
    prompt, completion = ntok.encode(rows[0]["prompt"]).input_ids, ntok.encode(" 14").input_ids + [tok.eos_token_id]
    for options, prompt_labels in (({}, [-100] * len(prompt)),  # TRL's default for prompt/completion rows
                                   ({"completion_only_loss": True}, [-100] * len(prompt)),
                                   ({"completion_only_loss": False}, [-100 if t == k else t for t in prompt])):
        trainer = CausalSFTTrainer(model=small_model, args=_sft_args(tmp_path, **options), train_dataset=rows,
                                   eval_dataset=rows, processing_class=tok)
        row = trainer.train_dataset[0]
        assert row["input_ids"] == prompt + completion
        assert row["labels"] == prompt_labels + completion, options
        assert row["label_values"][-2] == pytest.approx(14.0) and row["numeric_values"][prompt.index(k)] == 2024.0
        # evaluation rows keep the completion-only labels whatever the option
        assert trainer.eval_dataset[0]["labels"] == [-100] * len(prompt) + completion


def test_conversations_train_the_assistant_replies_and_their_end_marks(tmp_path, qwen_tokenizer, small_model):
    from datasets import Dataset

    from causal_adapter.numbers import NumberTokenizer

    tok, k = qwen_tokenizer, small_model.num_token_id
    ntok = NumberTokenizer(tok, k)
    convo = [{"role": "system", "content": "You add numbers."},
             {"role": "user", "content": "What is 12 plus 30?"}, {"role": "assistant", "content": "It is 42."},
             {"role": "user", "content": "And 2.5 more?"}, {"role": "assistant", "content": "Then 44.5."}]
    replies = ["It is 42.<|im_end|>", "Then 44.5.<|im_end|>"]
    messages = Dataset.from_list([{"messages": convo}] * 8)
    pc = Dataset.from_list([{"prompt": convo[:4], "completion": convo[4:]}] * 8)
    # TRL's defaults (assistant_only_loss=False) and assistant_only_loss=True: the replies only
    for options in ({}, {"assistant_only_loss": True}, {"completion_only_loss": False, "assistant_only_loss": True}):
        trainer = CausalSFTTrainer(model=small_model, args=_sft_args(tmp_path, **options), train_dataset=messages,
                                   eval_dataset=pc, processing_class=tok)
        assert _trained_runs(trainer.train_dataset[0], ntok) == replies, options
        assert _trained_runs(trainer.eval_dataset[0], ntok) == replies[1:]  # conversational prompt/completion
    assert trainer.args.assistant_only_loss is True  # the user's setting is back after TRL's __init__
    # completion_only_loss=False with assistant_only_loss=False: every text token; the user's numbers never
    trainer = CausalSFTTrainer(model=small_model, args=_sft_args(tmp_path, completion_only_loss=False),
                               train_dataset=messages, processing_class=tok)
    row = trainer.train_dataset[0]
    nums = [(v, lab != -100) for t, v, lab in zip(row["input_ids"], row["numeric_values"], row["labels"]) if t == k]
    assert nums == [(12.0, False), (30.0, False), (42.0, True), (2.5, False), (44.5, True)]
    assert all(lab != -100 for t, lab in zip(row["input_ids"], row["labels"]) if t != k)
    # the trainer runs on conversations (the value head fitted on the replies' numbers), with a jinja template file
    template = tmp_path / "chatml.jinja"
    template.write_text("{%- for m in messages %}"
                        "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
                        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    trainer = CausalSFTTrainer(model=small_model, args=_sft_args(tmp_path, steps=2, chat_template_path=str(template)),
                               train_dataset=messages, eval_dataset=pc, processing_class=tok)
    assert _trained_runs(trainer.train_dataset[0], ntok) == replies
    trainer.train()
    assert small_model.causal_config.value_calibration is not None
    with pytest.raises(ValueError, match="chat_template_path as a jinja file"):
        CausalSFTTrainer(model=small_model, args=_sft_args(tmp_path, chat_template_path="Qwen/Qwen3-8B"),
                         train_dataset=messages, processing_class=tok)
