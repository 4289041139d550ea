"""Conversations in every training entry (docs/chat.md): TRL's formats (``messages``, conversational prompt/completion)
rendered with the REAL Qwen3 chat template, the assistant-only mask, thinking, numbers as values, the errors,
and `train()` / `causal-adapter train` on conversation files. CausalSFTTrainer's conversations: tests/test_trl.py."""
import json
import logging

import datasets
import pytest

from causal_adapter.config import IGNORE_INDEX
from causal_adapter.data import conversations
from causal_adapter.data.pipeline import number_layout, tokenize_dataset
from causal_adapter.numbers import NumberTokenizer

datasets.disable_progress_bars()

SYSTEM = {"role": "system", "content": "You are a careful accountant."}
TWO_EXCHANGES = [
    SYSTEM,
    {"role": "user", "content": "I paid 12.5 for lunch and 7 for coffee. Total?"},
    {"role": "assistant", "content": "The total is 19.5."},
    {"role": "user", "content": "And with a 3 tip?"},
    {"role": "assistant", "content": "Then it is 22.5 in all."},
]
REPLIES = [m["content"] for m in TWO_EXCHANGES if m["role"] == "assistant"]
END = "<|im_end|>"
# Qwen2.5's ChatML, without {% generation %} markers (its default system message included)
CHATML = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def ntok(qwen_tokenizer):
    return NumberTokenizer(qwen_tokenizer)


def rows(*conversations_, column="messages"):
    return datasets.Dataset.from_list([{column: c} for c in conversations_])


def trained_runs(row, ntok) -> list[str]:
    """The decoded text of each run of consecutive labelled positions of a tokenised row."""
    runs, current = [], []
    for i, label in enumerate(row["labels"]):
        if label != IGNORE_INDEX:
            assert label == row["input_ids"][i]  # labels are aligned with input_ids (the model shifts)
            current.append(i)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [ntok.decode([row["input_ids"][i] for i in r], [row["numeric_values"][i] for i in r]) for r in runs]


def numbers(row, ntok):
    """[(value, labelled, label_value)] of every <NUM> of a tokenised row."""
    k = ntok.num_token_id
    return [(v, lab != IGNORE_INDEX, lv) for t, v, lab, lv in
            zip(row["input_ids"], row["numeric_values"], row["labels"], row["label_values"]) if t == k]


# --------------------------------------------------------------------------- the mask
def test_two_exchanges_train_exactly_the_two_replies_and_their_end_marks(ntok, qwen_tokenizer):
    row = tokenize_dataset(rows(TWO_EXCHANGES), ntok, add_eos_token=True)[0]
    assert trained_runs(row, ntok) == [r + END for r in REPLIES]
    # the input is the template's own render (thinking off), numbers as values; no EOS appended after it
    render = qwen_tokenizer.apply_chat_template(TWO_EXCHANGES, tokenize=False, enable_thinking=False)
    assert ntok.decode(row["input_ids"], row["numeric_values"]) == render
    assert render.endswith(END + "\n") and row["labels"][-1] == IGNORE_INDEX  # the newline after the mark
    # the user's numbers are read as values, never regression targets; the assistant's are labelled with them
    assert numbers(row, ntok) == [(12.5, False, 0.0), (7.0, False, 0.0), (19.5, True, 19.5), (3.0, False, 0.0),
                                  (22.5, True, 22.5)]


def test_thinking_off_drops_reasoning_and_never_trains_the_empty_think_block(ntok):
    convo = [*TWO_EXCHANGES[:4], {**TWO_EXCHANGES[4], "reasoning_content": "19.5 plus 3 makes 22.5."}]
    row = tokenize_dataset(rows(convo), ntok)[0]
    text = ntok.decode(row["input_ids"], row["numeric_values"])
    assert "<think>\n\n</think>\n\n" + REPLIES[1] in text and "makes" not in text  # reasoning dropped
    assert trained_runs(row, ntok) == [r + END for r in REPLIES]
    # reasoning written inline in the content (a <think> block) is dropped the same way
    inline = [*TWO_EXCHANGES[:4], {"role": "assistant", "content": "<think>\n19.5 plus 3.\n</think>\n\n" + REPLIES[1]}]
    assert trained_runs(tokenize_dataset(rows(inline), ntok)[0], ntok) == [r + END for r in REPLIES]


