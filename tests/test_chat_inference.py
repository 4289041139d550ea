"""Inference through the chat template and batched generation (docs/chat.md): `generate_batched` equal to
generating one prompt at a time, conversations in `generate` / `predict` / `eval` (the command line in-process),
with the real Qwen3 tokenizer (its chat template) and the embedded tiny base."""
import json

import pytest
import torch

from causal_adapter import CausalAdapterConfig, get_causal_model
from causal_adapter.commands.main import main
from causal_adapter.data.conversations import generation_prompt, inference_prompt
from causal_adapter.modeling.generation import generate, generate_batched
from causal_adapter.saving.assets import build_tiny_qwen
from test_generation import perturb, stir

TINY32 = ["--tiny-hidden-size", "32", "--tiny-layers", "1"]
OFF = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # the generation prompt, thinking off
ON = "<|im_start|>assistant\n"  # thinking on
PROMPTS = [  # very different lengths, numbers in most
    "Yearly sunspot numbers. 1969: 105.5; 1970: 104.5; 1971: 66.6; 1972: 68.9; 1973: 38; 1974: 34.5; 1975:",
    "x",
    "The price was 99.9 yuan and then",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z and 1 2 3",
    "Hello there, how are",
    "3 apples and 4.5 pears cost",
]
#: float32 values (loc_Y, scale_Y, the emitted value, P_k) of a batched row vs the same prompt alone: a different
#: batch shape changes float rounding only (measured, batch sizes 2/4/6, three modes: at most 3.5e-7 relative;
#: float64: 3.2e-16)
RTOL = {torch.float32: 2e-6, torch.float64: 1e-12}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def base():
    return stir(build_tiny_qwen("qwen3", hidden_size=32, num_layers=1, seed=3), seed=1, std=0.1)


def numeric_model(base, tok, layout=True, num_bias=3.5):
    """Heads that write numbers and text (deterministic mode too: thresholds 0, a <NUM> bias), with the
    number layout of training (a `<NUM>` after a non-space token is written as " " first)."""
    model = get_causal_model(base, CausalAdapterConfig(gamma0=0.3, threshold_init=0.0), tokenizer=tok)
    perturb(model, seed=0, num_bias=num_bias)
    if layout:
        model.causal_config.number_prefix_id = 220
        model.causal_config.number_contexts = [220]
    return model.eval()


def assert_same_row(one, row, rtol):
    """`row` (from a batch) is `one` (the prompt alone): same tokens, texts, stops; values to float rounding."""
    assert row.texts == one.texts
    assert torch.equal(row.sequences, one.sequences) and torch.equal(row.attention_mask, one.attention_mask)
    assert torch.equal(row.new_tokens, one.new_tokens) and torch.equal(row.lengths, one.lengths)
    assert torch.equal(row.finished, one.finished)
    torch.testing.assert_close(row.new_values, one.new_values, rtol=rtol, atol=0)
    torch.testing.assert_close(row.token_probs, one.token_probs, rtol=rtol, atol=1e-12)
    assert len(row.numbers[0]) == len(one.numbers[0])
    for a, b in zip(row.numbers[0], one.numbers[0]):
        assert (a["position"], a["index"], a["text"]) == (b["position"], b["index"], b["text"])
        for k in ("value", "exact", "loc", "scale"):
            assert a[k] == pytest.approx(b[k], rel=rtol)
        for k in ("interval_50", "interval_90"):
            assert a[k] == pytest.approx(b[k], rel=rtol)


