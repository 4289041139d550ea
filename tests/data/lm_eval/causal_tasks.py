"""The local lm-eval tasks' data (docs/evaluate.md): each task's JSONL next to this file, read without the hub.

lm-eval resolves a dataset path against the working directory, a ``!function`` against the task's YAML: the YAMLs
name these loaders (``custom_dataset: !function causal_tasks.<task>``), so ``--include_path tests/data/lm_eval`` works
from any directory."""
from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def _rows(name: str, **kwargs) -> datasets.DatasetDict:
    return datasets.DatasetDict({"test": datasets.load_dataset("json", data_files=str(HERE / f"{name}.jsonl"),
                                                               split="train")})


def text_mc(**kwargs):
    return _rows("text_mc")


def numbers_mc(**kwargs):
    return _rows("numbers_mc")


def numbers_gen(**kwargs):
    return _rows("numbers_gen")