def test_thinking_on_trains_the_last_turns_think_block(ntok):
    convo = [*TWO_EXCHANGES[:4], {**TWO_EXCHANGES[4], "reasoning_content": "19.5 plus 3 makes 22.5."}]
    row = tokenize_dataset(rows(convo), ntok, enable_thinking=True)[0]
    assert trained_runs(row, ntok) == [
        REPLIES[0] + END, "<think>\n19.5 plus 3 makes 22.5.\n</think>\n\n" + REPLIES[1] + END]
    # the reasoning's numbers are the assistant's: labelled, with their values
    assert [v for v, labelled, _ in numbers(row, ntok) if labelled] == [19.5, 19.5, 3.0, 22.5, 22.5]
    # thinking on and no reasoning in the data: the empty block the model must write is trained
    plain = tokenize_dataset(rows(TWO_EXCHANGES), ntok, enable_thinking=True)[0]
    assert trained_runs(plain, ntok)[-1] == "<think>\n\n</think>\n\n" + REPLIES[1] + END


def test_chatml_template_without_generation_markers_trains_the_same_replies(ntok, qwen_tokenizer):
    assert "{% generation %}" not in CHATML
    no_system = TWO_EXCHANGES[1:]
    row = tokenize_dataset(rows(no_system), ntok, chat_template=CHATML)[0]
    assert trained_runs(row, ntok) == [r + END for r in REPLIES]
    text = ntok.decode(row["input_ids"], row["numeric_values"])
    assert text == qwen_tokenizer.apply_chat_template(no_system, tokenize=False, chat_template=CHATML)
    assert text.startswith("<|im_start|>system\nYou are Qwen")  # the template's default system turn: not trained


def test_train_all_tokens_labels_every_text_token_but_no_number_outside_the_replies(ntok):
    row = tokenize_dataset(rows(TWO_EXCHANGES), ntok, assistant_only_loss=False)[0]
    k = ntok.num_token_id
    assert row["labels"] == [IGNORE_INDEX if t == k and not labelled else t for t, labelled in
                             zip(row["input_ids"], _inside_replies(row, ntok))]
    assert numbers(row, ntok) == [(12.5, False, 0.0), (7.0, False, 0.0), (19.5, True, 19.5), (3.0, False, 0.0),
                                  (22.5, True, 22.5)]


def _inside_replies(row, ntok) -> list[bool]:
    """Per position: is it part of an assistant reply (+ end mark)? From the assistant-only tokenisation."""
    only = tokenize_dataset(rows(TWO_EXCHANGES), ntok)[0]
    assert only["input_ids"] == row["input_ids"]
    return [lab != IGNORE_INDEX for lab in only["labels"]]


def test_conversational_prompt_completion_trains_the_completions_turns_only(ntok):
    ds = datasets.Dataset.from_list([{"prompt": TWO_EXCHANGES[:4], "completion": TWO_EXCHANGES[4:]}])
    row = tokenize_dataset(ds, ntok)[0]
    assert set(tokenize_dataset(ds, ntok).column_names) == {"input_ids", "numeric_values", "labels", "label_values"}
    assert trained_runs(row, ntok) == [REPLIES[1] + END]
    assert [v for v, labelled, _ in numbers(row, ntok) if labelled] == [22.5]
    # the same conversation as messages renders the same tokens
    assert tokenize_dataset(rows(TWO_EXCHANGES), ntok)[0]["input_ids"] == row["input_ids"]


