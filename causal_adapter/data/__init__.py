"""Layer 5, data: the text -> <NUM> pipeline (`pipeline.py`) and the bundled offline corpora (`corpora.py`).
The package exports the data API, so `from causal_adapter.data import tokenize_dataset` (the path of
earlier versions, when `data` was one module) keeps working."""
from .corpora import CORPORA, SPLITS, build_corpus, noise_sd, write_corpus_jsonl
from .pipeline import FEATURE_COLUMNS, NumericCollator, load_text_dataset, tokenize_dataset

__all__ = ["CORPORA", "SPLITS", "FEATURE_COLUMNS", "NumericCollator", "build_corpus", "load_text_dataset", "noise_sd",
           "tokenize_dataset", "write_corpus_jsonl"]
