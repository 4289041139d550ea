"""vLLM's tokenizer mode `causal_adapter` (`vllm serve OUT --tokenizer-mode causal_adapter`): the base's tokenizer,
with every number of a prompt written as ONE value id (`value_ids`: <NUM> carrying its value), exactly as
`NumberTokenizer` encodes the text for `generate` and `predict`.

vLLM moves nothing but token ids from its API server to the engine; a value id takes the number's value along (the
model splits it back into <NUM> + value: `models`). Under `--runner pooling` (vLLM tokenizes pooling prompts with
truncation_side "right", `vllm.tokenizers.registry.resolve_tokenizer_args`) a prompt that ends without the token the
training data wrote before a number gets it appended, as `predict` does (`prediction.encode_prompts`).
Decoding writes a value id as its number and a <NUM> the model generated, whose value vLLM's engine does not keep
(docs/serve_at_scale.md#limits), as `NUM_TEXT`.
"""
from __future__ import annotations

import json
from pathlib import Path

from transformers import BatchEncoding
from vllm.tokenizers.hf import CachedHfTokenizer

from ...numbers import NumberTokenizer, format_number
from ...saving.artifacts import CONFIG_NAME
from .folder import HEADS_DIR
from .value_ids import MAX_VALUE_ID, is_value_id, join_value_ids, value_of_id

NUM_TEXT = "<NUM>"


class NumberIdsTokenizer:
    """A vLLM `TokenizerLike`: number-aware `encode` / `__call__`, value-id-aware decoding; everything else is the
    base tokenizer's (vLLM's cached HF tokenizer, by delegation)."""

    def __init__(self, hf, adapter_meta: dict, pooling: bool):
        self.hf = hf
        self.num_token_id = int(adapter_meta["num_token_id"])
        self.ntok = NumberTokenizer(hf, self.num_token_id)
        cfg = adapter_meta["adapter_config"]
        # `predict`'s number layout (None: none), read by the pooling runner's prompts only
        self.prefix_id = cfg.get("number_prefix_id") if pooling else None
        self.contexts = set(cfg.get("number_contexts") or ())

    @classmethod
    def from_pretrained(cls, path_or_repo_id, *args, **kwargs) -> "NumberIdsTokenizer":
        pooling = kwargs.get("truncation_side") == "right"
        hf = CachedHfTokenizer.from_pretrained(path_or_repo_id, *args, **kwargs)
        meta_path = Path(path_or_repo_id) / HEADS_DIR / CONFIG_NAME
        if not meta_path.is_file():
            raise ValueError(f"tokenizer mode 'causal_adapter' reads {str(meta_path)!r}: give the folder "
                             "`causal-adapter export-vllm` wrote")
        return cls(hf, json.loads(meta_path.read_text()), pooling)

    def __getattr__(self, name):  # the rest of TokenizerLike: the base tokenizer's
        if name == "hf" or name.startswith("__"):  # not set yet (copy, pickle): no delegation
            raise AttributeError(name)
        return getattr(self.hf, name)

    def __len__(self) -> int:  # <NUM> is ours: vLLM's detokenizer writes "" for an id >= len(tokenizer)
        return max(len(self.hf), self.num_token_id + 1)

    def __hash__(self) -> int:
        return hash(id(self))

    @property
    def max_token_id(self) -> int:
        return MAX_VALUE_ID  # value ids are valid prompt ids (vLLM checks prompts against this)

    # ---------------------------------------------------------------- encoding
    def encode(self, text: str, truncation: bool | None = None, max_length: int | None = None,
               add_special_tokens: bool = True) -> list[int]:
        enc = self.ntok.encode_batch([text], return_offsets=False)[0]
        ids = join_value_ids(enc.input_ids, enc.numeric_values, self.num_token_id)
        if self.prefix_id is not None and ids and ids[-1] not in self.contexts and not is_value_id(ids[-1]):
            ids.append(int(self.prefix_id))
        if truncation and max_length is not None and len(ids) > max_length:
            ids = ids[-max_length:] if self.hf.truncation_side == "left" else ids[:max_length]
        return ids

    def __call__(self, text, text_pair=None, add_special_tokens: bool = True, truncation: bool = False,
                 max_length: int | None = None, **kwargs) -> BatchEncoding:
        if text_pair is not None:
            raise ValueError("tokenizer mode 'causal_adapter' encodes one text, not a pair")
        texts = [text] if isinstance(text, str) else list(text)
        ids = [self.encode(t, truncation, max_length, add_special_tokens) for t in texts]
        ids_out = ids[0] if isinstance(text, str) else ids
        mask = [1] * len(ids_out) if isinstance(text, str) else [[1] * len(r) for r in ids]
        return BatchEncoding({"input_ids": ids_out, "attention_mask": mask})

    # ---------------------------------------------------------------- decoding
    def _text_of(self, token_id: int) -> str | None:
        if is_value_id(token_id):
            return format_number(value_of_id(token_id))
        return NUM_TEXT if token_id == self.num_token_id else None

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False) -> list[str]:
        ids = [ids] if isinstance(ids, int) else list(ids)
        out = []
        for i in ids:  # numbers as their text (printable ASCII: byte-level BPE maps it to itself)
            t = self._text_of(i)
            out += [t] if t is not None else self.hf.convert_ids_to_tokens([i], skip_special_tokens=skip_special_tokens)
        return out

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [ids] if isinstance(ids, int) else list(ids)
        parts, run = [], []
        for i in ids:
            t = self._text_of(i)
            if t is None:
                run.append(i)
                continue
            parts += [self.hf.decode(run, skip_special_tokens=skip_special_tokens), t]
            run = []
        parts.append(self.hf.decode(run, skip_special_tokens=skip_special_tokens))
        return "".join(parts)
