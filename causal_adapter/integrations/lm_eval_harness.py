"""EleutherAI's lm-evaluation-harness on a causal adapter (docs/evaluate.md): the harness's model ``causal_adapter``.

    causal-adapter lm-eval --model causal_adapter --model_args base=PATH,adapter=DIR,mode=softmax --tasks T ...
    python -m causal_adapter.integrations.lm_eval_harness --model causal_adapter ...   (the same)

lm-eval finds models in its own registry and reads no entry points, so ``--model causal_adapter`` resolves once this
module has registered it (`register`): the two commands above register it, then run lm-eval's own command line with
every other argument unchanged (``--tasks``, ``--include_path``, ``--limit``, ``--output_path``, ...). In Python:
``register()`` then ``lm_eval.simple_evaluate(model="causal_adapter", model_args=...)``, or pass a
`CausalAdapterLM` instance.

model_args: ``base`` (alias ``pretrained``; a local Qwen folder or a cached hub name; leave it out for the embedded
tiny Qwen, sized by ``tiny_arch`` / ``tiny_hidden_size`` / ``tiny_layers``), ``adapter`` (a saved adapter directory;
left out: a fresh adapter at initialisation, whose softmax scores are the base model's), ``mode`` (``softmax`` |
``ovr``: the token distribution scored, `modeling.loglikelihood`; generation is greedy under it: softmax mode
writes the argmax of loc_S, ovr mode the deterministic OvR decision), ``dtype``, ``max_length`` (default: the
model's max_position_embeddings), ``max_gen_toks`` (256), ``batch_size``, ``device``.

Requests are tokenized number-aware (`NumberTokenizer`), as lm-eval's ``hf`` model tokenizes: the continuation's
tokens are those of context + continuation after the context's own tokens (trailing spaces of the context moved to
the continuation); where a number straddles the two (``"... is 4"`` + ``"2"``), the concatenation's ``<NUM>`` 42 is
scored whole, as part of the continuation. On text without numbers the ids are exactly the Qwen tokenizer's, so the
scores are the ``hf`` model's at initialisation (`tests/test_lm_eval.py`). A request longer than ``max_length`` is
left-truncated as the ``hf`` model truncates it; a continuation longer than ``max_length`` is an error.
"""
from __future__ import annotations

import importlib
import json
import logging
import sys
from typing import Any, Sequence

import torch

from ..model import CausalModel, get_causal_model
from ..modeling.families import text_config
from ..modeling.loglikelihood import MODES, sequence_logprobs
from ..numbers import NumberTokenizer
from ..saving.assets import load_base
from ..saving.hub import check_base

log = logging.getLogger("causal_adapter.lm_eval")
#: the names ``--model`` takes
MODEL_NAMES = ("causal_adapter", "causal-adapter")
DEFAULT_MAX_LENGTH = 2048
DEFAULT_MAX_GEN_TOKS = 256
#: generation mode of each scoring mode: greedy under the distribution scored
GENERATION_MODE = {"softmax": "softmax", "ovr": "deterministic"}


def _lm_eval():
    # lm-eval is an optional dependency (the eval extra): imported only when the harness is used
    try:
        from lm_eval.api.model import LM
        from lm_eval.api.registry import register_model
    except ImportError:
        raise ImportError("lm-evaluation-harness is not installed: pip install 'causal_adapter[eval]'") from None
    return LM, register_model


_CLASS: list = []


def lm_class():
    """The harness model class (a subclass of lm-eval's ``LM``; built on first use, lm-eval being optional)."""
    if _CLASS:
        return _CLASS[0]
    LM, _ = _lm_eval()

    class CausalAdapterLM(_HarnessModel, LM):
        __doc__ = _HarnessModel.__doc__

        def __init__(self, *args, **kwargs):
            LM.__init__(self)
            _HarnessModel.__init__(self, *args, **kwargs)

    _CLASS.append(CausalAdapterLM)
    return CausalAdapterLM


def register() -> None:
    """Register ``causal_adapter`` (and ``causal-adapter``) in lm-eval's model registry (idempotent)."""
    _, register_model = _lm_eval()
    importlib.import_module("lm_eval.models")  # lm-eval's own models first: it fills an empty registry only
    from lm_eval.api.registry import model_registry

    cls = lm_class()
    names = [n for n in MODEL_NAMES if n not in model_registry or model_registry.get(n) is not cls]
    if names:
        register_model(*names)(cls)


