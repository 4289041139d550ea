"""Conversations (chat models): TRL's dataset formats, the tokenizer's chat template, the assistant-only mask.

* Formats, detected from the columns as TRL detects them (`trl.data_utils.is_conversational`):
  ``messages`` (a list of ``{"role", "content"}`` dicts: conversational language modelling),
  conversational ``prompt`` + ``completion`` (both lists of messages), and the plain ``text`` /
  ``prompt`` + ``completion`` strings `data.pipeline` reads.
* Rendering: the tokenizer's own chat template (``tokenizer.apply_chat_template(..., tokenize=False)``), or
  a template given as text (``--chat-template FILE``) for a base without one. Thinking is off unless asked
  (``enable_thinking``, Qwen3's switch; templates without it ignore the flag).
* The assistant mask comes from the rendered text itself, so it holds for templates without
  ``{% generation %}`` markers (Qwen2.5's ChatML): assistant turn k starts where the render of the
  conversation up to turn k WITH the generation prompt stops agreeing with the whole conversation's render,
  and ends after the template's end-of-turn mark (the text the template writes after an assistant reply,
  ``<|im_end|>`` for ChatML), found by rendering a probe conversation once per template.
  Qwen3's template writes an assistant turn differently once a later user turn exists (no ``<think>`` block),
  so prefixes of the conversation are not prefixes of its render: the common prefix is what locates a turn.

Character spans, not token ids: `NumberTokenizer` then encodes the rendered text (each number one
``<NUM>``, special tokens intact) and a token is trained when it starts inside an assistant span.
"""
from __future__ import annotations

import json
import os
from functools import lru_cache
from typing import Any, Mapping, Sequence

from ..config import IGNORE_INDEX
from ..numbers import find_numbers

ROLES = ("system", "user", "assistant", "tool")
#: probe reply used to find a template's end-of-turn mark (never part of real text)
_PROBE = "\u2063probe-reply\u2063"


# --------------------------------------------------------------------------- formats
def is_conversation(value: Any) -> bool:
    """True for a list of messages (dicts with a ``role``), as TRL's `is_conversational` tests a row's value."""
    return isinstance(value, (list, tuple)) and len(value) > 0 and isinstance(value[0], Mapping) and "role" in value[0]


def detect_format(columns: Sequence[str], first_row: Mapping | None, *, messages_column: str = "messages",
                  prompt_column: str = "prompt", completion_column: str = "completion",
                  text_column: str = "text") -> str:
    """One of "messages", "conversational_pc" (prompt and completion are lists of messages), "pc"
    (prompt + completion strings) or "text", from the columns present (and the first row's types)."""
    if messages_column in columns:
        return "messages"
    if prompt_column in columns and completion_column in columns and first_row is not None \
            and is_conversation(first_row.get(prompt_column)):
        return "conversational_pc"
    if prompt_column in columns and completion_column in columns:
        return "pc"
    if text_column in columns:
        return "text"
    raise ValueError(
        f"dataset has no {messages_column!r} column, no {prompt_column!r} + {completion_column!r} columns and no "
        f"{text_column!r} column; columns present: {list(columns)} (name yours with --messages-column / "
        "--text-column / --prompt-column / --completion-column, or messages_column= / text_column= / ... in Python)")


#: the formats `detect_format` names that are rendered with the chat template
CONVERSATION_FORMATS = ("messages", "conversational_pc")


