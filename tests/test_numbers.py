"""Number grammar, NumberTokenizer encode/decode/padding against the real Qwen3 tokenizer."""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from causal_adapter.numbers import (
    FLOAT32_MAX,
    NumberEncoding,
    NumberTokenizer,
    find_numbers,
    format_number,
)


@pytest.fixture(scope="module")
def tok(qwen_tokenizer):
    return qwen_tokenizer


@pytest.fixture(scope="module")
def ntok(tok):
    return NumberTokenizer(tok)


def ids_of(tok, s):
    return tok(s, add_special_tokens=False)["input_ids"]


# --------------------------------------------------------------------------- grammar table
# (text, [(source, value), ...]) — values written out independently of the implementation.
GRAMMAR = [
    # integers and decimals
    ("42", [("42", 42.0)]),
    ("99.9", [("99.9", 99.9)]),
    (".5", [(".5", 0.5)]),
    ("x = .5;", [(".5", 0.5)]),
    ("[1., 2.]", [("1.", 1.0), ("2.", 2.0)]),
    ("f(5.)", [("5.", 5.0)]),
    ("5.e3", [("5.e3", 5000.0)]),
    ("I have 5.", [("5", 5.0)]),
    ("I have 5. Then 6.\n", [("5", 5.0), ("6", 6.0)]),
    ("007 and 0.000", [("007", 7.0), ("0.000", 0.0)]),
    # signs vs hyphens
    ("-12.5", [("-12.5", -12.5)]),
    ("(-3)", [("-3", -3.0)]),
    ("x = -2", [("-2", -2.0)]),
    ("+7 points", [("+7", 7.0)]),
    ("3-5", [("3", 3.0), ("5", 5.0)]),
    ("3 - 5", [("3", 3.0), ("5", 5.0)]),
    ("3 -5", [("3", 3.0), ("-5", -5.0)]),
    ("1,-5", [("1", 1.0), ("-5", -5.0)]),
    ("(a+b)-5", [("5", 5.0)]),
    ("--5", [("5", 5.0)]),
    ("10-20%", [("10", 10.0), ("20", 20.0)]),
    ("1.5-2.5", [("1.5", 1.5), ("2.5", 2.5)]),
    ("2024-01-05", [("2024", 2024.0), ("01", 1.0), ("05", 5.0)]),
    ("on 2024-01-05.", [("2024", 2024.0), ("01", 1.0), ("05", 5.0)]),
    ("12:30", [("12", 12.0), ("30", 30.0)]),
    ("1/2", [("1", 1.0), ("2", 2.0)]),
    ("\u22125", [("\u22125", -5.0)]),
    ("T = \u22123.5 K", [("\u22123.5", -3.5)]),
    ("-0", [("-0", -0.0)]),
    # scientific notation
    ("3e-4", [("3e-4", 3e-4)]),
    ("1.2E+5", [("1.2E+5", 1.2e5)]),
    ("lr=3e-4,", [("3e-4", 3e-4)]),
    ("-2.5e3", [("-2.5e3", -2500.0)]),
    ("3e", []),
    ("3e-4x", []),
    # glued to letters / identifiers: text
    ("Qwen2.5", []),
    ("x86_64", []),
    ("v1.2.3", []),
    ("1.2.3", []),
    ("192.168.0.1", []),
    ("H2O", []),
    ("3rd", []),
    ("5km", []),
    ("mp3", []),
    ("1_000", []),
    ("GPT-4", []),
    ("COVID-19", []),
    ("x86-64", []),
    ("a-5", []),
    ("C++11", []),
    ("4-way", [("4", 4.0)]),
    ("Qwen2.5-0.5B has 0.5 billion", [("0.5", 0.5)]),
    # thousands separators
    ("1,234.5", [("1,234.5", 1234.5)]),
    ("12,345,678", [("12,345,678", 12345678.0)]),
    ("3,5", [("3", 3.0), ("5", 5.0)]),
    ("1,23", [("1", 1.0), ("23", 23.0)]),
    ("1,234,5", [("1", 1.0), ("234", 234.0), ("5", 5.0)]),
    ("0,123", [("0", 0.0), ("123", 123.0)]),
    ("1234,567", [("1234", 1234.0), ("567", 567.0)]),
    ("-1,000", [("-1,000", -1000.0)]),
    # percent, currency, units
    ("12%", [("12", 12.0)]),
    ("$5 and 5$", [("5", 5.0), ("5", 5.0)]),
    ("30°C", [("30", 30.0)]),
    ("5 km", [("5", 5.0)]),
    # non-finite / overflow: text
    ("nan inf Infinity NaN", []),
    ("1e400", []),
    ("-1e400", []),
    ("1e39", []),
    ("1" * 500, []),
    ("3.4e38", [("3.4e38", 3.4e38)]),
    ("1e-400", [("1e-400", 0.0)]),
    # CJK / scripts without spaces
    ("价格是99.9元", [("99.9", 99.9)]),
    ("温度-5度", [("-5", -5.0)]),
    ("3개", [("3", 3.0)]),
    ("１２３", []),
    ("x²", []),
    # several numbers, boundaries, punctuation, newlines
    ("1, 2, 3.", [("1", 1.0), ("2", 2.0), ("3", 3.0)]),
    ("7 apples and 2.5 pears cost 10", [("7", 7.0), ("2.5", 2.5), ("10", 10.0)]),
    ("(1.5),[2],{3};", [("1.5", 1.5), ("2", 2.0), ("3", 3.0)]),
    ("a\n5\nb", [("5", 5.0)]),
    ("\t-4\n", [("-4", -4.0)]),
    ('"12"', [("12", 12.0)]),
    ("<NUM>", []),
    ("<NUM>5", [("5", 5.0)]),
    ("", []),
]