def test_system_and_tool_messages_pass_through_untrained(ntok):
    call = {"type": "function", "function": {"name": "get_temperature", "arguments": {"city": "Paris"}}}
    convo = [SYSTEM,
             {"role": "user", "content": "How warm is Paris?"},
             {"role": "assistant", "content": "", "tool_calls": [call]},
             {"role": "tool", "content": "{\"celsius\": 21.5}"},
             {"role": "assistant", "content": "It is 21.5 degrees."}]
    row = tokenize_dataset(rows(convo), ntok)[0]
    text = ntok.decode(row["input_ids"], row["numeric_values"])
    assert SYSTEM["content"] in text and "<tool_response>\n{\"celsius\": 21.5}\n</tool_response>" in text
    assert trained_runs(row, ntok) == [
        '<tool_call>\n{"name": "get_temperature", "arguments": {"city": "Paris"}}\n</tool_call>' + END,
        "It is 21.5 degrees." + END]
    assert numbers(row, ntok) == [(21.5, False, 0.0), (21.5, True, 21.5)]  # the tool's number: a value only


def test_number_layout_of_chat_rows(ntok):
    ds = tokenize_dataset(rows(*[[{"role": "user", "content": f"Add {a} and 2."},
                                  {"role": "assistant", "content": f"The sum is {a + 2}."}] for a in range(5)]), ntok)
    prefix, contexts = number_layout(ds, ntok.num_token_id, ntok.tokenizer)
    assert ntok.tokenizer.decode([prefix]) == " " and contexts == [prefix]  # the space before each reply's number


# --------------------------------------------------------------------------- truncation
def test_truncation_keeps_the_first_tokens_and_reports_the_count_for_every_format(ntok, caplog):
    full = tokenize_dataset(rows(TWO_EXCHANGES, TWO_EXCHANGES[:3]), ntok)
    n = len(full[1]["input_ids"])  # the shorter row fits, the longer one is cut
    with caplog.at_level(logging.WARNING, logger="causal_adapter"):
        cut = tokenize_dataset(rows(TWO_EXCHANGES, TWO_EXCHANGES[:3]), ntok, max_length=n)
    assert "1 of 2 rows were longer than max_length=%d tokens and were truncated" % n in caplog.text
    assert "__truncated__" not in cut.column_names
    for k in ("input_ids", "numeric_values", "labels", "label_values"):
        assert cut[0][k] == full[0][k][:n] and cut[1][k] == full[1][k]
    for ds, needle in ((datasets.Dataset.from_dict({"text": ["a 1 b 2 c 3 d", "a"]}), "1 of 2 rows"),
                       (datasets.Dataset.from_dict({"prompt": ["p 1 q 2 r", "s"], "completion": [" 4", " 5"]}),
                        "2 of 2 rows")):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="causal_adapter"):
            tokenize_dataset(ds, ntok, max_length=2)
        assert needle + " were longer than max_length=2" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="causal_adapter"):  # no row cut: no warning
        tokenize_dataset(rows(TWO_EXCHANGES), ntok, max_length=1000)
    assert "truncated" not in caplog.text


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize("convo, needle", [
    ([{"role": "system", "content": "s"}, {"role": "user", "content": "only a question"}],
     "row 1: the conversation has no assistant turn"),
    ([{"role": "user", "content": "hi"}, {"role": "bot", "content": "hello"}],
     "row 1: message 1 has an unknown role 'bot'; known roles: system, user, assistant, tool"),
    ([{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "hi"},
      {"role": "assistant", "content": "ok"}],
     "row 1: the conversation starts with an assistant turn"),
])
def test_bad_conversations_name_the_row(ntok, convo, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        tokenize_dataset(rows(TWO_EXCHANGES, convo), ntok)


def test_bad_templates_and_no_template_are_clear_errors(ntok, qwen_tokenizer, monkeypatch):
    with pytest.raises(ValueError, match="chat template failed to render .*TemplateSyntaxError"):
        tokenize_dataset(rows(TWO_EXCHANGES), ntok, chat_template="{% for m in messages %}{{ m.content }{% endfor %}")
    raising = CHATML.replace("{%- for message in messages %}", "{%- for message in messages %}{%- if 'forbidden' in "
                             "message['content'] %}{{ raise_exception('no forbidden words') }}{%- endif %}")
    bad = [{"role": "user", "content": "a forbidden question"}, {"role": "assistant", "content": "no"}]
    with pytest.raises(ValueError, match="row 1: the chat template failed to render .*no forbidden words"):
        tokenize_dataset(rows(TWO_EXCHANGES, bad), ntok, chat_template=raising)
    monkeypatch.setattr(qwen_tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match="the tokenizer has no chat template: give one as text .*--chat-template"):
        tokenize_dataset(rows(TWO_EXCHANGES), ntok)
    assert tokenize_dataset(rows(TWO_EXCHANGES[1:]), ntok, chat_template=CHATML)[0]["labels"]  # a template given


def test_conversational_completion_without_assistant_and_bad_tools(ntok):
    ds = datasets.Dataset.from_list([{"prompt": TWO_EXCHANGES[:2], "completion": [{"role": "user", "content": "?"}]}])
    with pytest.raises(ValueError, match="row 0: the completion has no assistant turn"):
        tokenize_dataset(ds, ntok)
    ds = datasets.Dataset.from_list([{"messages": TWO_EXCHANGES, "tools": "[{not json"}])
    with pytest.raises(ValueError, match="row 0: column 'tools' is not valid JSON"):
        tokenize_dataset(ds, ntok)


def test_a_bad_row_leaves_no_cache_file_half_written(ntok, tmp_path):
    from causal_adapter.data.pipeline import load_text_dataset

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in
                            (TWO_EXCHANGES, TWO_EXCHANGES, [{"role": "user", "content": "no reply"}])))
    cache = tmp_path / "cache"
    ds = load_text_dataset(str(data), cache_dir=str(cache))
    before = sorted(p.relative_to(cache) for p in cache.rglob("*") if p.is_file())
    with pytest.raises(ValueError, match="row 2: the conversation has no assistant turn"):
        tokenize_dataset(ds, ntok)
    assert sorted(p.relative_to(cache) for p in cache.rglob("*") if p.is_file()) == before
    good = tokenize_dataset(ds.select(range(2)), ntok)  # the good rows tokenise (and are cached) as usual
    assert trained_runs(good[1], ntok) == [r + END for r in REPLIES]