def check_messages(messages: Any, row: int | str, *, need_assistant: bool, column: str = "messages") -> list[dict]:
    """`messages` as a list of dicts, or a ValueError naming the row and the problem: not a list of
    ``{"role", "content"}`` dicts, an unknown role, a content that is not a string (an assistant turn with
    ``tool_calls`` may have none), no assistant turn when `need_assistant` (training)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"row {row}: column {column!r} must be a non-empty list of messages "
                         f"({{\"role\": ..., \"content\": ...}}), got {type(messages).__name__} {messages!r:.80}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m:
            raise ValueError(f"row {row}: message {i} of {column!r} must be a dict with a 'role' and a 'content', "
                             f"got {m!r:.80}")
        role = m["role"]
        if role not in ROLES:
            raise ValueError(f"row {row}: message {i} has an unknown role {role!r}; known roles: {', '.join(ROLES)}")
        content = m.get("content")
        if content is None and role == "assistant" and m.get("tool_calls"):
            content = ""
        if not isinstance(content, str):
            raise ValueError(f"row {row}: message {i} ({role}) has no text content (got {type(content).__name__} "
                             f"{content!r:.60}); every message needs a string 'content'")
        # datasets stores a list of dicts as a struct: keys absent from a row come back as None
        out.append({k: v for k, v in {**m, "content": content}.items() if v is not None})
    if need_assistant and not any(m["role"] == "assistant" for m in out):
        raise ValueError(f"row {row}: the conversation has no assistant turn, so nothing to train on "
                         f"(roles: {', '.join(m['role'] for m in out)})")
    return out


# --------------------------------------------------------------------------- rendering
def read_chat_template(path: str | os.PathLike) -> str:
    """The text of a jinja chat-template file (``--chat-template FILE``); a missing or empty file is a ValueError."""
    if not os.path.isfile(path):
        raise ValueError(f"--chat-template {os.fspath(path)!r}: no such file (give a jinja chat-template file, "
                         "e.g. the chat_template.jinja of the chat model this base belongs to)")
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    if not text.strip():
        raise ValueError(f"--chat-template {os.fspath(path)!r}: the file is empty")
    return text


def check_chat_template(tokenizer, chat_template: str | None = None, enable_thinking: bool = False) -> str:
    """The template conversations are rendered with (`chat_template`, else the tokenizer's), checked before any
    row is: a ValueError when there is none, or when it fails to render a two-turn probe conversation
    (a jinja syntax error, a template that raises)."""
    end_of_turn_mark(tokenizer, chat_template=chat_template, enable_thinking=enable_thinking)
    return chat_template if chat_template is not None else tokenizer.chat_template


def render(tokenizer, messages: Sequence[Mapping], *, add_generation_prompt: bool = False,
           enable_thinking: bool = False, chat_template: str | None = None, tools: Sequence | None = None,
           row: int | str | None = None) -> str:
    """The conversation as the model reads it: the chat template (`chat_template` text, else the
    tokenizer's) rendered to text. A template that fails to render raises a ValueError naming the row."""
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("the tokenizer has no chat template: give one as text (chat_template=..., on the command "
                         "line --chat-template FILE, e.g. the template of the chat model this base belongs to)")
    try:
        return tokenizer.apply_chat_template(list(messages), tools=tools, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             enable_thinking=enable_thinking)
    except Exception as e:  # noqa: BLE001 - jinja's errors name neither the row nor the template
        where = f"row {row}: " if row is not None else ""
        raise ValueError(f"{where}the chat template failed to render this conversation: "
                         f"{type(e).__name__}: {e}") from e


def generation_prompt(tokenizer, messages: Sequence[Mapping], *, enable_thinking: bool = False,
                      chat_template: str | None = None, tools: Sequence | None = None,
                      row: int | str | None = None) -> str:
    """The text a chat model continues with its reply: the conversation + the template's generation prompt."""
    return render(tokenizer, messages, add_generation_prompt=True, enable_thinking=enable_thinking,
                  chat_template=chat_template, tools=tools, row=row)


def end_of_turn_mark(tokenizer, *, chat_template: str | None = None, enable_thinking: bool = False) -> str:
    """What the template writes right after an assistant reply, without trailing whitespace
    (``<|im_end|>`` for ChatML; "" for a template that writes nothing there)."""
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    return _end_of_turn_mark(tokenizer, template, enable_thinking)


@lru_cache(maxsize=16)
def _end_of_turn_mark(tokenizer, template: str | None, enable_thinking: bool) -> str:
    probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _PROBE}]
    text = render(tokenizer, probe, enable_thinking=enable_thinking, chat_template=template)
    if _PROBE not in text:
        raise ValueError("the chat template does not write an assistant turn's content as given (a probe reply "
                         "was not found in its output): cannot tell which tokens are the assistant's")
    return text[text.rindex(_PROBE) + len(_PROBE):].rstrip()