# --------------------------------------------------------------------------- batched == one by one
@pytest.mark.parametrize("mode,kw", [("deterministic", {}), ("softmax", {}), ("softmax", {"repetition_penalty": 1.3})])
def test_batched_generation_equals_one_prompt_at_a_time(mode, kw, base, qwen_tokenizer):
    tok = qwen_tokenizer
    model = numeric_model(base, tok, num_bias=3.5 if mode == "deterministic" else 1.6)  # numbers and text
    alone = [generate(model, p, tokenizer=tok, mode=mode, max_new_tokens=8, **kw) for p in PROMPTS]
    # an eos (neither <NUM> nor " ") that a row writes mid-way: rows of a batch stop at different steps
    eos = next(t for o in alone for t in o.new_tokens[0, 3:].tolist() if t not in (model.num_token_id, 220))
    alone = [generate(model, p, tokenizer=tok, mode=mode, max_new_tokens=8, eos_token_id=eos, **kw) for p in PROMPTS]
    batched = generate_batched(model, PROMPTS, tokenizer=tok, batch_size=4, mode=mode, max_new_tokens=8,
                               eos_token_id=eos, **kw)
    assert len(batched) == len(PROMPTS)
    for one, row in zip(alone, batched):
        assert_same_row(one, row, RTOL[torch.float32])
    # the test exercises what it claims: numbers written (with the layout's " " first), stops, left padding
    assert sum(len(o.numbers[0]) for o in alone) >= 3 and any(not o.numbers[0] for o in alone)
    assert any(o.finished[0] for o in alone) and not all(o.finished[0] for o in alone)
    lengths = [o.sequences.shape[1] - o.new_tokens.shape[1] for o in alone]
    assert max(lengths) > 5 * min(lengths)
    # one batch of all prompts in input order (no sorting) gives the same rows too
    whole = generate(model, PROMPTS, tokenizer=tok, mode=mode, max_new_tokens=8, eos_token_id=eos, **kw)
    for b, one in enumerate(alone):
        assert_same_row(one, whole.row(b), RTOL[torch.float32])


def test_batched_generation_float64_to_rounding(qwen_tokenizer):
    tok = qwen_tokenizer
    base64 = stir(build_tiny_qwen("qwen3", hidden_size=32, num_layers=1, seed=3, dtype=torch.float64), seed=1, std=0.1)
    model = numeric_model(base64, tok, num_bias=1.6)
    alone = [generate(model, p, tokenizer=tok, mode="softmax", max_new_tokens=6) for p in PROMPTS]
    batched = model.generate_batched(PROMPTS, tok, batch_size=3, mode="softmax", max_new_tokens=6)
    assert sum(len(o.numbers[0]) for o in alone) >= 3
    for one, row in zip(alone, batched):
        assert_same_row(one, row, RTOL[torch.float64])


def test_repetition_penalty_does_not_see_the_left_padding(base, qwen_tokenizer):
    """transformers gives the logits processors the padded ids, so a padded row's pad token is penalised as if
    the row had written it: here the pad token is the short prompt's greedy choice by a margin the penalty undoes."""
    tok = qwen_tokenizer
    model = numeric_model(base, tok, layout=False)
    pad = tok.pad_token_id
    short, long = "Hello there", PROMPTS[0]
    from causal_adapter.numbers import NumberTokenizer

    enc = NumberTokenizer(tok)([short])
    with torch.no_grad():
        loc_S = model(enc["input_ids"], enc["numeric_values"], enc["attention_mask"], return_scores=True).loc_S[0, -1]
    top = float(loc_S[torch.arange(loc_S.numel()) != pad].max())
    assert top > 0  # the penalty divides a positive score by 1.3
    with torch.no_grad():
        model.action.b_cls[pad] += top + 0.05 * top - float(loc_S[pad])  # pad first, by 5%
    kw = dict(tokenizer=tok, mode="softmax", max_new_tokens=3, repetition_penalty=1.3, eos_token_id=[])
    one = generate(model, short, **kw)
    assert int(one.new_tokens[0, 0]) == pad
    batched = generate_batched(model, [short, long], batch_size=2, **kw)
    assert_same_row(one, batched[0], RTOL[torch.float32])


def test_generate_batched_checks_its_arguments(base, qwen_tokenizer):
    model = numeric_model(base, qwen_tokenizer)
    with pytest.raises(ValueError, match="prompt 1 must be a non-empty string"):
        generate_batched(model, ["a", ""], tokenizer=qwen_tokenizer)
    with pytest.raises(ValueError, match="does not take max_length"):
        generate_batched(model, ["a"], tokenizer=qwen_tokenizer, max_length=9)
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        generate_batched(model, ["a"], tokenizer=qwen_tokenizer, batch_size=0)