@pytest.mark.parametrize("text,expected", GRAMMAR, ids=[repr(t)[:40] for t, _ in GRAMMAR])
def test_grammar_table(text, expected):
    spans = find_numbers(text)
    assert [(s.source, s.value) for s in spans] == expected
    for s in spans:
        assert text[s.start:s.end] == s.source
        assert math.copysign(1.0, s.value) == math.copysign(1.0, dict(expected)[s.source])


def test_unicode_minus_and_minus_zero_signs():
    assert math.copysign(1.0, find_numbers("-0")[0].value) == -1.0
    assert find_numbers("\u22122.5")[0].value == -2.5


def test_find_numbers_rejects_non_str():
    with pytest.raises(ValueError, match="str"):
        find_numbers(12)


# --------------------------------------------------------------------------- format_number
FORMAT = [
    (0.0, "0"), (-0.0, "0"), (1.0, "1"), (-3.5, "-3.5"), (80.9, "80.9"), (3500.0, "3500"),
    (1234567.0, "1234567"), (45.23456789, "45.2346"), (0.000123456789, "0.000123457"),
    (1e-4, "0.0001"), (0.1 + 0.2, "0.3"), (999999.7, "1000000"), (9.9999996, "10"),
    (1e20, "1e20"), (-3e-5, "-3e-5"), (1.5e15, "1.5e15"), (123456.4, "123456"),
    (2.0 ** -30, "9.31323e-10"),
]


@pytest.mark.parametrize("value,text", FORMAT)
def test_format_number_table(value, text):
    assert format_number(value) == text


def test_format_number_rejects_non_finite():
    for v in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match="finite"):
            format_number(v)


finite32 = st.floats(min_value=-FLOAT32_MAX, max_value=FLOAT32_MAX, allow_nan=False, allow_infinity=False)


@settings(max_examples=300, deadline=None)
@given(finite32)
def test_format_number_is_one_number_of_the_grammar(v):
    s = format_number(v)
    spans = find_numbers(s)
    assert len(spans) == 1 and spans[0].source == s
    got = spans[0].value
    assert got == v or abs(got - v) <= 5e-6 * abs(v)
    assert format_number(got) == s  # canonical form is a fixed point


# --------------------------------------------------------------------------- encoding
def test_defaults(tok, ntok):
    assert ntok.num_token_id == len(tok)
    assert ntok.tokenizer is tok
    assert ntok.pad_token_id == tok.pad_token_id
    assert NumberTokenizer(tok, num_token_id=len(tok) + 5).num_token_id == len(tok) + 5
    for bad in (-1, 1.5, True, "x"):
        with pytest.raises(ValueError, match="num_token_id"):
            NumberTokenizer(tok, num_token_id=bad)


def test_no_special_tokens_added_to_tokenizer(tok):
    before = len(tok)
    NumberTokenizer(tok)
    assert len(tok) == before
    assert "<NUM>" not in tok.get_vocab()