def _common_prefix_length(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _after_last_whitespace(text: str, lo: int, hi: int) -> int:
    """The position after the last whitespace character of ``text[lo:hi]`` (`hi` when there is none)."""
    last = max(text.rfind(c, lo, hi) for c in " \n\t\r")
    return last + 1 if last >= 0 else hi


def _shown_content(message: Mapping) -> str:
    """The part of an assistant reply every template writes verbatim (Qwen3 moves a ``<think>`` block out)."""
    return str(message.get("content") or "").split("</think>")[-1].strip()


def without_reasoning(messages: Sequence[Mapping]) -> list[dict]:
    """The messages with every assistant turn's reasoning dropped (``reasoning_content``, a ``<think>`` block
    at the head of its content): with thinking off the model learns to answer as it will be asked to,
    after the template's empty think block."""
    out = []
    for m in messages:
        if m["role"] == "assistant":
            m = {k: v for k, v in m.items() if k != "reasoning_content"}
            if "</think>" in m.get("content", ""):
                m["content"] = m["content"].split("</think>")[-1].lstrip("\n")
        out.append(dict(m))
    return out


def assistant_spans(tokenizer, messages: Sequence[Mapping], *, first_turn: int = 0, enable_thinking: bool = False,
                    chat_template: str | None = None, tools: Sequence | None = None,
                    row: int | str | None = None) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered conversation, the [start, end) character spans of its assistant replies).

    A span runs from the first character the model writes after the generation prompt (the reply, with
    its ``<think>`` block when thinking is on; with thinking off the data's reasoning is dropped,
    `without_reasoning`) to the end of the template's end-of-turn mark; the newline the template writes after
    the mark is not trained. `first_turn`: only assistant messages at this index
    or later (conversational prompt/completion rows train the completion's turns only)."""
    kw = dict(enable_thinking=enable_thinking, chat_template=chat_template, tools=tools, row=row)
    if not enable_thinking:
        messages = without_reasoning(messages)
    text = render(tokenizer, messages, **kw)
    mark = end_of_turn_mark(tokenizer, chat_template=chat_template, enable_thinking=enable_thinking)
    spans: list[tuple[int, int]] = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant" or k < first_turn:
            continue
        if k == 0:  # a template renders a reply after a prompt: there is no generation prompt of nothing
            raise ValueError(f"row {row}: the conversation starts with an assistant turn; a chat template renders "
                             "replies after a system or user message: put the user turn before it or drop it")
        prompt = generation_prompt(tokenizer, messages[:k], **kw)
        start = _common_prefix_length(prompt, text)
        if start < len(prompt):
            # the template writes this turn without the whole generation prompt (Qwen3 with thinking off: no empty
            # think block before a reply that a later user turn follows): the common prefix may run on into a
            # chance match (``<t`` of ``<think>`` and ``<tool_call>``); the reply starts after the header's
            # last whitespace
            start = _after_last_whitespace(text, spans[-1][1] if spans else 0, start)
        if spans and start < spans[-1][1]:
            raise ValueError(f"row {row}: cannot locate assistant turn {k} in the rendered conversation (it starts "
                             "before the previous assistant turn ends)")
        content = _shown_content(message)
        at = text.find(content, start) if content else start  # the reply's text, then the mark after it
        if mark and at >= 0:
            end = text.find(mark, at + len(content))
            end = end + len(mark) if end >= 0 else -1
        elif at >= 0:  # no mark: the turn runs to where the template starts the next message (whitespace excluded)
            nxt = (_common_prefix_length(render(tokenizer, messages[:k + 1], **kw), text)
                   if k + 1 < len(messages) else len(text))
            end = len(text[:nxt].rstrip())
        if at < 0 or end < at + len(content):
            raise ValueError(f"row {row}: cannot locate assistant turn {k} in the rendered conversation: the "
                             "template does not write the reply after its generation prompt")
        spans.append((start, end))
    return text, spans


def prompt_and_reply(tokenizer, messages: Sequence[Mapping], *, enable_thinking: bool = False,
                     chat_template: str | None = None, tools: Sequence | None = None,
                     row: int | str | None = None) -> tuple[str, str | None]:
    """(prompt text, reply text or None) for inference on one conversation: a conversation that ends with the
    user's (or a tool's) turn is the generation prompt and no reply; one that ends with the assistant's reply is
    the generation prompt before that reply and the reply's text as the template writes it (its ``<think>``
    block included when thinking is on), so `predict` reads the value where the reply's first number stands."""
    if messages[-1]["role"] != "assistant":
        return generation_prompt(tokenizer, messages, enable_thinking=enable_thinking, chat_template=chat_template,
                                 tools=tools, row=row), None
    text, spans = assistant_spans(tokenizer, messages, first_turn=len(messages) - 1, enable_thinking=enable_thinking,
                                  chat_template=chat_template, tools=tools, row=row)
    start, end = spans[-1]
    return text[:start], text[start:end]


def inference_prompt(tokenizer, messages: Any, *, to_first_number: bool = False, enable_thinking: bool = False,
                     chat_template: str | None = None, tools: Any = None, row: int | str = 0,
                     column: str = "messages") -> str:
    """The text the model continues for one conversation at inference, the messages checked first
    (`check_messages`; a ValueError names `row`). `tools`: a list of function definitions or its JSON text.

    * Ending with the user's (or a tool's, the system's) turn: the generation prompt (`generation_prompt`).
    * Ending with the assistant's reply (`prompt_and_reply`): for generation, the prompt and that reply without
      its end-of-turn mark, so the model continues the reply (transformers' ``continue_final_message``, what its
      text-generation pipeline does with such a conversation); with `to_first_number` (`predict`), the prompt and
      the reply's text before its first number, so the value is read where that number stands (a reply without
      a number: right after the generation prompt)."""
    messages = check_messages(messages, row, need_assistant=False, column=column)
    kw = dict(enable_thinking=enable_thinking, chat_template=chat_template, tools=_tools(tools, row), row=row)
    prompt, reply = prompt_and_reply(tokenizer, messages, **kw)
    if reply is None:
        return prompt
    if to_first_number:
        numbers = find_numbers(reply)
        return prompt + (reply[:numbers[0].start] if numbers else "")
    mark = end_of_turn_mark(tokenizer, chat_template=chat_template, enable_thinking=enable_thinking)
    return prompt + (reply[:-len(mark)] if mark and reply.endswith(mark) else reply)


# --------------------------------------------------------------------------- training features
def assistant_labels(input_ids: Sequence[int], offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]],
                     num_token_id: int, *, train_all: bool = False) -> list[int]:
    """Labels [S] of one encoded conversation (`input_ids` [S], character `offsets` [S] in the rendered text): a
    token starting inside an assistant span (`assistant_spans`, sorted) is labelled with its id, every other
    token -100. `train_all`: the other text tokens are labelled too, never a ``<NUM>`` outside a span: the user's
    and system's numbers are read as values, not regression targets."""
    labels, j = [], 0
    for token, (start, _) in zip(input_ids, offsets):
        while j < len(spans) and spans[j][1] <= start:
            j += 1
        inside = j < len(spans) and spans[j][0] <= start
        labels.append(token if inside or (train_all and token != num_token_id) else IGNORE_INDEX)
    return labels


