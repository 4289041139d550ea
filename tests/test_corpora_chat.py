"""The bundled conversational corpus ``chat``: TRL's conversational rows (a ``messages`` column) asking for
values of real series. Every answer is checked against the series as statsmodels ships it, not against the
corpus's own columns."""
import json
import re
import statistics

import datasets
import pytest

from causal_adapter.commands.data import main as data_main
from causal_adapter.data.corpora import ALL_CORPORA, CORPORA, build_corpus, chat_corpus
from causal_adapter.numbers import find_numbers, format_number

datasets.disable_progress_bars()

# a time label as the series write them: 1979, 1958-03, 1959 Q1
LABEL = r"\d{4}(?:-\d{2}| Q\d)?"
PAIR = re.compile(rf"({LABEL}): (\S+?)(?=;|\n|\.\s|\.$|$)")


def _source_series():
    """{series: (labels in order, {label: value})} read from statsmodels directly."""
    from statsmodels.datasets import co2, elnino, macrodata, nile, sunspots

    out = {}
    df = sunspots.load_pandas().data
    out["sunspots"] = ([str(int(y)) for y in df["YEAR"]], list(df["SUNACTIVITY"]))
    df = nile.load_pandas().data
    out["nile"] = ([str(int(y)) for y in df["year"]], list(df["volume"]))
    monthly = co2.load_pandas().data["co2"].resample("MS").mean().dropna()
    out["co2"] = ([f"{t.year}-{t.month:02d}" for t in monthly.index], [round(float(v), 2) for v in monthly])
    df = elnino.load_pandas().data
    labels, values = [], []
    for _, row in df.iterrows():
        for m, col in enumerate([c for c in df.columns if c != "YEAR"], start=1):
            labels.append(f"{int(row['YEAR'])}-{m:02d}")
            values.append(float(row[col]))
    out["elnino"] = (labels, values)
    df = macrodata.load_pandas().data
    labels = [f"{int(y)} Q{int(q)}" for y, q in zip(df["year"], df["quarter"])]
    for col in ("unemp", "infl", "realgdp"):
        out[f"macro/{col}"] = (labels, list(df[col]))
    return {k: (lab, {t: float(format_number(float(v))) for t, v in zip(lab, vals)}) for k, (lab, vals) in
            out.items()}


@pytest.fixture(scope="module")
def chat():
    return build_corpus("chat")


@pytest.fixture(scope="module")
def source():
    return _source_series()


def _asked(user_text):
    """The time label a user turn asks for: the last label in it."""
    return re.findall(LABEL, user_text)[-1]


def _lengths(dd):
    return [sum(len(m["content"]) for m in msgs) for s in dd for msgs in dd[s]["messages"]]


def test_registered_and_columns(chat):
    assert "chat" in ALL_CORPORA and "chat" not in CORPORA  # CORPORA: the prompt / completion corpora
    assert list(chat) == ["train", "validation", "test"]
    for split in chat:
        assert chat[split].column_names == ["messages", "target", "previous", "time", "t_index", "series"]
        assert isinstance(chat[split][0]["messages"], list) and set(chat[split][0]["messages"][0]) == {"role",
                                                                                                       "content"}
    assert set(chat["train"]["series"]) == {"sunspots", "nile", "co2", "elnino", "macro/unemp", "macro/infl",
                                            "macro/realgdp"}