@pytest.mark.parametrize("text", [
    "Hello world, this has no numbers at all.",
    "价格是多少？",
    "<NUM> is plain text here, like <|im_end|>",
    "  leading and trailing spaces  \n\n",
    "Qwen2.5 and x86_64 and H2O and v1.2.3",
    "",
])
def test_text_without_numbers_gives_tokenizer_ids(tok, ntok, text):
    enc = ntok.encode(text)
    assert enc.input_ids == tok(text)["input_ids"]
    assert enc.numeric_values == [0.0] * len(enc.input_ids)
    assert ntok.num_token_id not in enc.input_ids


@pytest.mark.parametrize("segments,values", [
    (["Price: ", " dollars, ", " left"], [12.5, -3.0]),
    (["价格是", "元"], [99.9]),
    (["", " apples"], [7.0]),
    (["Total ", ""], [1234.5]),
    (["a ", "-", " b"], [3.0, 5.0]),
    (["x\n", "\n", ""], [1.0, 2.0]),
])
def test_number_text_is_segments_plus_num(tok, ntok, segments, values):
    texts = {12.5: "12.5", -3.0: "-3", 99.9: "99.9", 7.0: "7", 1234.5: "1,234.5", 3.0: "3", 5.0: "5",
             1.0: "1", 2.0: "2"}
    text = segments[0] + "".join(texts[v] + seg for v, seg in zip(values, segments[1:]))
    num = ntok.num_token_id
    exp_ids, exp_vals = list(ids_of(tok, segments[0])), [0.0] * len(ids_of(tok, segments[0]))
    for v, seg in zip(values, segments[1:]):
        seg_ids = ids_of(tok, seg)
        exp_ids += [num] + seg_ids
        exp_vals += [v] + [0.0] * len(seg_ids)
    enc = ntok.encode(text)
    assert enc.input_ids == exp_ids
    assert enc.numeric_values == exp_vals


def test_space_before_number_stays_a_space_token(tok, ntok):
    enc = ntok.encode("a 1234")
    assert enc.input_ids == [tok("a")["input_ids"][0], 220, ntok.num_token_id]
    assert tok(" 1234")["input_ids"][0] == 220  # what Qwen itself does


def test_chinese_example(tok, ntok):
    enc = ntok.encode("价格是99.9元")
    assert enc.input_ids == ids_of(tok, "价格是") + [ntok.num_token_id] + ids_of(tok, "元")
    assert len(enc.input_ids) == 4
    assert enc.numeric_values == [0.0, 0.0, 99.9, 0.0]
    assert enc.number_texts == [None, None, "99.9", None]


def test_offsets_and_number_texts(ntok):
    text = "Sales rose 12% to $1,234.5 on 2024-01-05 (see note 3)."
    enc = ntok.encode(text)
    assert len(enc.offsets) == len(enc.input_ids) == len(enc.number_texts) == len(enc.numeric_values)
    got_nums = []
    for tid, (a, b), src, v in zip(enc.input_ids, enc.offsets, enc.number_texts, enc.numeric_values):
        if tid == ntok.num_token_id:
            assert text[a:b] == src
            got_nums.append((src, v))
        else:
            assert src is None and v == 0.0
    assert got_nums == [("12", 12.0), ("1,234.5", 1234.5), ("2024", 2024.0), ("01", 1.0), ("05", 5.0), ("3", 3.0)]
    # offsets cover the text in order, without gaps between consecutive tokens' starts
    starts = [a for a, _ in enc.offsets]
    assert starts == sorted(starts) and enc.offsets[0][0] == 0 and enc.offsets[-1][1] == len(text)
    assert [(n.source, n.value) for n in enc.numbers] == got_nums


def test_encode_batch_equals_encode(ntok):
    texts = ["a 1 b 2", "no numbers", "", "-3.5e2 and 1,000", "价格是99.9元"]
    batch = ntok.encode_batch(texts)
    for t, e in zip(texts, batch):
        one = ntok.encode(t)
        assert (e.input_ids, e.numeric_values, e.number_texts, e.offsets) == (
            one.input_ids, one.numeric_values, one.number_texts, one.offsets)
    with pytest.raises(ValueError, match="list of str"):
        ntok.encode_batch("a string")
    with pytest.raises(ValueError, match="text 1"):
        ntok.encode_batch(["ok", None])