def _tools(value: Any, row: int | str):
    """A row's ``tools`` (TRL's column of function definitions: a list or its JSON text), None when absent."""
    if value is None or isinstance(value, (list, tuple)):
        return value or None
    if isinstance(value, str):
        try:
            return json.loads(value) or None
        except json.JSONDecodeError as e:
            raise ValueError(f"row {row}: column 'tools' is not valid JSON ({e.msg})") from None
    raise ValueError(f"row {row}: column 'tools' must be a list of function definitions, got {type(value).__name__}")


def encode_conversations(number_tokenizer, batch: Mapping[str, Sequence], rows: Sequence[int], columns: Sequence[str],
                         *, train_all: bool = False, enable_thinking: bool = False, chat_template: str | None = None,
                         tools_column: str = "tools") -> list[tuple[list[int], list[float], list[int]]]:
    """(input_ids, numeric_values, labels) of each row of a batch of conversations (column -> values, TRL's
    formats): `columns` = [messages] (conversational language modelling: every assistant turn trained) or
    [prompt, completion] (conversational prompt/completion: the completion's assistant turns only; it needs
    one). Each row is checked (`check_messages`: the row number `rows[i]` names it in errors), rendered with the
    chat template (`assistant_spans`), encoded number-aware with character offsets (one call for the batch: each
    number one ``<NUM>``), and labelled by `assistant_labels`. Nothing is appended: the template's end-of-turn
    mark (``<|im_end|>``) closes each reply and is trained with it."""
    tokenizer = number_tokenizer.tokenizer
    tools = batch[tools_column] if tools_column in batch else None
    texts, spans = [], []
    for i, row in enumerate(rows):
        if len(columns) == 1:
            messages = check_messages(batch[columns[0]][i], row, need_assistant=True, column=columns[0])
            first_turn = 0
        else:
            prompt = check_messages(batch[columns[0]][i], row, need_assistant=False, column=columns[0])
            completion = check_messages(batch[columns[1]][i], row, need_assistant=False, column=columns[1])
            if not any(m["role"] == "assistant" for m in completion):
                raise ValueError(f"row {row}: the completion has no assistant turn, so nothing to train on "
                                 f"(roles: {', '.join(m['role'] for m in completion)})")
            messages, first_turn = prompt + completion, len(prompt)
        text, row_spans = assistant_spans(tokenizer, messages, first_turn=first_turn, enable_thinking=enable_thinking,
                                          chat_template=chat_template, row=row,
                                          tools=_tools(tools[i], row) if tools is not None else None)
        texts.append(text)
        spans.append(row_spans)
    out = []
    for enc, row_spans in zip(number_tokenizer.encode_batch(texts, return_offsets=True), spans):
        labels = assistant_labels(enc.input_ids, enc.offsets, row_spans, number_tokenizer.num_token_id,
                                  train_all=train_all)
        out.append((enc.input_ids, enc.numeric_values, labels))
    return out