# --------------------------------------------------------------------------- conversations -> prompts
def test_inference_prompt_of_a_conversation(qwen_tokenizer):
    tok = qwen_tokenizer
    user = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3.5?"}]
    reply = {"role": "assistant", "content": "It is 5.5, or 6 rounded."}
    assert inference_prompt(tok, user) == generation_prompt(tok, user)
    assert inference_prompt(tok, user).endswith(OFF)
    assert inference_prompt(tok, user, enable_thinking=True).endswith("<|im_end|>\n" + ON)
    # a final assistant reply is continued, as transformers' continue_final_message renders it
    assert inference_prompt(tok, user + [reply]) == tok.apply_chat_template(
        user + [reply], tokenize=False, continue_final_message=True, enable_thinking=False)
    assert inference_prompt(tok, user + [reply]) == generation_prompt(tok, user) + reply["content"]
    # predict: the reply's text before its first number
    assert inference_prompt(tok, user + [reply], to_first_number=True) == generation_prompt(tok, user) + "It is "
    with pytest.raises(ValueError, match="row 7: message 1 has an unknown role 'bot'"):
        inference_prompt(tok, [user[0], {"role": "bot", "content": "x"}], row=7)


# --------------------------------------------------------------------------- the command line
@pytest.fixture(scope="module")
def saved(tmp_path_factory, qwen_tokenizer):
    """(adapter dir, the loaded model) on the CLI's tiny base (qwen2, 32, 1 layer): value units, a calibration
    map, and heads that write numbers in softmax mode."""
    from causal_adapter.modeling.intervals import fit_calibration
    from causal_adapter.saving.assets import load_base
    from causal_adapter.model import CausalModel

    tiny, _ = load_base(None, "qwen2", "float32", 32, 1)
    model = get_causal_model(tiny, tokenizer=qwen_tokenizer)
    perturb(model, seed=1, num_bias=25.0, b_reg=0.0)
    model.set_value_units(39.0, 38.0, 1)
    y = torch.randn(200, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 2.0
    model.causal_config.value_calibration = fit_calibration(y, torch.zeros(200), torch.ones(200))
    path = tmp_path_factory.mktemp("chat") / "adapter"
    model.save_pretrained(path)
    fresh, _ = load_base(None, "qwen2", "float32", 32, 1)
    return path, CausalModel.from_pretrained(fresh, path, tokenizer=qwen_tokenizer)


class Spy:
    """Records the prompts the command hands to `generate_batched` (what the model sees)."""

    def __init__(self, monkeypatch):
        import causal_adapter.commands.generate as command

        self.prompts, real = [], command.generate_batched

        def spy(model, prompts, **kw):
            self.prompts.append(list(prompts))
            return real(model, prompts, **kw)

        monkeypatch.setattr(command, "generate_batched", spy)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_generate_messages_applies_the_template_with_the_generation_prompt(monkeypatch, capsys, qwen_tokenizer):
    spy = Spy(monkeypatch)
    messages = [{"role": "user", "content": "What is 2 + 3.5?"}]
    args = ["generate", *TINY32, "--messages", json.dumps(messages), "--max-new-tokens", "2", "--no-progress"]
    assert main(args) == 0
    assert main(args + ["--enable-thinking"]) == 0
    off, on = spy.prompts[0][0], spy.prompts[1][0]
    assert off == generation_prompt(qwen_tokenizer, messages) and off.endswith("2 + 3.5?<|im_end|>\n" + OFF)
    assert on == generation_prompt(qwen_tokenizer, messages, enable_thinking=True)
    assert on.endswith("2 + 3.5?<|im_end|>\n" + ON)
    assert capsys.readouterr().out.startswith(off)  # printed: the prompt the model saw, then its text


def test_generate_input_file_rows_equal_one_by_one(tmp_path, saved, monkeypatch, capsys, qwen_tokenizer):
    adapter, model = saved
    tok = qwen_tokenizer
    chats = [[{"role": "user", "content": "Sunspots in 1975?"}],
             [{"role": "system", "content": "Numbers only."}, {"role": "user", "content": "2 + 3.5 = ?"},
              {"role": "assistant", "content": "The sum is"}],
             [{"role": "bot", "content": "x"}]]
    rows = [{"prompt": PROMPTS[0]}, {"messages": chats[0]}, {"prompt": "x"}, {"prompt": None},
            {"messages": chats[1]}, {"messages": chats[2]}, {"prompt": PROMPTS[2]}]
    data, out = _jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    spy = Spy(monkeypatch)
    args = ["generate", "--adapter", str(adapter), *TINY32, "--input-file", str(data), "--mode", "softmax",
            "--max-new-tokens", "6", "--batch-size", "2"]
    assert main(args + ["--output", str(out)]) == 0
    err = capsys.readouterr().err
    assert "row 3: column 'prompt' is null: skipped" in err
    assert "row 5: message 0 has an unknown role 'bot'" in err
    assert "generate: 5 of 7 rows written to" in err and "(2 skipped, see above)" in err
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["row"] for r in written] == [0, 1, 2, 4, 6]
    expected = [PROMPTS[0], generation_prompt(tok, chats[0]), "x",
                generation_prompt(tok, chats[1][:2]) + "The sum is", PROMPTS[2]]
    assert spy.prompts[0] == expected
    n_values = 0
    for prompt, r in zip(expected, written):
        assert set(r) == {"row", "completion", "values", "finished"}
        one = generate(model, prompt, tokenizer=tok, mode="softmax", max_new_tokens=6)
        assert r["completion"] == one.texts[0] and r["finished"] == bool(one.finished[0])
        assert len(r["values"]) == len(one.numbers[0])
        for v, n in zip(r["values"], one.numbers[0]):
            n_values += 1
            assert set(v) == {"text", "value", "loc", "scale", "p_num", "lower_50", "upper_50", "lower_90",
                              "upper_90", "raw_lower_50", "raw_upper_50", "raw_lower_90", "raw_upper_90"}
            assert v["text"] == n["text"] and v["text"] in r["completion"]
            for k in ("value", "loc", "scale", "p_num"):
                assert v[k] == pytest.approx(n[k], rel=RTOL[torch.float32])
            assert (v["lower_90"], v["upper_90"]) == pytest.approx(n["interval_90"], rel=RTOL[torch.float32])
            assert v["lower_90"] < v["lower_50"] < v["loc"] < v["upper_50"] < v["upper_90"]
            assert v["upper_90"] - v["lower_90"] < v["raw_upper_90"] - v["raw_lower_90"]  # calibrated, not raw
    assert n_values >= 3
    # without --output: the same rows as jsonl on stdout, the progress bar (stderr) off with --no-progress
    assert main(args + ["--no-progress"]) == 0
    captured = capsys.readouterr()
    assert [json.loads(line) for line in captured.out.splitlines()] == written
    assert "generate:" in captured.err and "row/s" not in captured.err


