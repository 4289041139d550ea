"""Number-aware text <-> (input_ids, numeric_values), SPEC section 1.

Every number the grammar recognises (`number_grammar`: see docs/numbers.md, "Number grammar", the normative text of
the rules implemented by ``NUMBER_RE`` and ``find_numbers``, re-exported here) becomes exactly ONE ``<NUM>`` token
whose float value travels in the aligned ``numeric_values`` array (0.0 at every other position).
The text between numbers is tokenised by the wrapped tokenizer, segment by segment, with its
own spacing, in one batch call over all segments of all texts.

``<NUM>`` is ``num_token_id`` (default ``len(tokenizer)``, the first reserved embedding row of
Qwen checkpoints). It is never added to the tokenizer: the literal text ``"<NUM>"`` is ordinary
text (``<``, ``NUM``, ``>``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

__all__ = [
    "FLOAT32_MAX",
    "NUMBER_RE",
    "NumberSpan",
    "NumberEncoding",
    "NumberTokenizer",
    "find_numbers",
    "format_number",
    "parse_number",
]

from .number_grammar import (  # noqa: F401 - the grammar, importable from here as before
    FLOAT32_MAX, NUMBER_RE, NumberSpan, _scan, find_numbers, format_number, parse_number)


@dataclass
class NumberEncoding:
    """Result of `NumberTokenizer.encode`. All lists are aligned per token.

    input_ids: token ids, ``num_token_id`` at each number.
    numeric_values: the number's value at ``<NUM>`` positions, 0.0 elsewhere.
    number_texts: the source string of the number at ``<NUM>`` positions, None elsewhere.
    offsets: (start, end) character span of each token in the source text (None when the
        encoding was made without offsets, e.g. by ``__call__``).
    """

    input_ids: list[int]
    numeric_values: list[float]
    number_texts: list[str | None]
    offsets: list[tuple[int, int]] | None = None
    text: str | None = None
    _spans: list = field(default_factory=list, repr=False)

    @property
    def numbers(self) -> list[NumberSpan]:
        """The recognised numbers of ``text``, in order (one per ``<NUM>``)."""
        return [s if isinstance(s, NumberSpan) else NumberSpan(*s) for s in self._spans]

    def __len__(self) -> int:
        return len(self.input_ids)


def to_list(x: Any) -> list:
    if x is None:
        return None
    if hasattr(x, "tolist"):
        return x.tolist()
    return list(x)


class NumberTokenizer:
    """Number-aware wrapper of a (Qwen) tokenizer.

    ``NumberTokenizer(tokenizer, num_token_id=None)``: ``num_token_id`` defaults to
    ``len(tokenizer)``, the first reserved embedding row. No special tokens (BOS/EOS) are added:
    the ids of a text without numbers are exactly ``tokenizer(text, add_special_tokens=False)``
    (for Qwen tokenizers also exactly ``tokenizer(text)``).
    """

    def __init__(self, tokenizer, num_token_id: int | None = None):
        if tokenizer is None:
            raise ValueError("NumberTokenizer needs a tokenizer, got None")
        self.tokenizer = tokenizer
        n = len(tokenizer)
        if num_token_id is None:
            num_token_id = n
        if isinstance(num_token_id, bool) or not isinstance(num_token_id, int) or num_token_id < 0:
            raise ValueError(f"num_token_id must be a non-negative int, got {num_token_id!r}")
        self.num_token_id = int(num_token_id)
        # an id inside the vocabulary could also come out of the text tokenisation: checked per encode
        self._may_collide = self.num_token_id < n
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(tokenizer, "eos_token_id", None)
        if pad is None:
            raise ValueError("the tokenizer has neither pad_token_id nor eos_token_id; set tokenizer.pad_token")
        self.pad_token_id = int(pad)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend if getattr(tokenizer, "is_fast", backend is not None) else None

    def __repr__(self) -> str:
        return (f"NumberTokenizer({type(self.tokenizer).__name__}, len={len(self.tokenizer)}, "
                f"num_token_id={self.num_token_id}, pad_token_id={self.pad_token_id})")

    # ------------------------------------------------------------------ encoding
    def _tokenize_segments(self, segments: list[str], with_offsets: bool):
        """ids (and char offsets) of every segment, in one batch call."""
        if not segments:
            return [], []
        if self._backend is not None:
            backend = self._backend
            # A transformers call with padding=True / truncation leaves the shared Rust backend in
            # that mode; segments must be encoded bare, so switch it off and restore it after.
            padding, truncation = backend.padding, backend.truncation
            backend.no_padding()
            backend.no_truncation()
            try:
                if with_offsets:
                    encs = backend.encode_batch(segments, add_special_tokens=False)
                    return [e.ids for e in encs], [e.offsets for e in encs]
                encs = backend.encode_batch_fast(segments, add_special_tokens=False)
                return [e.ids for e in encs], None
            finally:
                if padding is not None:
                    backend.enable_padding(**padding)
                if truncation is not None:
                    backend.enable_truncation(**truncation)
        out = self.tokenizer(segments, add_special_tokens=False, return_offsets_mapping=with_offsets)
        return out["input_ids"], (out["offset_mapping"] if with_offsets else None)

    def _encode_many(self, texts: Sequence[str], with_offsets: bool) -> list[NumberEncoding]:
        # 1. numbers of every text; the text between them ("segments") deduplicated: number-rich
        #    text repeats the same few separators ("; ", ": ") over and over.
        seg_index: dict[str, int] = {"": 0}
        plans = []  # per text: (numbers, segment index of each gap: len(numbers) + 1 gaps)
        for ti, text in enumerate(texts):
            if not isinstance(text, str):
                raise ValueError(f"text {ti} is not a str but {type(text).__name__}: {text!r:.80}")
            nums = _scan(text)
            gaps = []
            pos = 0
            for s, e, _, _ in nums:
                seg = text[pos:s]
                g = seg_index.get(seg)
                if g is None:
                    g = seg_index[seg] = len(seg_index)
                gaps.append(g)
                pos = e
            seg = text[pos:]
            g = seg_index.get(seg)
            if g is None:
                g = seg_index[seg] = len(seg_index)
            gaps.append(g)
            plans.append((nums, gaps))

        # 2. one batch call of the tokenizer over all distinct segments
        uniq = list(seg_index)
        seg_ids, seg_offs = self._tokenize_segments(uniq[1:], with_offsets)
        seg_ids = [[]] + list(seg_ids)
        if with_offsets:
            seg_offs = [[]] + list(seg_offs)
        if self._may_collide:
            for k, ids in enumerate(seg_ids):
                if self.num_token_id in ids:
                    raise ValueError(
                        f"num_token_id {self.num_token_id} is a regular token of this tokenizer and occurs "
                        f"in the text segment {uniq[k]!r:.80}; use an id >= len(tokenizer)"
                    )
        zeros = [[0.0] * len(x) for x in seg_ids]
        nones = [[None] * len(x) for x in seg_ids]

        # 3. assemble: segment ids, <NUM>, segment ids, <NUM>, ...
        num = self.num_token_id
        out = []
        for text, (nums, gaps) in zip(texts, plans):
            ids: list[int] = list(seg_ids[gaps[0]])
            vals: list[float] = list(zeros[gaps[0]])
            srcs: list[str | None] = list(nones[gaps[0]])
            for (_, _, v, src), g in zip(nums, gaps[1:]):
                ids.append(num)
                ids += seg_ids[g]
                vals.append(v)
                vals += zeros[g]
                srcs.append(src)
                srcs += nones[g]
            offs = None
            if with_offsets:
                offs = [tuple(o) for o in seg_offs[gaps[0]]]
                for (s, e, _, _), g in zip(nums, gaps[1:]):
                    offs.append((s, e))
                    offs += [(e + a, e + b) for a, b in seg_offs[g]]
            out.append(NumberEncoding(ids, vals, srcs, offs, text, nums))
        return out

    def encode(self, text: str) -> NumberEncoding:
        """``text`` -> NumberEncoding (ids, values, per-token source strings, char offsets)."""
        return self._encode_many([text], with_offsets=True)[0]

    def encode_batch(self, texts: Sequence[str], return_offsets: bool = True) -> list[NumberEncoding]:
        """Encode many texts with one tokenizer batch call over all their text segments."""
        if isinstance(texts, str):
            raise ValueError("encode_batch expects a list of str; use encode() for one text")
        return self._encode_many(list(texts), with_offsets=return_offsets)

    def __call__(
        self,
        texts: str | Sequence[str],
        padding_side: str = "right",
        max_length: int | None = None,
        truncation: bool = False,
        return_tensors: str | None = "pt",
    ) -> dict:
        """Batch-encode and pad: ``input_ids`` (long), ``numeric_values`` (float32),
        ``attention_mask`` (long), padded to the longest sequence on ``padding_side``
        ("right" for training, "left" for generation) with ``pad_token_id`` / 0.0 / 0.

        With ``truncation=True`` each sequence keeps its first ``max_length`` tokens; without it,
        a sequence longer than ``max_length`` is an error. ``return_tensors=None`` gives lists.
        """
        if padding_side not in ("right", "left"):
            raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
        if return_tensors not in ("pt", None):
            raise ValueError(f"return_tensors must be 'pt' or None, got {return_tensors!r}")
        if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1):
            raise ValueError(f"max_length must be a positive int or None, got {max_length!r}")
        if truncation and max_length is None:
            raise ValueError("truncation=True needs max_length")
        single = isinstance(texts, str)
        encs = self._encode_many([texts] if single else list(texts), with_offsets=False)
        rows_ids = [e.input_ids for e in encs]
        rows_vals = [e.numeric_values for e in encs]
        if max_length is not None:
            for i, r in enumerate(rows_ids):
                if len(r) > max_length:
                    if not truncation:
                        raise ValueError(
                            f"text {i} has {len(r)} tokens > max_length={max_length}; pass truncation=True"
                        )
                    rows_ids[i] = r[:max_length]
                    rows_vals[i] = rows_vals[i][:max_length]
        return pad_batch(rows_ids, rows_vals, self.pad_token_id, padding_side, return_tensors)

    # ------------------------------------------------------------------ decoding
    def decode(
        self,
        input_ids,
        numeric_values=None,
        number_texts=None,
        skip_special_tokens: bool = False,
    ) -> str:
        """Inverse of `encode`: text runs decoded by the tokenizer, each ``<NUM>`` rendered as
        its source string when ``number_texts`` has one for that position (list aligned per
        token, or dict position -> str), else as ``format_number(value)``.

        Accepts lists, tuples, numpy arrays or tensors (1-D), or a NumberEncoding.
        ``skip_special_tokens`` drops the tokenizer's special tokens (padding included);
        ``<NUM>`` is always rendered.
        """
        if isinstance(input_ids, NumberEncoding):
            enc = input_ids
            input_ids = enc.input_ids
            numeric_values = enc.numeric_values if numeric_values is None else numeric_values
            number_texts = enc.number_texts if number_texts is None else number_texts
        return self._decode_many([input_ids], [numeric_values], [number_texts], skip_special_tokens)[0]

    def batch_decode(self, input_ids, numeric_values=None, number_texts=None, skip_special_tokens: bool = False) -> list[str]:
        """`decode` of each row of a batch (2-D tensor / list of lists)."""
        rows = to_list(input_ids)
        vals = to_list(numeric_values) if numeric_values is not None else [None] * len(rows)
        texts = list(number_texts) if number_texts is not None else [None] * len(rows)
        if len(vals) != len(rows) or len(texts) != len(rows):
            raise ValueError(
                f"batch_decode: {len(rows)} rows of input_ids but {len(vals)} of numeric_values "
                f"and {len(texts)} of number_texts"
            )
        return self._decode_many(rows, vals, texts, skip_special_tokens)

    def _decode_many(self, rows, vals_rows, texts_rows, skip_special_tokens: bool) -> list[str]:
        num = self.num_token_id
        runs: list[list[int]] = []
        plans = []
        for r, (ids, vals, ntexts) in enumerate(zip(rows, vals_rows, texts_rows)):
            ids = to_list(ids)
            if ids and isinstance(ids[0], list):
                raise ValueError("decode expects one sequence (1-D); use batch_decode for a batch")
            vals = to_list(vals)
            if vals is not None and len(vals) != len(ids):
                raise ValueError(f"row {r}: {len(ids)} input_ids but {len(vals)} numeric_values")
            if isinstance(ntexts, Mapping):
                get_src = ntexts.get
            elif ntexts is not None:
                ntexts = list(ntexts)
                if len(ntexts) != len(ids):
                    raise ValueError(f"row {r}: {len(ids)} input_ids but {len(ntexts)} number_texts")
                get_src = ntexts.__getitem__
            else:
                get_src = lambda i: None  # noqa: E731
            pieces: list = []  # int = index into runs, str = rendered number
            cur: list[int] = []
            for i, t in enumerate(ids):
                if t == num:
                    if cur:
                        pieces.append(len(runs))
                        runs.append(cur)
                        cur = []
                    elif i > 0 and ids[i - 1] == num:
                        # Two adjacent <NUM> (only generation makes them; encoded text never has
                        # them): a space keeps them two numbers when the text is read back.
                        pieces.append(" ")
                    src = get_src(i)
                    if src is None:
                        if vals is None:
                            raise ValueError(f"row {r}: <NUM> at position {i} but no numeric_values given")
                        src = format_number(vals[i])
                    pieces.append(src)
                else:
                    cur.append(int(t))
            if cur:
                pieces.append(len(runs))
                runs.append(cur)
            plans.append(pieces)
        decoded = (
            self.tokenizer.batch_decode(runs, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
            if runs else []
        )
        return ["".join(decoded[p] if isinstance(p, int) else p for p in pieces) for pieces in plans]


def pad_batch(rows_ids, rows_vals, pad_token_id: int, padding_side: str = "right", return_tensors: str | None = "pt") -> dict:
    """Pad ragged rows to the longest: ids with ``pad_token_id``, values 0.0, mask 0."""
    n = max((len(r) for r in rows_ids), default=0)
    if return_tensors is None:
        out_ids, out_vals, out_mask = [], [], []
        for ids, vals in zip(rows_ids, rows_vals):
            k = n - len(ids)
            if padding_side == "right":
                out_ids.append(list(ids) + [pad_token_id] * k)
                out_vals.append(list(vals) + [0.0] * k)
                out_mask.append([1] * len(ids) + [0] * k)
            else:
                out_ids.append([pad_token_id] * k + list(ids))
                out_vals.append([0.0] * k + list(vals))
                out_mask.append([0] * k + [1] * len(ids))
        return {"input_ids": out_ids, "numeric_values": out_vals, "attention_mask": out_mask}
    from itertools import chain

    import torch

    b = len(rows_ids)
    lengths = torch.tensor([len(r) for r in rows_ids], dtype=torch.long).reshape(b, 1)
    pos = torch.arange(n).reshape(1, n)
    mask = pos < lengths if padding_side == "right" else pos >= n - lengths
    ids_t = torch.full((b, n), pad_token_id, dtype=torch.long)
    vals_t = torch.zeros((b, n), dtype=torch.float32)
    # boolean-mask assignment fills row by row, left to right: the rows' concatenation order
    ids_t[mask] = torch.tensor(list(chain.from_iterable(rows_ids)), dtype=torch.long)
    vals_t[mask] = torch.tensor(list(chain.from_iterable(rows_vals)), dtype=torch.float32)
    return {"input_ids": ids_t, "numeric_values": vals_t, "attention_mask": mask.long()}
