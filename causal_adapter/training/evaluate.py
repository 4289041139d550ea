"""Adapter evaluation (`causal-adapter eval`): a saved adapter on a corpus split or data files,
with the constant and persistence baselines."""
from __future__ import annotations

import json
from pathlib import Path

from ..data.corpora import build_corpus
from ..data.conversations import read_chat_template
from ..data.pipeline import load_text_dataset, tokenize_dataset
from ..numbers import NumberTokenizer
from ..saving.assets import load_base
from ..model import CausalModel
from .metrics import evaluate_dataset, format_metrics_table


def evaluate_adapter(adapter_dir: str, base: str | None = None, arch: str = "qwen2", dtype: str = "float32",
                     corpus: str = "sunspots", split: str = "test", data_files: list[str] | None = None,
                     batch_size: int = 16, output: str | None = None, tiny_hidden_size: int = 64,
                     tiny_layers: int = 2, text_column: str = "text", prompt_column: str = "prompt",
                     completion_column: str = "completion", messages_column: str = "messages",
                     chat_template: str | None = None, enable_thinking: bool = False) -> str:
    """Metrics of a saved adapter on a corpus split (or files), with the baselines; a markdown table.
    Files of conversations (`messages_column`) are read as training reads them (`tokenize_dataset`: the chat
    template, a jinja file `chat_template` or the tokenizer's, scored on the assistant turns)."""
    if data_files:  # the data first: a bad file fails before the base loads
        columns = (text_column, prompt_column, completion_column)
        raw, train_targets = load_text_dataset(data_files, string_columns=columns), None
    else:
        dd = build_corpus(corpus)
        raw, train_targets = dd[split], list(dd["train"]["target"])
    base_model, tokenizer = load_base(base, arch, dtype, tiny_hidden_size, tiny_layers)
    model = CausalModel.from_pretrained(base_model, adapter_dir, tokenizer=tokenizer)
    ntok = NumberTokenizer(tokenizer, model.num_token_id)
    template = read_chat_template(chat_template) if chat_template else None
    rows = tokenize_dataset(raw, ntok, text_column, prompt_column, completion_column, messages_column=messages_column,
                            chat_template=template, enable_thinking=enable_thinking)
    metrics = evaluate_dataset(model, rows,
                               ntok.pad_token_id, batch_size=batch_size,
                               train_targets=train_targets)
    table = format_metrics_table(metrics, title=f"{corpus if not data_files else 'files'} {split}")
    if output:
        path = Path(output)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(metrics, indent=2) if path.suffix == ".json" else table + "\n")
    return table