def test_generate_errors_are_one_line(tmp_path, monkeypatch, capsys, qwen_tokenizer):
    base_args = ["generate", *TINY32, "--max-new-tokens", "1", "--no-progress"]
    assert main(base_args + ["--messages", '[{"role": "user", "content": "hi"}']) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("causal-adapter generate: error: --messages is not valid JSON") and "\n" not in err
    assert main(base_args + ["--messages", '[{"role": "bot", "content": "hi"}]']) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("causal-adapter generate: error: --messages: message 0 has an unknown role 'bot'; known roles: "
                   "system, user, assistant, tool")
    assert main(base_args + ["some prompt", "--enable-thinking"]) == 1
    assert "--enable-thinking / --chat-template render conversations" in capsys.readouterr().err
    # a base without a chat template: a one-line error, unless --chat-template gives one
    import causal_adapter.commands.generate as command

    real = command.load_base_from_args

    def no_template(args):
        model, tok = real(args)
        tok.chat_template = None
        return model, tok

    monkeypatch.setattr(command, "load_base_from_args", no_template)
    messages = ["--messages", '[{"role": "user", "content": "hi"}]']
    assert main(base_args + messages) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("causal-adapter generate: error: the tokenizer has no chat template") and "\n" not in err
    assert "--chat-template FILE" in err
    template = tmp_path / "chat_template.jinja"
    template.write_text(qwen_tokenizer.chat_template)
    spy = Spy(monkeypatch)
    assert main(base_args + messages + ["--chat-template", str(template)]) == 0
    assert spy.prompts[0][0].endswith("hi<|im_end|>\n" + OFF)
    assert main(base_args + messages + ["--chat-template", str(tmp_path / "missing.jinja")]) == 1
    assert "--chat-template" in capsys.readouterr().err