class _HarnessModel:
    """lm-eval's ``LM`` for a causal adapter: loglikelihood, loglikelihood_rolling, generate_until (module docstring).

    Give either ``model`` and ``tokenizer`` (a `CausalModel` in memory and its Qwen tokenizer) or the loading
    arguments (``base``, ``adapter``, ...)."""

    def __init__(self, base: str | None = None, adapter: str | None = None, mode: str = "softmax", *,
                 pretrained: str | None = None, dtype: str = "float32", tiny_arch: str = "qwen2",
                 tiny_hidden_size: int = 64, tiny_layers: int = 2, max_length: int | None = None,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, batch_size: int | str = 1, max_batch_size: int | None = None,
                 device: str | None = None, model=None, tokenizer=None, **unknown: Any):
        unknown = {k: v for k, v in unknown.items() if v is not None}
        if unknown:
            raise ValueError(f"model_args: unknown argument(s) {sorted(unknown)}; causal_adapter takes base, adapter, "
                             "mode, dtype, tiny_arch, tiny_hidden_size, tiny_layers, max_length, max_gen_toks")
        if mode not in MODES:
            raise ValueError(f"model_args: mode must be one of {MODES}, got {mode!r}")
        if base is not None and pretrained is not None and str(base) != str(pretrained):
            raise ValueError("model_args: give the base once (base= or pretrained=)")
        base = base if base is not None else pretrained
        base = None if base in ("", "embedded", "None") else base
        if model is None:
            if base is not None:
                check_base(str(base), flag="model_args base")
            backbone, tokenizer = load_base(None if base is None else str(base), arch=tiny_arch, dtype=dtype,
                                            hidden_size=int(tiny_hidden_size), num_layers=int(tiny_layers))
            model = (CausalModel.from_pretrained(backbone, str(adapter), tokenizer=tokenizer) if adapter
                     else get_causal_model(backbone, tokenizer=tokenizer))
        elif tokenizer is None:
            raise ValueError("give the model's tokenizer with model=")
        if device and str(device).startswith("cuda") and not torch.cuda.is_available():
            # lm-eval's command line passes --device (default cuda) to every model: its hf model falls back too
            log.warning("device %r is not available: the model stays on %s", device, model.device)
        elif device:
            model.to(device)
        model.eval()
        self.model, self.tokenizer, self.mode = model, tokenizer, mode
        self.ntok = NumberTokenizer(tokenizer, model.num_token_id)
        context = getattr(text_config(model.backbone), "max_position_embeddings", None)
        self.max_length = int(max_length or context or DEFAULT_MAX_LENGTH)
        self.max_gen_toks = int(max_gen_toks)
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 1  # "auto": one at a time
        eos = tokenizer.eos_token_id
        self.prefix_token_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos

    # ------------------------------------------------------------------ encoding
    def _encode(self, text: str) -> tuple[list[int], list[float], list[str | None]]:
        e = self.ntok.encode_batch([text], return_offsets=False)[0]
        return list(e.input_ids), list(e.numeric_values), list(e.number_texts)

    def encode_pair(self, context: str, continuation: str) -> tuple[tuple[list, list, list], int]:
        """((ids, values, number texts) of the whole sequence, the index of its first continuation token), as lm-eval's
        ``hf`` model splits a request (module docstring)."""
        if context == "":
            ids, vals, texts = self._encode(continuation)
            if ids and ids[0] == self.prefix_token_id:
                return (ids, vals, texts), 1
            return ([self.prefix_token_id] + ids, [0.0] + vals, [None] + texts), 1
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        whole, ctx = self._encode(context + continuation), self._encode(context)
        n = len(ctx[0])
        common = 0
        while (common < min(n, len(whole[0])) and whole[0][common] == ctx[0][common]
               and whole[2][common] == ctx[2][common]):
            common += 1
        num = self.model.num_token_id
        if any(t == num for t in whole[0][common:n]) or any(t == num for t in ctx[0][common:n]):
            return whole, common  # a number across the boundary: the concatenation's number, scored whole
        return tuple(c + w[n:] for c, w in zip(ctx, whole)), n

    def _truncate(self, seq: tuple[list, list, list], start: int) -> tuple[tuple[list, list, list], int]:
        """The last max_length + 1 tokens (the model reads max_length of them), as lm-eval's hf model keeps them."""
        n_cont = len(seq[0]) - start
        if n_cont > self.max_length:
            raise ValueError(f"a continuation of {n_cont} tokens is longer than the model's max_length "
                             f"{self.max_length}: it cannot be scored (raise max_length or shorten the task's targets)")
        cut = max(0, len(seq[0]) - (self.max_length + 1))
        return tuple(x[cut:] for x in seq), start - cut

    def score(self, items: Sequence[tuple[tuple[list, list, list], int]]) -> list[tuple[float, bool]]:
        """(log-likelihood, is_greedy) of tokens start.. of each (sequence, start), `batch_size` at a time."""
        out: list[tuple[float, bool]] = [(0.0, True)] * len(items)
        todo = [(i, *self._truncate(seq, start)) for i, (seq, start) in enumerate(items) if len(seq[0]) > start]
        todo.sort(key=lambda x: -len(x[1][0]))  # similar lengths share a batch
        for c in range(0, len(todo), self.batch_size):
            chunk = todo[c:c + self.batch_size]
            res = sequence_logprobs(self.model, [s[0] for _, s, _ in chunk], [s[1] for _, s, _ in chunk],
                                    [s[2] for _, s, _ in chunk], starts=[st for _, _, st in chunk], mode=self.mode)
            for (i, _, _), r in zip(chunk, res):
                out[i] = (float(r.logprobs.sum()), bool(r.greedy.all()))
        return out

    # ------------------------------------------------------------------ lm-eval's API
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(log P(continuation | context), is_greedy) of each request's (context, continuation)."""
        results = self.score([self.encode_pair(*req.args) for req in requests])
        for req, r in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", req.args, r)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """log P(text) of each request's (text,): after the prefix token, in disjoint windows of max_length tokens
        (lm-eval's rolling windows)."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # the optional dependency

        out = []
        for req in requests:
            ids, vals, texts = self._encode(req.args[0])
            items = []
            for ctx_idx, pred_idx in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=list(range(len(ids))), prefix_token=-1, max_seq_len=self.max_length, context_len=1)):
                idx = ctx_idx + pred_idx  # positions in the text; -1 = the prefix token
                seq = ([ids[i] if i >= 0 else self.prefix_token_id for i in idx],
                       [vals[i] if i >= 0 else 0.0 for i in idx], [texts[i] if i >= 0 else None for i in idx])
                items.append((seq, len(ctx_idx)))
            total = sum(lp for lp, _ in self.score(items))
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
            out.append(total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy text after each request's context under the mode's distribution, cut before the first of ``until``;
        ``max_gen_toks`` tokens at most. A context longer than max_length - max_gen_toks keeps its last tokens."""
        out: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        for key, members in groups.items():
            kwargs = dict(requests[members[0]].args[1])
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", kwargs.pop("max_new_tokens", self.max_gen_toks)))
            do_sample = bool(kwargs.pop("do_sample", False))
            temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
            sampling = do_sample and temperature > 0
            if sampling and self.mode != "softmax":
                raise ValueError("sampling (do_sample, temperature > 0) draws from the softmax: use mode=softmax")
            prompts = [self._fit_prompt(requests[i].args[0], max_new) for i in members]
            outs = self.model.generate_batched(prompts, tokenizer=self.ntok, batch_size=self.batch_size,
                                               mode=GENERATION_MODE[self.mode], max_new_tokens=max_new,
                                               stop_strings=until or None, do_sample=sampling,
                                               temperature=temperature if sampling else None)
            for i, o in zip(members, outs):
                text = o.texts[0]
                cuts = [text.index(s) for s in until if s and s in text]
                text = text[:min(cuts)] if cuts else text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
                out[i] = text
        return out  # type: ignore[return-value]

    def _fit_prompt(self, context: str, max_new: int) -> str:
        ids, vals, texts = self._encode(context)
        keep = max(1, self.max_length - max_new)
        if len(ids) <= keep:
            return context
        return self.ntok.decode(ids[-keep:], vals[-keep:], texts[-keep:])

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", "qwen").replace("/", "__")


def main(argv: Sequence[str] | None = None) -> int:
    """lm-eval's command line with ``--model causal_adapter`` registered (module docstring)."""
    register()
    from lm_eval.__main__ import cli_evaluate  # the optional dependency

    argv = list(sys.argv[1:] if argv is None else argv)
    saved = sys.argv
    sys.argv = ["lm-eval", *argv]  # lm-eval's parser reads sys.argv (and inserts its "run" there)
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