def test_streaming_conversations_and_their_truncation_report(ntok, tmp_path, caplog):
    from causal_adapter.data.pipeline import load_text_dataset

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in (TWO_EXCHANGES, TWO_EXCHANGES[:3])))
    stream = load_text_dataset(str(data), streaming=True)
    with caplog.at_level(logging.WARNING, logger="causal_adapter"):
        got = list(tokenize_dataset(stream, ntok, max_length=40))
    ref = tokenize_dataset(rows(TWO_EXCHANGES, TWO_EXCHANGES[:3]), ntok, max_length=40)
    assert [g["labels"] for g in got] == ref["labels"] and "__truncated__" not in got[0]
    assert "2 of 2 rows of a batch were longer than max_length=40" in caplog.text


def test_assistant_spans_after_a_tool_call_turn_start_at_the_call(qwen_tokenizer):
    """Qwen3 without thinking writes no think block before a reply a later user turn follows: the common prefix
    with the generation prompt (which has one) must not run on into the reply (``<t`` of ``<tool_call>``)."""
    call = {"type": "function", "function": {"name": "f", "arguments": {}}}
    convo = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]},
             {"role": "tool", "content": "1"}, {"role": "assistant", "content": "done"}]
    text, spans = conversations.assistant_spans(qwen_tokenizer, convo)
    assert text[spans[0][0]:spans[0][1]].startswith("<tool_call>")


# --------------------------------------------------------------------------- train() and the CLI
def sums(n, start=0, system=True):
    """`n` conversations asking for a sum (the reply's number is the sum of the user's two)."""
    out = []
    for i in range(start, start + n):
        a, b = 3 + 7 * i % 40, 5 + 11 * i % 30
        out.append([*([SYSTEM] if system else []), {"role": "user", "content": f"What is {a} plus {b}?"},
                    {"role": "assistant", "content": f"It is {a + b}."}])
    return out


