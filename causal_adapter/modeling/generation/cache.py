"""The backbone's cache, row by row, on transformers' own `DynamicCache` (docs/decoding.md says why this one).

Rows leave a running batch with `select_rows` (the cache's `reorder_cache`, beam search's row selection), rows join
with `merge_rows` (their prefill's cache, left padded to the batch's length, concatenated on the batch axis), and the
padding every row has in common is cut with `trim_left`. `fork_rows` turns the prefill of one prompt into the rows of
several (a horizon's lanes: one prefill, 1 + N rows). A row's keys and values never move along its own sequence
axis and its attention mask and position ids go with it, so joining and leaving change no row's attention.
`movable` says whether a cache's layers allow it: key/value layers (`DynamicLayer`) and the linear-attention layers
of the hybrid families (conv and recurrent states: one per row, nothing to pad); a sliding-window, static or quantized
layer does not, and the step loop then runs its batch as a whole (rows join when it is empty, leave together).

`PrefixCache`: the keys and values of prompt prefixes, by blocks, for rows that begin the same way.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Any

import torch
from torch import Tensor

_KV = ("DynamicLayer",)
_LINEAR = ("LinearAttentionLayer", "LinearAttentionAndFullAttentionLayer")
_STATES = ("conv_states", "recurrent_states")


def movable(cache: Any) -> str | None:
    """None when rows can join and leave `cache`; else why not (one line)."""
    layers = getattr(cache, "layers", None)
    if layers is None or not hasattr(cache, "reorder_cache"):
        return f"the backbone's cache ({type(cache).__name__}) has no per-layer states to select rows from"
    for layer in layers:
        name = type(layer).__name__
        if name not in _KV + _LINEAR:
            return (f"its cache holds {name} layers (a sliding window, a static or a quantized cache), which cannot "
                    "be left padded: rows join when the batch is empty and leave together")
    return None


def key_value_only(cache: Any) -> bool:
    """Whether every layer of `cache` is a plain key/value layer (what `PrefixCache` can store)."""
    return all(type(layer).__name__ in _KV for layer in getattr(cache, "layers", [None]))


def select_rows(cache: Any, rows: Tensor) -> None:
    """Keep the batch rows `rows` [k] (in that order), in place."""
    cache.reorder_cache(rows)


def left_pad(t: Tensor, length: int, dim: int = -2) -> Tensor:
    """`t` widened to `length` along `dim` with zeros on the left: keys / values [B, h, L, d] (dim -2), attention
    masks [B, L] (dim -1; 0 = masked, so the zeros of the keys and values are never read)."""
    extra = length - t.shape[dim]
    if extra == 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t.new_zeros(shape), t], dim)


def _states(layer, name: str) -> dict:
    """The layer's conv or recurrent states by index (transformers >= 5.20 keeps a dict, older ones one tensor)."""
    value = getattr(layer, name, None)
    return value if isinstance(value, dict) else {None: value}


def merge_rows(cache: Any, new: Any) -> None:
    """Append the rows of `new` (another prefill's cache of the same model) to `cache`, in place: key/value layers
    are left padded to the longer of the two and concatenated on the batch axis, linear-attention states
    concatenated. The attention masks are padded the same way by the caller."""
    for a, b in zip(cache.layers, new.layers):
        if getattr(a, "keys", None) is not None and getattr(b, "keys", None) is not None and a.keys.numel():
            length = max(a.keys.shape[-2], b.keys.shape[-2])
            a.keys = torch.cat([left_pad(a.keys, length), left_pad(b.keys.to(a.keys.device), length)])
            a.values = torch.cat([left_pad(a.values, length), left_pad(b.values.to(a.values.device), length)])
        for name in _STATES:
            if not hasattr(a, name):
                continue
            sa, sb = _states(a, name), _states(b, name)
            for i, t in sa.items():
                if t is not None and sb.get(i) is not None:
                    joined = torch.cat([t, sb[i].to(t.device)])
                    if i is None:
                        setattr(a, name, joined)
                    else:
                        sa[i] = joined


