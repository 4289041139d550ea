"""Offline numeric corpora for demos, evaluation and tests.

Built from real data that packages bundle (statsmodels: sunspots, nile, co2, macrodata;
scikit-learn: diabetes; optional ``demo`` extras, imported lazily) and from seeded templates
(arithmetic, unit conversions). Every builder returns a ``datasets.DatasetDict`` with
train/validation/test split by time (time series: the test targets are the latest), columns
prompt, completion, target, previous, time, t_index, series. The ``chat`` corpus (`CHAT_CORPORA`)
has a ``messages`` column (multi-turn chats asking for values of the real series, TRL's
conversational format) instead of prompt / completion.

This module is the corpus registry (`CORPORA`, `build_corpus`, `write_corpus_jsonl`) and the prompt / completion
builders; the rows they share are in `corpus_rows`, the real series' loaders in `corpus_sources`, the chat corpus
in `corpus_chat` (all importable from here as before).

CLI: ``python -m causal_adapter data NAME OUT_DIR [--window W] [--n N] [--seed S]`` (or
``causal-adapter data``) writes ``OUT_DIR/NAME_{train,validation,test}.jsonl``.
"""
from __future__ import annotations

import json
import math
import os
import random
import tempfile

from ..numbers import format_number
from .corpus_chat import CHAT_MIN_WINDOW, CHAT_SERIES, chat_corpus
from .corpus_rows import DEFAULT_SPLIT, SPLITS, _baseline_features, _split_sizes, _to_dataset_dict, _unique_rows, \
    canonical_value, series_rows
from .corpus_sources import _co2_data, _elnino_data, _macro_data, _nile_data, _require, _sunspots_data

# the names this module held before the rows, the loaders and the chat corpus moved out, kept importable from here
__all__ = ["CORPORA", "CHAT_CORPORA", "ALL_CORPORA", "DEFAULT_SPLIT", "SPLITS", "build_corpus", "write_corpus_jsonl",
           "canonical_value", "series_rows", "_baseline_features", "_split_sizes", "_to_dataset_dict", "_unique_rows",
           "_require", "_sunspots_data", "_nile_data", "_co2_data", "_elnino_data", "_macro_data",
           "sunspots_corpus", "nile_corpus", "co2_corpus", "elnino_corpus", "macro_corpus", "diabetes_corpus",
           "engel_corpus", "arithmetic_corpus", "units_corpus", "heteroscedastic_corpus", "NOISE_REGIMES", "noise_sd",
           "CHAT_SERIES", "CHAT_MIN_WINDOW", "chat_corpus"]

# --------------------------------------------------------------------------- corpora
#: the prompt / completion corpora (what `train --dataset` and `eval --dataset` offer)
CORPORA = ("sunspots", "nile", "co2", "elnino", "macro", "diabetes", "engel", "arithmetic", "units", "heteroscedastic")
#: the conversational corpora: a ``messages`` column (TRL's conversational format) instead of prompt / completion
CHAT_CORPORA = ("chat",)
#: every corpus `build_corpus` and `causal-adapter data` know
ALL_CORPORA = CORPORA + CHAT_CORPORA


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