def test_roles_and_answers_match_the_source_series(chat, source):
    n_exchanges, systems = set(), 0
    for split in chat:
        for row in chat[split]:
            msgs, series = row["messages"], row["series"]
            labels, value_of = source[series]
            roles = [m["role"] for m in msgs]
            if roles[0] == "system":
                systems += 1
                assert not find_numbers(msgs[0]["content"])
                roles, msgs = roles[1:], msgs[1:]
            # user / assistant alternate, the conversation ends with an assistant turn
            assert roles == ["user", "assistant"] * (len(roles) // 2) and len(roles) % 2 == 0 and roles, row
            n_exchanges.add(len(roles) // 2)
            # the first user turn: a window of the series (each pair true), ending right before the asked step
            pairs = PAIR.findall(msgs[0]["content"])
            assert len(pairs) >= 3, msgs[0]
            for t, v in pairs:
                assert float(v) == value_of[t], (series, t, v)
            window_idx = [labels.index(t) for t, _ in pairs]
            assert window_idx == list(range(window_idx[0], window_idx[0] + len(pairs))), (series, pairs)
            expected = window_idx[-1] + 1
            last = len(msgs) // 2 - 1  # target / previous / time / t_index: the LAST answer, what predict reads
            for e in range(len(msgs) // 2):
                user, reply = msgs[2 * e]["content"], msgs[2 * e + 1]["content"]
                asked = _asked(user)
                assert labels.index(asked) == expected + e, (series, asked, user)  # consecutive steps
                assert len(find_numbers(reply)) == 1, reply  # the value alone: no year the head would fit too
                first = find_numbers(reply)[0]
                assert first.value == value_of[asked], (series, asked, reply)  # the true value, first
                assert reply[first.start:first.end] == format_number(value_of[asked])  # canonical text
                if e == last:
                    assert row["target"] == value_of[asked] and row["time"] == asked
                    assert row["t_index"] == labels.index(asked)
                    assert row["previous"] == value_of[labels[labels.index(asked) - 1]]  # the step before, true
    assert n_exchanges == {1, 2, 3} and 0 < systems < sum(len(chat[s]) for s in chat)


def test_splits_disjoint_in_time(chat, source):
    """Per series, every answered step of train precedes every one of validation, which precede test's."""
    answered = {s: {} for s in chat}
    for split in chat:
        for row in chat[split]:
            labels = source[row["series"]][0]
            users = [m["content"] for m in row["messages"] if m["role"] == "user"]
            answered[split].setdefault(row["series"], []).extend(labels.index(_asked(u)) for u in users)
        for series in answered[split]:  # each series in time order within a split (by first answered step)
            labels = source[series][0]
            first = [labels.index(_asked(next(m["content"] for m in r["messages"] if m["role"] == "user")))
                     for r in chat[split] if r["series"] == series]
            assert first == sorted(first) and len(set(first)) == len(first)
    for series in source:
        tr, va, te = (answered[s][series] for s in ("train", "validation", "test"))
        assert max(tr) < min(va) and max(va) < min(te), series
        assert max(te) == len(source[series][0]) - 1, series  # the test split ends at the series' last step


def test_lengths_vary_and_seeded(chat):
    lengths = _lengths(chat)
    lo, med, hi = min(lengths), statistics.median(lengths), max(lengths)
    print(f"chat corpus: {len(lengths)} rows, characters min {lo} / median {med} / max {hi}")
    assert hi >= 8 * lo and lo < 150 and hi > 900
    again = build_corpus("chat")
    assert again["validation"]["messages"] == chat["validation"]["messages"]
    other = build_corpus("chat", seed=1)
    assert other["train"]["messages"] != chat["train"]["messages"]
    def first_asked(dd):
        return [_asked(next(m["content"] for m in msgs if m["role"] == "user")) for msgs in dd["train"]["messages"]]
    assert first_asked(other) == first_asked(chat)  # the same steps, other windows and wording
    short = chat_corpus(window=5, series=["nile"])
    for split in short:
        for row in short[split]:
            first_user = next(m["content"] for m in row["messages"] if m["role"] == "user")
            assert 3 <= len(PAIR.findall(first_user)) <= 5 and row["series"] == "nile"
    with pytest.raises(ValueError, match="window"):
        chat_corpus(window=2)
    with pytest.raises(ValueError, match="unknown"):
        chat_corpus(series=["nope"])


def test_cli_writes_three_files_that_load_back(tmp_path, capsys, chat):
    out = tmp_path / "chat"
    assert data_main(["chat", str(out)]) == 0
    printed = capsys.readouterr().out
    files = {s: str(out / f"chat_{s}.jsonl") for s in ("train", "validation", "test")}
    assert all(p in printed for p in files.values())
    first = json.loads(open(files["train"], encoding="utf-8").readline())
    assert isinstance(first["messages"], list) and first["messages"][-1]["role"] == "assistant"
    loaded = datasets.load_dataset("json", data_files=files, cache_dir=str(tmp_path / "cache"))
    for s in files:
        assert "messages" in loaded[s].column_names and len(loaded[s]) == len(chat[s])
        assert loaded[s]["messages"] == chat[s]["messages"]
        assert loaded[s]["target"] == chat[s]["target"]