def trim_left(cache: Any, n: int) -> None:
    """Drop the first `n` positions of every key/value layer (padding no row attends to any more), in place."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            layer.keys = layer.keys[..., n:, :]
            layer.values = layer.values[..., n:, :]


def fork_rows(cache: Any, n: int) -> None:
    """A cache of one row made the cache of `n` rows that begin with it, in place: key/value layers expanded (a view:
    the next step's concatenation copies it), linear-attention states repeated (each row updates its own)."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            layer.keys = layer.keys.expand(n, *layer.keys.shape[1:])
            layer.values = layer.values.expand(n, *layer.values.shape[1:])
        for name in _STATES:
            if not hasattr(layer, name):
                continue
            states = _states(layer, name)
            for i, t in states.items():
                if t is not None:
                    many = t.repeat(n, *([1] * (t.dim() - 1)))
                    if i is None:
                        setattr(layer, name, many)
                    else:
                        states[i] = many


def cache_from(layers: list[tuple[Tensor, Tensor]]) -> Any:
    """A DynamicCache holding the given keys / values per layer ([B, h, L, d] each)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, (k, v) in enumerate(layers):
        cache.update(k, v, i)
    return cache


class PrefixCache:
    """Keys and values of prompt prefixes, for rows that begin the same way (a chat's system prompt and template
    head): vLLM's automatic prefix caching, on the tensors of transformers' key/value layers.

    A prompt is cut in blocks of `block` tokens; block j is stored under a hash of every token and value up to its end
    and of what else changes its keys: the adapter's LoRA (`lora`: its name, None without LoRA: the base's keys) and,
    from the first block holding a <NUM> on, the adapter itself (its phi(values) enters the embedding there). So
    frozen-backbone adapters share the text before the first number. A row reads the longest run of stored blocks its
    prompt begins with (never its last token: its hidden state is needed). Least recently used blocks go first beyond
    `max_tokens` tokens. Only key/value caches: a hybrid model's recurrent state has no per-position keys to reuse.

        prefix = PrefixCache(block=16, max_tokens=16384)
        key = PrefixKey(lora="sunspots", adapter="sunspots", num_token_id=151669)
        n, layers = prefix.lookup(key, ids, values)    # n tokens, [h, n, d] keys / values per layer
        prefix.store(key, ids, values, layers_of_the_whole_prompt)
    """

    def __init__(self, block: int = 16, max_tokens: int = 16384):
        if block < 1 or max_tokens < block:
            raise ValueError(f"block must be >= 1 and max_tokens >= block, got {block}, {max_tokens}")
        self.block, self.max_blocks = block, max_tokens // block
        self._blocks: OrderedDict[bytes, list[tuple[Tensor, Tensor]]] = OrderedDict()
        self.hit_tokens = 0  # prompt tokens read from here (prefill saved)

    def __len__(self) -> int:
        return len(self._blocks)

    def _hashes(self, key: tuple, ids: list[int], values: list[float], n_tokens: int) -> list[bytes]:
        """The chained hashes of the whole blocks among the first `n_tokens` tokens. key = (lora, adapter, <NUM> id)."""
        lora, adapter, num_id = key
        out, digest, numbers = [], hashlib.sha256(repr(lora).encode()).digest(), False
        for j in range(n_tokens // self.block):
            lo, hi = j * self.block, (j + 1) * self.block
            if not numbers and num_id in ids[lo:hi]:
                numbers, digest = True, hashlib.sha256(digest + repr(adapter).encode()).digest()
            digest = hashlib.sha256(digest + array("q", ids[lo:hi]).tobytes()
                                    + array("d", values[lo:hi]).tobytes()).digest()
            out.append(digest)
        return out

    def lookup(self, key: tuple, ids: list[int], values: list[float]) -> tuple[int, list[tuple[Tensor, Tensor]]]:
        """(n, per layer (keys, values) [h, n, d]) of the longest stored prefix of the prompt, n < len(ids)."""
        found = []
        for h in self._hashes(key, ids, values, len(ids) - 1):
            blocks = self._blocks.get(h)
            if blocks is None:
                break
            self._blocks.move_to_end(h)
            found.append(blocks)
        if not found:
            return 0, []
        n = len(found) * self.block
        self.hit_tokens += n
        return n, [(torch.cat([f[i][0] for f in found], 1), torch.cat([f[i][1] for f in found], 1))
                   for i in range(len(found[0]))]

    def store(self, key: tuple, ids: list[int], values: list[float], layers: list[tuple[Tensor, Tensor]],
              start: int = 0) -> None:
        """Keep the blocks of a prompt whose keys / values `layers` ([h, len(ids), d] per layer, tensors of their own:
        the blocks are views of them) hold, from token `start` on (the blocks before it are stored already)."""
        for j, h in enumerate(self._hashes(key, ids, values, len(ids) - 1)):
            lo = j * self.block
            if lo < start:
                continue
            if h in self._blocks:
                self._blocks.move_to_end(h)
                continue
            self._blocks[h] = [(k[:, lo:lo + self.block], v[:, lo:lo + self.block]) for k, v in layers]
            while len(self._blocks) > self.max_blocks:
                self._blocks.popitem(last=False)

    def forget(self) -> None:
        """Drop every block (an adapter was unloaded or its weights changed)."""
        self._blocks.clear()
