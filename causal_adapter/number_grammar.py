"""The number grammar (SPEC section 1, docs/numbers.md "Number grammar", the normative text of the rules implemented
here): which spans of a text are numbers (`NUMBER_RE`, `find_numbers`), their values (`parse_number`) and the
canonical text of a value (`format_number`). Layer 1, beside `numbers` (the tokenizer that turns each number into one
``<NUM>``), which re-exports every name here.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

#: Largest finite float32. Values are fed to the model as float32, so a number whose magnitude
#: exceeds this (``1e39``, ``1e400``, a 500-digit integer) is NOT a number: it stays text.
FLOAT32_MAX = 3.4028234663852886e38

# Scripts written without spaces between words (CJK ideographs, kana, hangul, bopomofo, yi,
# thai, lao, myanmar, khmer): their letters do not "glue" to digits, so 99.9 is a number in
# "价格是99.9元" and 3 in "3개". Every other Unicode word character (letters of any other script,
# any digit, underscore) glues: digits touching it are text ("Qwen2.5", "x86_64", "H2O", "3rd").
_NO_GLUE = (
    "\u0e00-\u0eff"  # thai, lao
    "\u1000-\u109f"  # myanmar
    "\u1100-\u11ff"  # hangul jamo
    "\u1780-\u17ff"  # khmer
    "\u2e80-\u2fdf"  # cjk radicals, kangxi
    "\u3005-\u3007\u3021-\u3029\u3031-\u3035\u3038-\u303c"  # cjk iteration marks / numerals
    "\u3040-\u30ff"  # hiragana, katakana
    "\u3100-\u318f"  # bopomofo, hangul compatibility jamo
    "\u31a0-\u31ff"  # bopomofo ext, katakana ext
    "\u3400-\u4dbf"  # cjk ext A
    "\u4e00-\u9fff"  # cjk unified
    "\ua000-\ua4cf"  # yi
    "\uac00-\ud7af"  # hangul syllables
    "\uf900-\ufaff"  # cjk compatibility
    "\uff66-\uff9f"  # halfwidth katakana
    "\U00020000-\U0003134f"  # cjk ext B-G
)
_GLUE = rf"[^\W{_NO_GLUE}]"  # one glue character
_GLUE_RE = re.compile(_GLUE)
_SIGNS = "-+\u2212"  # hyphen-minus, plus, U+2212 MINUS SIGN
_SIGN_CLASS = r"\-+\u2212"  # the same, safe inside [...]

#: The number grammar as one regular expression (boundary rules included; the only rule not
#: expressible here, the hyphen-after-identifier rule, is applied by `find_numbers`).
NUMBER_RE = re.compile(
    rf"""
    (?=[-+\u2212.0-9])                                  # (fast path: candidates start with these)
    (?:
        (?<!{_GLUE})(?<![.)\]}}%{_SIGN_CLASS}])[{_SIGN_CLASS}]    # a sign: not after a word, ')', '.', '%', a sign
      | (?<!{_GLUE})(?<![.])                             # or no sign: not after a word or a '.'
    )
    (?:
        (?:
            [1-9][0-9]{{0,2}}(?:,[0-9]{{3}}){{1,12}}(?![0-9]|,[0-9])  # 1,234,567 (strict groups of 3)
          | [0-9]+
        )
        (?:
            \.[0-9]+                                     # 99.9
          | \.(?=[eE][-+]?[0-9]|[,;)\]}}])               # 5. (only before an exponent or , ; ) ] }})
        )?
      | \.[0-9]+                                         # .5
    )
    (?:[eE][-+]?[0-9]+)?                                 # exponent: 3e-4, 1.2E+5
    (?!{_GLUE})(?!\.{_GLUE})                             # not glued to a word, not 1.2.3
    """,
    re.VERBOSE,
)
_FINDITER = NUMBER_RE.finditer


@dataclass(frozen=True)
class NumberSpan:
    """One recognised number: ``text[start:end] == source``, ``value`` its finite float value."""

    start: int
    end: int
    value: float
    source: str


def parse_number(source: str) -> float | None:
    """The value of a string that matched the grammar (thousands commas dropped, U+2212 read as
    '-'), or None when it is not finite in float32 (|value| > FLOAT32_MAX)."""
    try:
        value = float(source)
    except ValueError:
        value = float(source.replace(",", "").replace("\u2212", "-"))
    if -FLOAT32_MAX <= value <= FLOAT32_MAX:
        return value
    return None


def _after_identifier(text: str, start: int, memo: list) -> bool:
    """True when the sign character at ``start - 1`` (not the number's own sign) joins the number
    to an identifier on its left (``GPT-4``, ``x86-64``, ``COVID-19``): walk left over ASCII
    digits, '.', and sign characters; if the first other character is a word character the number
    is text. ``2024-01-05``, ``3-5`` are numbers. ``memo`` = [position, verdict] of the previous
    walk in this text: a walk reaching it has the same verdict (keeps ``1-2-3-...`` linear)."""
    i = start - 2
    while i >= 0:
        if i == memo[0]:
            verdict = memo[1]
            break
        ch = text[i]
        if ch in "0123456789.-+\u2212":
            i -= 1
            continue
        verdict = _GLUE_RE.match(ch) is not None
        break
    else:
        verdict = False
    memo[0], memo[1] = start - 2, verdict
    return verdict


def _scan(text: str) -> list[tuple[int, int, float, str]]:
    """(start, end, value, source) of every number of ``text`` (the grammar's single code path)."""
    out = []
    append = out.append
    memo = [-1, False]
    for m in _FINDITER(text):
        s, e = m.span()
        src = text[s:e]
        if s and text[s - 1] in _SIGNS and src[0] not in _SIGNS and _after_identifier(text, s, memo):
            continue
        try:
            v = float(src)
        except ValueError:
            v = float(src.replace(",", "").replace("\u2212", "-"))
        if -FLOAT32_MAX <= v <= FLOAT32_MAX:
            append((s, e, v, src))
    return out


def find_numbers(text: str) -> list[NumberSpan]:
    """All numbers of ``text`` in order, per the grammar of docs/numbers.md."""
    if not isinstance(text, str):
        raise ValueError(f"find_numbers expects a str, got {type(text).__name__}: {text!r:.80}")
    return [NumberSpan(*t) for t in _scan(text)]


def format_number(value: float) -> str:
    """Canonical text of a value (used for generated values, which have no source string).

    * 0 (and -0.0) -> ``"0"``; a leading ``-`` (ASCII hyphen-minus) for negatives;
    * ``1e-4 <= |v| < 1e15``: fixed notation rounded to 6 significant digits, but never fewer
      digits than the integer part has; trailing zeros and a trailing '.' dropped
      (``80.9``, ``3500``, ``1234567``, ``0.000123457``, ``45.2346``);
    * otherwise scientific, mantissa with up to 6 significant digits, exponent without '+' or
      leading zeros (``1.5e20``, ``-3e-05`` -> ``-3e-5``).

    The result is always a single number of the grammar, whose value is ``value`` up to a
    relative error of 5e-6 (exactly ``value`` when ``value`` has <= 6 significant digits).
    """
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"format_number: value must be finite, got {value!r}")
    if v == 0.0:
        return "0"
    a = abs(v)
    if 1e-4 <= a < 1e15:
        digits = max(0, 5 - math.floor(math.log10(a)))
        s = f"{v:.{digits}f}"
        if "." in s:
            s = s.rstrip("0").rstrip(".")
        if s in ("-0", "0"):  # rounding can't reach 0 for |v| >= 1e-4, kept as a guard
            return "0"
        return s
    mant, exp = f"{v:.5e}".split("e")
    if "." in mant:
        mant = mant.rstrip("0").rstrip(".")
    out = f"{mant}e{int(exp)}"
    if a <= FLOAT32_MAX < abs(float(out)):  # rounding pushed it past the float32 range: exact form
        mant, exp = repr(v).split("e")
        out = f"{mant}e{int(exp)}"
    return out