def test_num_token_id_inside_vocab_collision_is_detected(tok):
    nt = NumberTokenizer(tok, num_token_id=tok("a")["input_ids"][0])
    with pytest.raises(ValueError, match="regular token"):
        nt.encode("a 5")
    assert nt.encode("b 5").input_ids[-1] == nt.num_token_id


# --------------------------------------------------------------------------- round trips
ROUND_TRIP = [
    "Yearly sunspot numbers. 1749: 80.9; 1750: 83.4; 1751:",
    "价格是99.9元，折扣-12.5%。",
    "Sales rose 12% to $1,234.5 on 2024-01-05 (see note 3.)",
    "x = -0 and y = \u22123.50e+02, z=.5, w=[1., 2.]",
    "Qwen2.5 has 0.5B params; x86_64; H2O; 3rd; v1.2.3; GPT-4",
    "nan inf 1e400 " + "9" * 500,
    "literal <NUM> and <|im_end|> stay",
    "  spaces   5   \n\n 6\t7 ",
    "007, 1,234,5, 3,5, 1e-400",
    "",
]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_decode_encode_is_identity(ntok, text):
    enc = ntok.encode(text)
    assert ntok.decode(enc.input_ids, enc.numeric_values, enc.number_texts) == text
    assert ntok.decode(enc) == text
    # dict form of number_texts
    d = {i: s for i, s in enumerate(enc.number_texts) if s is not None}
    assert ntok.decode(torch.tensor(enc.input_ids), torch.tensor(enc.numeric_values), d) == text


CANONICAL = [
    "Yearly sunspot numbers. 1749: 80.9; 1750: 83.4; 1751: 47.7; 1752:",
    "What is 819 times 77.29? Answer: 63300.5",
    "Temperatures -3.5, 0, 12 and 1e20 and -3e-5 and 0.000123457.",
    "价格是99.9元",
]


@pytest.mark.parametrize("text", CANONICAL)
def test_canonical_text_decodes_from_values_alone(ntok, text):
    enc = ntok.encode(text)
    assert ntok.decode(enc.input_ids, enc.numeric_values) == text
    # float32 round trip (values as the model sees them) still renders the same text
    assert ntok.decode(torch.tensor(enc.input_ids), torch.tensor(enc.numeric_values, dtype=torch.float32)) == text


def test_decode_generated_value_and_errors(ntok, tok):
    ids = ids_of(tok, "The answer is ") + [ntok.num_token_id] + ids_of(tok, ".")
    vals = [0.0] * len(ids)
    vals[-2] = 45.23456789
    assert ntok.decode(ids, vals) == "The answer is 45.2346."
    with pytest.raises(ValueError, match="numeric_values"):
        ntok.decode(ids)
    with pytest.raises(ValueError, match="numeric_values"):
        ntok.decode(ids, vals[:-1])


WORDS = ["the", "value", "is", "价格", "元", "nan", "inf", "Qwen2.5", "x86_64", "(", ")", ",", ";", ":", "%",
         "<NUM>", "\n", "GPT-4", "e", "E", "km", "-", "--", "."]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.sampled_from(WORDS), finite32, st.floats(allow_nan=False, allow_infinity=False)),
                max_size=12))
def test_random_texts_round_trip_and_numbers_are_found(ntok, parts):
    text = " ".join(p if isinstance(p, str) else repr(p) for p in parts)
    enc = ntok.encode(text)
    assert ntok.decode(enc) == text
    # every float written with repr() and separated by spaces is recognised with its exact
    # value, unless it does not fit float32 (then it is text)
    expected = [p for p in parts if not isinstance(p, str) and abs(p) <= FLOAT32_MAX]
    got = [v for t, v in zip(enc.input_ids, enc.numeric_values) if t == ntok.num_token_id]
    assert got == expected
    assert [math.copysign(1, v) for v in got] == [math.copysign(1, v) for v in expected]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["a", "The value", "价格", "x ="]), finite32), min_size=1, max_size=6))
def test_generated_values_render_canonically(ntok, pairs):
    text = "".join(f"{w} {format_number(v)} " for w, v in pairs)
    enc = ntok.encode(text)
    assert ntok.decode(enc.input_ids, enc.numeric_values) == text