def test_train_on_messages_rows_evaluates_assistant_only_labels(tmp_path, qwen_tokenizer):
    from causal_adapter.training.config import TrainConfig
    from causal_adapter.training.data import prepare_datasets
    from causal_adapter.training.loop import train

    train_rows, eval_rows = rows(*sums(16)), rows(*sums(8, start=16))
    config = TrainConfig(output_dir=str(tmp_path / "run"), tiny_hidden_size=32, tiny_layers=1, max_steps=2,
                         per_device_train_batch_size=4, plot=False, progress=False, assistant_only_loss=False)
    ntok = NumberTokenizer(qwen_tokenizer)
    train_ds, eval_ds, _ = prepare_datasets(config, ntok, train_rows, eval_rows)
    # training rows: every text token (train-all option), the user's numbers never; validation: the replies only
    assert trained_runs(eval_ds[0], ntok) == [sums(1, start=16)[0][-1]["content"] + END]
    assert sum(lab != IGNORE_INDEX for lab in train_ds[0]["labels"]) > len(train_ds[0]["labels"]) - 5
    assert [labelled for _, labelled, _ in numbers(train_ds[0], ntok)] == [False, False, True]
    result = train(None, config, train_dataset=train_rows, eval_dataset=eval_rows)
    metrics = result.eval_metrics
    assert metrics["num_targets"] == 8 and metrics["value_mae"] is not None  # the value head fitted on the replies
    assert result.model.causal_config.number_prefix_id is not None
    assert (tmp_path / "run" / "adapter" / "causal_adapter_model.safetensors").is_file()


def _write_jsonl(path, conversations_):
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations_))
    return str(path)


def test_cli_trains_on_messages_files_and_reports_truncated_rows(tmp_path, capsys, monkeypatch):
    from causal_adapter.commands.main import main

    long = [SYSTEM | {"content": "You are a careful accountant. " * 30}, *sums(1, system=False)[0]]
    train_file = _write_jsonl(tmp_path / "train.jsonl", [*sums(11, system=False), long])
    val_file = _write_jsonl(tmp_path / "val.jsonl", sums(4, start=11, system=False))
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    monkeypatch.setattr(logging.root, "handlers", [])  # as on a terminal: no pytest log capture
    out = tmp_path / "run"
    argv = ["train", "--train-file", train_file, "--validation-file", val_file, "--output-dir", str(out),
            "--tiny-hidden-size", "32", "--tiny-layers", "1", "--max-steps", "2", "--per-device-train-batch-size", "4",
            "--max-length", "64", "--chat-template", str(template), "--no-progress", "--no-plot"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert any(line.startswith("1 of 12 training rows were longer than max_length=64 tokens and were truncated")
               for line in captured.err.splitlines()), captured.err[-2000:]  # one line of its own
    assert "n=4" in captured.out  # the four validation replies' numbers evaluated
    assert (out / "adapter" / "causal_adapter_config.json").is_file()


@pytest.mark.parametrize("problem", ["no_assistant", "template_error", "missing_template", "unknown_role"])
def test_cli_conversation_errors_are_one_line_and_leave_nothing(tmp_path, capsys, problem):
    from causal_adapter.commands.main import main

    convo = sums(2)
    flags = []
    if problem == "no_assistant":
        convo[1] = convo[1][:2]
        needle, code = "row 1: the conversation has no assistant turn", 1
    elif problem == "unknown_role":
        convo[0][1] = {"role": "customer", "content": "hi"}
        needle, code = "row 0: message 1 has an unknown role 'customer'", 1
    elif problem == "template_error":
        (tmp_path / "bad.jinja").write_text("{% for m in messages %}{{ m.content }{% endfor %}")
        flags = ["--chat-template", str(tmp_path / "bad.jinja")]
        needle, code = "the chat template failed to render", 1
    else:
        flags = ["--chat-template", str(tmp_path / "nowhere.jinja")]
        needle, code = "--chat-template", 2
    out = tmp_path / "run"
    rc = main(["train", "--train-file", _write_jsonl(tmp_path / "t.jsonl", convo), "--output-dir", str(out),
               "--tiny-hidden-size", "32", "--tiny-layers", "1", "--max-steps", "1", "--no-progress", *flags])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error" in line]
    assert rc == code and len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err[-2000:]
    assert not out.exists()
