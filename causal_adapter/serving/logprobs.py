"""``logprobs`` and ``echo`` of ``/v1/completions`` (docs/serving.md), as OpenAI's legacy API and vLLM give them: per
token its text, its log-probability (``token_logprobs``; None for the prompt's first token, which nothing
predicts), up to ``logprobs`` alternatives (``top_logprobs``: text -> log-probability, the chosen token included, as
vLLM includes it) and its character offset in the choice's text (``text_offset``).

The numbers are `modeling.loglikelihood.sequence_logprobs`'s, the function lm-evaluation-harness's in-process model
uses: a number scores log P(<NUM>) + log P(its value rounds to the written text). A prompt given as token ids (what
lm-eval's ``local-completions`` sends) is answered in those tokens: its text (the ids decoded) is encoded number-aware
and scored, and each number-aware token's log-probability goes to the given token holding its last character (the
digits before a number's last one get 0.0: the number is scored once, on its last token), so lm-eval's slicing by
its own token count scores the continuation it asked for."""
from __future__ import annotations

from typing import Sequence

from ..modeling.loglikelihood import encode_with_texts, sequence_logprobs
from ..numbers import NumberTokenizer

#: the most alternatives per token a request may ask for (vLLM's default --max-logprobs)
MAX_LOGPROBS = 20


def _token_ends(tokenizer, ids: Sequence[int], text: str) -> list[int]:
    """The character end, in `text` (the ids decoded), of each token: a token that ends inside a character (a byte of
    a multi-byte UTF-8 character) gets the end of the token completing it."""
    pieces = [tokenizer.decode([t]) for t in ids]
    if "".join(pieces) == text:
        ends, n = [], 0
        for p in pieces:
            n += len(p)
            ends.append(n)
        return ends
    ends_opt: list[int | None] = []
    for k in range(len(ids)):
        s = tokenizer.decode(list(ids[:k + 1]))
        ends_opt.append(len(s) if text.startswith(s) else None)
    out, nxt = [0] * len(ids), len(text)
    for k in range(len(ids) - 1, -1, -1):
        nxt = ends_opt[k] if ends_opt[k] is not None else nxt
        out[k] = nxt
    return out


def _entry(tokens, token_logprobs, top, offsets, text, lp, alternatives, offset):
    tokens.append(text)
    token_logprobs.append(lp)
    top.append(alternatives)
    offsets.append(offset)


def completion_logprobs(model, ntok: NumberTokenizer, prompt: str, generated_ids: Sequence[int],
                        generated_values: Sequence[float], *, echo: bool, top_k: int, mode: str,
                        prompt_ids: Sequence[int] | None = None, text_limit: int | None = None) -> dict:
    """OpenAI's ``logprobs`` object of one choice: the prompt's tokens (with `echo`; the given `prompt_ids` when the
    prompt came as ids, else its number-aware tokens) then the generated tokens (`generated_ids` / values, as the step
    loop wrote and fed them), whose texts together stay within `text_limit` characters (the completion cut before a
    stop string). `top_k` alternatives per token, `mode` the scored distribution ("softmax" | "ovr")."""
    tokenizer = ntok.tokenizer
    p_ids, p_vals, p_texts = encode_with_texts(ntok, prompt)
    g_ids, g_vals = [int(t) for t in generated_ids], [float(v) for v in generated_values]
    num = ntok.num_token_id
    g_texts = [ntok.decode([t], [v]) if t == num else None for t, v in zip(g_ids, g_vals)]
    ids, vals, texts = p_ids + g_ids, p_vals + g_vals, p_texts + g_texts
    scored = sequence_logprobs(model, [ids], [vals], [texts], starts=[1], mode=mode, top_k=top_k)[0] if len(ids) > 1 \
        else None
    lps = [None] + ([float(x) for x in scored.logprobs] if scored else [])

    def alternatives(j: int, own: str | None = None) -> dict | None:
        """Token j's alternatives: text -> log-probability (its own included, under the text `own`)."""
        if j == 0 or scored is None:
            return None
        t = j - 1
        out = {}
        for tid, lp, ntext in zip(scored.top_ids[t].tolist(), scored.top_logprobs[t].tolist(), scored.top_texts[t]):
            key = ntext if ntext is not None else tokenizer.decode([tid])
            out[key] = max(out.get(key, float("-inf")), float(lp))
        if own is None:
            own = texts[j] if ids[j] == num else tokenizer.decode([ids[j]])
        out[own] = lps[j]
        return out

    tokens, token_logprobs, top, offsets = [], [], [], []
    pos = 0
    if echo:
        if prompt_ids is None:
            for j in range(len(p_ids)):
                piece = p_texts[j] if p_ids[j] == num else tokenizer.decode([p_ids[j]])
                _entry(tokens, token_logprobs, top, offsets, piece, lps[j], alternatives(j), pos)
                pos += len(piece)
        else:
            ends = _token_ends(tokenizer, prompt_ids, prompt)
            ours = ntok.encode(prompt).offsets  # the number-aware tokens' character spans
            owner = {}  # given token k -> the number-aware tokens whose last character it holds
            k = 0
            for j, (_, e) in enumerate(ours):
                while k < len(ends) - 1 and ends[k] < e:
                    k += 1
                owner.setdefault(k, []).append(j)
            start = 0
            for k, tid in enumerate(prompt_ids):
                piece = prompt[start:ends[k]]
                js = owner.get(k, [])
                if k == 0:
                    lp, alt = None, None
                elif len(js) == 1 and js[0] > 0:
                    lp, alt = lps[js[0]], alternatives(js[0])
                    if p_ids[js[0]] == num or tid != p_ids[js[0]]:
                        alt = {**(alt or {}), piece: lp}  # the given token's own text as the choice
                else:  # several tokens (their sum) or none (inside a number: scored on its last token)
                    lp = float(sum(lps[j] for j in js if j > 0))
                    alt = {piece: lp}
                _entry(tokens, token_logprobs, top, offsets, piece, lp, alt, start)
                start = ends[k]
            pos = len(prompt)
    base = len(p_ids)
    written = 0
    for i in range(len(g_ids)):
        j = base + i
        piece = g_texts[i] if g_ids[i] == num else tokenizer.decode([g_ids[i]], skip_special_tokens=True)
        if g_ids[i] == num and ids[j - 1] == num:
            piece = " " + piece  # two numbers in a row are written apart (`NumberTokenizer.decode`)
        if text_limit is not None and written >= text_limit:
            break  # the completion was cut before a stop string: the tokens it kept
        _entry(tokens, token_logprobs, top, offsets, piece, lps[j], alternatives(j, piece), pos)
        pos += len(piece)
        written += len(piece)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
