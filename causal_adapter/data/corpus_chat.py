"""The ``chat`` corpus (`chat_corpus`): multi-turn chats that ask for values of the real series (`CHAT_SERIES`), in
TRL's conversational format (a ``messages`` column), split by time per series."""
from __future__ import annotations

import math
import random
from typing import Sequence

from .corpus_rows import DEFAULT_SPLIT, SPLITS, _baseline_features, _split_sizes, canonical_value
from .corpus_sources import _co2_data, _elnino_data, _macro_data, _nile_data, _sunspots_data

#: the chat corpus's series: name -> (loader of (time labels, values), title, what a value is called)
CHAT_SERIES = {
    "sunspots": (_sunspots_data, "Yearly sunspot numbers", "sunspot number"),
    "nile": (_nile_data, "Annual flow of the Nile at Aswan (10^8 m^3)", "flow"),
    "co2": (_co2_data, "Monthly mean CO2 at Mauna Loa (ppm)", "CO2 level"),
    "elnino": (_elnino_data, "Monthly sea surface temperature, Pacific 0-10 S 90-80 W (deg C)", "temperature"),
    "macro/unemp": (lambda corpus: _macro_data("unemp", corpus), "US quarterly unemployment rate (%)",
                    "unemployment rate"),
    "macro/infl": (lambda corpus: _macro_data("infl", corpus), "US quarterly inflation rate (%)", "inflation rate"),
    "macro/realgdp": (lambda corpus: _macro_data("realgdp", corpus),
                      "US quarterly real GDP (billions of 2005 dollars)", "real GDP"),
}
#: no digit in any of these: the first number of an assistant reply is the value, the prompt's numbers are the data
_CHAT_SYSTEMS = (
    "You answer with the value asked for.",
    "You are a careful data assistant. Give the value first, then stop.",
    "Answer each question with the number from the series.",
)
# the time labels are the series' own (co2 skips 5 months without data): no question says "the next month"
_CHAT_FIRST_QUESTIONS = ("What was the {noun} in {t}?", "What was it in {t}?", "Give the {noun} for {t}.",
                         "What is the value for {t}?", "Which value follows, for {t}?")
_CHAT_NEXT_QUESTIONS = ("And in {t}?", "What about {t}?", "And {t}?", "And the {noun} in {t}?",
                        "Then what was the {noun} in {t}?")
# the value is a reply's only number: a year after it ("154.6 (1980).") would be an assistant number too, a regression
# target of its own, and would move the previous value among the recent numbers the value head reads (measured: the
# head then lost to least squares on the prompt's numbers)
_CHAT_ANSWERS = ("{v}.", "It was {v}.", "The {noun} was {v}.", "That would be {v}.")
CHAT_MIN_WINDOW = 3


def _chat_conversation(rng: random.Random, series: str, texts: list[tuple[str, float]], times: list[str],
                       i: int, end: int, max_window: int) -> dict:
    """One conversation whose first answer is the value at ``i`` and whose answers all lie before ``end``."""
    _, title, noun = CHAT_SERIES[series]
    hi = min(max_window, i)
    # log-uniform window length in [CHAT_MIN_WINDOW, hi]: short and long prompts alike
    w = min(hi, max(CHAT_MIN_WINDOW, int(round(math.exp(rng.uniform(math.log(CHAT_MIN_WINDOW),
                                                                          math.log(hi + 0.5)))))))
    k = min(rng.randint(1, 3), end - i)
    history = [f"{times[j]}: {texts[j][0]}" for j in range(i - w, i)]
    if rng.random() < 0.5:
        data = f"{title}: " + "; ".join(history) + "."
    else:
        data = f"{title}:\n" + "\n".join(history)
    messages = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": rng.choice(_CHAT_SYSTEMS)})
    for e in range(k):
        t, v = times[i + e], texts[i + e][0]
        fmt = {"t": t, "noun": noun}
        if e == 0:
            question = data + ("\n" if "\n" in data else " ") + rng.choice(_CHAT_FIRST_QUESTIONS).format(**fmt)
        else:
            question = rng.choice(_CHAT_NEXT_QUESTIONS).format(**fmt)
        messages.append({"role": "user", "content": question})
        messages.append({"role": "assistant", "content": rng.choice(_CHAT_ANSWERS).format(v=v, **fmt)})
    last = i + k - 1  # the value `predict` reads: the first number of the LAST reply (a conversation's question)
    return {"messages": messages, "target": texts[last][1], "previous": texts[last - 1][1], "time": times[last],
            "t_index": last, "series": series}


def chat_corpus(window: int = 48, seed: int = 0, split_fractions=DEFAULT_SPLIT, series: Sequence[str] | None = None):
    """Multi-turn chats that ask for values of real series, in TRL's conversational language-modelling format:
    a ``messages`` column of ``{"role", "content"}`` dicts (an optional system message, then 1 to 3 user /
    assistant exchanges). The first user turn gives a window of a series (sunspots, nile, co2, elnino and three
    macrodata columns, `CHAT_SERIES`; ``series`` picks some) and asks for the next time step; each later user
    turn asks for the step after. Every assistant reply's FIRST number is the true value, in canonical format.

    ``window`` is the LONGEST window: each conversation draws its own length log-uniformly in [3, window], and
    its number of exchanges in 1..3, with ``random.Random(seed)``, so rows range from ~100 to ~1,500 characters.
    One conversation per (series, first answered step). Split by time per series as the series corpora are: the
    answerable steps of each series are cut 80/10/10 (``split_fractions``) and a conversation's answers all lie
    inside its split's steps (the exchanges stop at the split's end), so no answered value is in two splits;
    within a split the series are interleaved, each in time order.

    Columns besides ``messages``: target (the LAST answer's value: what `predict` reads on the conversation),
    previous (the value of the step before it, in the conversation: the persistence baseline), time (the last
    answer's time label), t_index (its position in the series), series."""
    import datasets

    if isinstance(window, bool) or not isinstance(window, int) or window < CHAT_MIN_WINDOW:
        raise ValueError(f"window must be an int >= {CHAT_MIN_WINDOW} (the longest window of the chat corpus), "
                         f"got {window!r}")
    names = list(CHAT_SERIES) if series is None else list(series)
    unknown = [n for n in names if n not in CHAT_SERIES]
    if unknown or not names:
        raise ValueError(f"chat series {unknown or names!r} unknown; choose from {list(CHAT_SERIES)}")
    rng = random.Random(seed)
    parts: dict[str, list[tuple[float, int, dict]]] = {k: [] for k in SPLITS}
    for order, name in enumerate(names):
        times, values = CHAT_SERIES[name][0]("chat")
        texts = [canonical_value(v) for v in values]
        n_steps = len(values) - CHAT_MIN_WINDOW
        sizes = _split_sizes(n_steps, split_fractions, f"chat/{name}")
        start = CHAT_MIN_WINDOW
        for split, size in zip(SPLITS, sizes):
            end = start + size
            for i in range(start, end):
                row = _chat_conversation(rng, name, texts, times, i, end, window)
                parts[split].append(((i - start) / size, order, row))
            start = end
    features = datasets.Features({
        "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
        **_baseline_features()})
    return datasets.DatasetDict({
        k: datasets.Dataset.from_list([r for _, _, r in sorted(v, key=lambda x: x[:2])], features=features)
        for k, v in parts.items()
    })