def test_predict_on_conversations(tmp_path, saved, capsys, qwen_tokenizer):
    adapter, model = saved
    tok = qwen_tokenizer
    user = [{"role": "user", "content": "How many sunspots in 1975? 1974 had 34.5."}]
    answered = user + [{"role": "assistant", "content": "About 15.5 (1974: 34.5)."}]
    rows = [{"messages": user}, {"messages": answered}, {"prompt": "1978: 92.5; 1979:", "completion": " 155.4"},
            {"messages": [{"role": "user"}]}]
    data, out = _jsonl(tmp_path / "chat.jsonl", rows), tmp_path / "pred.jsonl"
    assert main(["predict", str(adapter), *TINY32, "--data-file", str(data), "--output", str(out)]) == 0
    err = capsys.readouterr().err
    assert "row 3: message 0 (user) has no text content" in err and "skipped" in err
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["row"] for r in got] == [0, 1, 2]
    # where the value is read: after the generation prompt; before the reply's first number
    expected = [generation_prompt(tok, user), generation_prompt(tok, user) + "About ", "1978: 92.5; 1979: "]
    direct = model.predict_values(expected, tokenizer=tok)
    for r, d in zip(got, direct):
        for k in ("value", "scale", "p_num", "lower_90", "upper_90"):
            assert r[k] == pytest.approx(d[k], rel=1e-6, abs=1e-6)
    assert got[0]["value"] != pytest.approx(got[1]["value"], rel=1e-6)  # a different position, a different value
    # thinking on: the reply after "<|im_start|>assistant\n" and its empty think block
    assert main(["predict", str(adapter), *TINY32, "--data-file", str(data), "--enable-thinking"]) == 0
    on = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    ref = model.predict_values([generation_prompt(tok, user, enable_thinking=True)], tokenizer=tok)[0]
    assert on[0]["value"] == pytest.approx(ref["value"], rel=1e-6, abs=1e-6)


def test_eval_on_conversations_scores_the_assistant_numbers(tmp_path, saved, capsys, qwen_tokenizer):
    adapter, model = saved
    chats = [[{"role": "user", "content": f"Sunspots in {1970 + k}? The year before had {30 + k}.5."},
              {"role": "assistant", "content": f"About {40 + 3 * k}.5 spots."}] for k in range(4)]
    data = _jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in chats])
    assert main(["eval", str(adapter), *TINY32, "--data-file", str(data), "--output", str(tmp_path / "m.json")]) == 0
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["num_targets"] == 4  # the replies' numbers; the users' numbers are inputs, not targets
    # the value eval scores is the one predict reads before each reply's number
    pred = model.predict_values([inference_prompt(qwen_tokenizer, m, to_first_number=True) for m in chats],
                                tokenizer=qwen_tokenizer)
    targets = [40 + 3 * k + 0.5 for k in range(4)]
    mae = sum(abs(p["value"] - y) for p, y in zip(pred, targets)) / 4
    assert metrics["value_mae"] == pytest.approx(mae, rel=1e-5)


CHAT_DOC = __import__("pathlib").Path(__file__).resolve().parents[1] / "docs" / "chat.md"
TOY = {"--max-steps 200": "--max-steps 2 --max-train-samples 48 --max-eval-samples 16 --no-plot --no-progress"}


def _doc_block(language: str) -> str:
    text = CHAT_DOC.read_text().split("## Recipes", 1)[1].split("\n## ", 1)[0]
    return text.split(f"```{language}\n", 1)[1].split("```", 1)[0]


def test_documented_cli_recipe_runs(tmp_path, monkeypatch, capsys):
    """docs/chat.md's `train` recipe, command by command, at toy size (TOY's flags): a messages corpus trained,
    predicted and generated from through the template."""
    import shlex

    monkeypatch.chdir(tmp_path)
    commands = [line.split("  #")[0] for line in _doc_block("bash").splitlines() if line.strip()]
    assert [c.split()[1] for c in commands] == ["data", "train", "predict", "generate"]
    for command in commands:
        for doc, toy in TOY.items():
            command = command.replace(doc, toy)
        assert main(shlex.split(command)[1:]) == 0, command
    rows = [json.loads(line) for line in (tmp_path / "chat-values.jsonl").read_text().splitlines()]
    assert len(rows) == 226 and all(r["lower_90"] <= r["value"] <= r["upper_90"] for r in rows)
    assert "Yearly sunspot numbers" in capsys.readouterr().out  # generate printed the conversation and its reply
    assert (tmp_path / "chat-run" / "adapter" / "causal_adapter_model.safetensors").is_file()