# --------------------------------------------------------------------------- batching
def test_call_pads_right_and_left(tok, ntok):
    texts = ["a 1 b", "longer text with 2.5 and -3 numbers", ""]
    encs = [ntok.encode(t) for t in texts]
    lens = [len(e.input_ids) for e in encs]
    L = max(lens)
    for side in ("right", "left"):
        out = ntok(texts, padding_side=side)
        assert out["input_ids"].dtype == torch.long and out["attention_mask"].dtype == torch.long
        assert out["numeric_values"].dtype == torch.float32
        assert out["input_ids"].shape == out["numeric_values"].shape == out["attention_mask"].shape == (3, L)
        for i, e in enumerate(encs):
            n, k = lens[i], L - lens[i]
            sl = slice(0, n) if side == "right" else slice(k, L)
            pad = slice(n, L) if side == "right" else slice(0, k)
            assert out["input_ids"][i, sl].tolist() == e.input_ids
            assert out["numeric_values"][i, sl].tolist() == pytest.approx(e.numeric_values, rel=1e-6)
            assert out["attention_mask"][i, sl].tolist() == [1] * n
            assert out["input_ids"][i, pad].tolist() == [tok.pad_token_id] * k
            assert out["numeric_values"][i, pad].tolist() == [0.0] * k
            assert out["attention_mask"][i, pad].tolist() == [0] * k
        back = ntok.batch_decode(out["input_ids"], out["numeric_values"], skip_special_tokens=True)
        assert back == ["a 1 b", "longer text with 2.5 and -3 numbers", ""]
    left = ntok(texts, padding_side="left")
    raw = ntok.decode(left["input_ids"][0], left["numeric_values"][0])
    assert raw == tok.pad_token * (L - lens[0]) + "a 1 b"


def test_call_single_text_truncation_and_errors(ntok):
    out = ntok("x 1 y 2 z 3")
    assert out["input_ids"].shape[0] == 1
    full = ntok.encode("x 1 y 2 z 3").input_ids
    cut = ntok(["x 1 y 2 z 3", "q"], max_length=4, truncation=True)
    assert cut["input_ids"][0].tolist() == full[:4]
    assert cut["input_ids"].shape == (2, 4)
    with pytest.raises(ValueError, match="max_length"):
        ntok(["x 1 y 2 z 3"], max_length=4)
    with pytest.raises(ValueError, match="padding_side"):
        ntok(["a"], padding_side="middle")
    with pytest.raises(ValueError, match="truncation"):
        ntok(["a"], truncation=True)
    lists = ntok(["a 1", "b"], return_tensors=None)
    assert lists["input_ids"][1][-1] == ntok.pad_token_id and lists["attention_mask"][1][-1] == 0


def test_batch_decode_with_number_texts(ntok):
    texts = ["v 1.50 w", "a 007"]
    encs = ntok.encode_batch(texts)
    out = ntok(texts)
    texts_aligned = [e.number_texts + [None] * (out["input_ids"].shape[1] - len(e.number_texts)) for e in encs]
    assert ntok.batch_decode(out["input_ids"], out["numeric_values"], texts_aligned, skip_special_tokens=True) == texts
    # without sources the values render canonically
    assert ntok.batch_decode(out["input_ids"], out["numeric_values"], skip_special_tokens=True) == ["v 1.5 w", "a 7"]


def test_encoding_dataclass(ntok):
    enc = ntok.encode("a 1")
    assert isinstance(enc, NumberEncoding) and len(enc) == len(enc.input_ids)


def test_adjacent_generated_numbers_are_separated(ntok):
    num = ntok.num_token_id
    ids = ntok.encode("values: ").input_ids + [num, num]
    text = ntok.decode(ids, [0.0] * (len(ids) - 2) + [1.5, 2.0])
    assert text == "values: 1.5 2"
    spans = find_numbers(text)
    assert [s.value for s in spans] == [1.5, 2.0]


def test_encoding_ignores_padding_mode_left_on_the_shared_tokenizer(tok, ntok):
    """A transformers call with padding=True leaves the fast backend padding; segments must not be padded."""
    text = "Yearly sunspot numbers. 1749: 80.9; 1750: 83.4; 1751:"
    before = ntok.encode(text).input_ids
    tok(["a", "a much longer text than the first one"], padding=True, truncation=True, max_length=64)
    assert ntok.encode(text).input_ids == before
    assert ntok(text)["input_ids"][0].tolist() == before
    # and the tokenizer's own state is restored for its next padded call
    assert tok.backend_tokenizer.padding is not None
