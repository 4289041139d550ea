"""Datasets pipeline: loading, tokenising with prompt masking, collator, offline corpora."""
import json
import os
import subprocess
import sys
import textwrap

import datasets
import pytest
import torch

from causal_adapter.data.corpora import CORPORA, build_corpus, sunspots_corpus, write_corpus_jsonl
from causal_adapter.commands.data import main as data_main
from causal_adapter.config import IGNORE_INDEX
from causal_adapter.data.pipeline import NumericCollator, load_text_dataset, tokenize_dataset
from causal_adapter.numbers import NumberTokenizer, find_numbers

datasets.disable_progress_bars()


@pytest.fixture(scope="module")
def ntok(qwen_tokenizer):
    return NumberTokenizer(qwen_tokenizer)


@pytest.fixture(scope="module")
def corpora():
    return {name: build_corpus(name) for name in CORPORA}


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")
    return str(path)


# --------------------------------------------------------------------------- collator
def test_collator_right_and_left_padding():
    feats = [
        {"input_ids": [5, 6, 7], "numeric_values": [0.0, 2.5, 0.0], "labels": [-100, 6, 7],
         "label_values": [0.0, 2.5, 0.0]},
        {"input_ids": [8], "numeric_values": [1.0], "labels": [8], "label_values": [1.0]},
    ]
    r = NumericCollator(pad_token_id=99)(feats)
    assert r["input_ids"].tolist() == [[5, 6, 7], [8, 99, 99]]
    assert r["numeric_values"].tolist() == [[0.0, 2.5, 0.0], [1.0, 0.0, 0.0]]
    assert r["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert r["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert r["label_values"].tolist() == [[0.0, 2.5, 0.0], [1.0, 0.0, 0.0]]
    assert r["input_ids"].dtype == r["labels"].dtype == r["attention_mask"].dtype == torch.long
    assert r["numeric_values"].dtype == r["label_values"].dtype == torch.float32

    l = NumericCollator(pad_token_id=99, padding_side="left")(feats)
    assert l["input_ids"].tolist() == [[5, 6, 7], [99, 99, 8]]
    assert l["numeric_values"].tolist() == [[0.0, 2.5, 0.0], [0.0, 0.0, 1.0]]
    assert l["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert l["labels"].tolist() == [[-100, 6, 7], [-100, -100, 8]]
    assert l["label_values"].tolist() == [[0.0, 2.5, 0.0], [0.0, 0.0, 1.0]]


def test_collator_truncation_defaults_and_extras(ntok):
    feats = [
        {"input_ids": [1, 2, 3, 4, 5], "numeric_values": [0.0, 0.0, 7.0, 0.0, 9.0], "labels": [-100, -100, 3, 4, 5],
         "target": 9.5, "t_index": 3, "series": "s"},
        {"input_ids": [1, 2], "numeric_values": [3.0, 0.0], "labels": [1, 2], "target": 1.25, "t_index": 4,
         "series": "s"},
    ]
    r = NumericCollator(ntok, max_length=3)(feats)  # a NumberTokenizer gives its pad id
    assert r["input_ids"].tolist() == [[1, 2, 3], [1, 2, ntok.pad_token_id]]
    assert r["labels"].tolist() == [[-100, -100, 3], [1, 2, -100]]
    # label_values derived: numeric value where labelled, 0 elsewhere
    assert r["label_values"].tolist() == [[0.0, 0.0, 7.0], [3.0, 0.0, 0.0]]
    assert r["target"].tolist() == [9.5, 1.25] and r["target"].dtype == torch.float64
    assert r["t_index"].tolist() == [3, 4] and "series" not in r
    # inference features: no labels -> no label tensors; numeric_values default to 0
    r2 = NumericCollator(0, pad_to_multiple_of=4)([{"input_ids": [3, 4, 5]}])
    assert set(r2) == {"input_ids", "numeric_values", "attention_mask"}
    assert r2["input_ids"].tolist() == [[3, 4, 5, 0]] and r2["numeric_values"].tolist() == [[0.0] * 4]


def test_collator_errors():
    with pytest.raises(ValueError, match="numeric_values has length 1 but input_ids has 2"):
        NumericCollator(0)([{"input_ids": [1, 2], "numeric_values": [0.0]}])
    with pytest.raises(ValueError, match="padding_side"):
        NumericCollator(0, padding_side="top")
    with pytest.raises(ValueError, match="pad_token_id"):
        NumericCollator(None)
    with pytest.raises(ValueError, match="empty"):
        NumericCollator(0)([])
    with pytest.raises(ValueError, match="input_ids"):
        NumericCollator(0)([{"ids": [1]}])


# --------------------------------------------------------------------------- tokenize_dataset
def test_prompt_completion_masking(ntok):
    ds = datasets.Dataset.from_dict({
        "prompt": ["Yearly sunspot numbers. 1749: 80.9; 1750:", "What is 2 + 3? Answer:"],
        "completion": [" 83.4", " 5"],
        "target": [83.4, 5.0],
    })
    out = tokenize_dataset(ds, ntok)
    assert set(out.column_names) == {"input_ids", "numeric_values", "labels", "label_values", "target"}
    for row, p, c in zip(out, ds["prompt"], ds["completion"]):
        pe, ce = ntok.encode(p), ntok.encode(c)
        assert row["input_ids"] == pe.input_ids + ce.input_ids
        assert row["labels"] == [IGNORE_INDEX] * len(pe.input_ids) + ce.input_ids
        assert row["numeric_values"] == pytest.approx(pe.numeric_values + ce.numeric_values, rel=1e-6)
        assert row["label_values"] == pytest.approx([0.0] * len(pe.input_ids) + ce.numeric_values, rel=1e-6)
    # the completion " 83.4" is a space token then <NUM> carrying 83.4
    assert out[0]["labels"][-2:] == [220, ntok.num_token_id]
    assert out[0]["label_values"][-1] == pytest.approx(83.4)
    assert out[0]["input_ids"].count(ntok.num_token_id) == 4  # 1749, 80.9, 1750, 83.4

    eos = tokenize_dataset(ds, ntok, add_eos_token=True)
    assert eos[1]["input_ids"][-1] == eos[1]["labels"][-1] == ntok.tokenizer.eos_token_id

    # truncation keeps the left part (here: the prompt fills max_length, no loss left)
    n_prompt = len(ntok.encode(ds["prompt"][0]).input_ids)
    cut = tokenize_dataset(ds, ntok, max_length=n_prompt + 1)
    assert cut[0]["input_ids"] == out[0]["input_ids"][: n_prompt + 1]
    assert cut[0]["labels"] == [IGNORE_INDEX] * n_prompt + [220]
    cut2 = tokenize_dataset(ds, ntok, max_length=3)
    assert cut2[0]["labels"] == [IGNORE_INDEX] * 3


def test_prompt_loss_text_labels_the_prompt_text_not_its_numbers(ntok):
    ds = datasets.Dataset.from_dict({"prompt": ["Yearly sunspot numbers. 1749: 80.9; 1750:"], "completion": [" 83.4"]})
    out = tokenize_dataset(ds, ntok, prompt_loss="text")[0]
    pe, ce = ntok.encode(ds["prompt"][0]), ntok.encode(ds["completion"][0])
    k = ntok.num_token_id
    assert out["input_ids"] == pe.input_ids + ce.input_ids
    assert out["labels"] == [IGNORE_INDEX if t == k else t for t in pe.input_ids] + ce.input_ids
    assert 26 in out["labels"][:len(pe.input_ids)]  # the ";" after a number is a target now
    # only the completion's number is a value target (the regression never sees 1749, 80.9, 1750)
    assert out["labels"].count(k) == 1
    assert out["label_values"] == pytest.approx([0.0] * (len(out["labels"]) - 1) + [83.4], rel=1e-6)
    with pytest.raises(ValueError, match="prompt_loss must be 'none' or 'text'"):
        tokenize_dataset(ds, ntok, prompt_loss="all")


def test_text_mode_and_collate(ntok):
    ds = datasets.Dataset.from_dict({"text": ["a 1 b", "x = -2.5e3;"]})
    out = tokenize_dataset(ds, ntok)
    for row, t in zip(out, ds["text"]):
        e = ntok.encode(t)
        assert row["input_ids"] == row["labels"] == e.input_ids
        assert row["label_values"] == pytest.approx(e.numeric_values)
    assert out[1]["numeric_values"][-2] == -2500.0
    batch = NumericCollator(ntok)([out[0], out[1]])
    assert batch["input_ids"].shape == batch["labels"].shape == batch["label_values"].shape
    assert ntok.batch_decode(batch["input_ids"], batch["numeric_values"], skip_special_tokens=True) == [
        "a 1 b", "x = -2500;"]


def test_column_and_row_errors(ntok):
    with pytest.raises(ValueError, match=r"neither a 'text' column .*columns present: \['body'\]"):
        tokenize_dataset(datasets.Dataset.from_dict({"body": ["x"]}), ntok)
    with pytest.raises(ValueError, match=r"no 'completion' column; columns present: \['prompt'\]"):
        tokenize_dataset(datasets.Dataset.from_dict({"prompt": ["x"]}), ntok)
    with pytest.raises(ValueError, match=r"row 2: column 'text' is null"):
        tokenize_dataset(datasets.Dataset.from_dict({"text": ["a", "b", None]}), ntok)
    with pytest.raises(ValueError, match=r"row 0: column 'completion' must be a string, got float"):
        tokenize_dataset(datasets.Dataset.from_dict({"prompt": ["a"], "completion": [1.5]}), ntok)
    # custom column name
    out = tokenize_dataset(datasets.Dataset.from_dict({"body": ["n 4"]}), ntok, text_column="body")
    assert out[0]["numeric_values"][-1] == 4.0


# --------------------------------------------------------------------------- loading
def test_json_csv_parquet_and_streaming(tmp_path, ntok):
    rows = [{"prompt": f"step {i}:", "completion": f" {i * 1.5}", "target": i * 1.5} for i in range(7)]
    pj = write_jsonl(tmp_path / "d.jsonl", rows)
    cache = str(tmp_path / "cache")  # keep datasets' arrow cache out of the user's HF_HOME
    ds = load_text_dataset(pj, cache_dir=cache)
    assert isinstance(ds, datasets.Dataset) and ds["prompt"] == [r["prompt"] for r in rows]
    import pandas as pd

    pd.DataFrame(rows).to_csv(tmp_path / "d.csv", index=False)
    pd.DataFrame(rows).to_parquet(tmp_path / "d.parquet")
    pd.DataFrame({"text": [r["prompt"] + r["completion"] for r in rows]}).to_csv(tmp_path / "t.tsv", sep="\t",
                                                                                 index=False)
    assert load_text_dataset(str(tmp_path / "d.parquet"), cache_dir=cache)["completion"] == [r["completion"] for r in rows]
    assert load_text_dataset(str(tmp_path / "t.tsv"), cache_dir=cache)["text"][1] == "step 1: 1.5"
    # the text columns of a CSV are read as written (pandas alone would turn " 0.0" into the float 0.0)
    csv_ds = load_text_dataset(str(tmp_path / "d.csv"), cache_dir=cache)
    assert csv_ds["completion"] == [r["completion"] for r in rows] and csv_ds["target"][1] == 1.5
    assert tokenize_dataset(csv_ds, ntok)[1]["input_ids"] == tokenize_dataset(ds, ntok)[1]["input_ids"]

    # streaming: an IterableDataset, tokenised lazily, batched by the collator
    st = load_text_dataset([pj, pj], streaming=True)
    assert isinstance(st, datasets.IterableDataset)
    tok_st = tokenize_dataset(st, ntok, max_length=16)
    feats = list(tok_st)
    assert len(feats) == 14
    ref = tokenize_dataset(ds, ntok, max_length=16)
    assert feats[3]["input_ids"] == ref[3]["input_ids"] and feats[3]["labels"] == ref[3]["labels"]
    batch = NumericCollator(ntok)(feats[:4])
    assert batch["input_ids"].shape[0] == 4
    # dict of splits
    dd = load_text_dataset({"train": pj, "test": pj}, split=None, cache_dir=cache)
    assert set(dd) == {"train", "test"}


def test_load_errors_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a 1"}\n{"text": "b 2"}\nnot json\n{"text": "c"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 3: not valid JSON"):
        load_text_dataset(str(bad), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 3: not valid JSON"):
        list(load_text_dataset(str(bad), streaming=True))
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_text_dataset(str(tmp_path / "nope.jsonl"))
    (tmp_path / "x.docx").write_text("x")
    with pytest.raises(ValueError, match="file type"):
        load_text_dataset(str(tmp_path / "x.docx"))


# --------------------------------------------------------------------------- corpora
def test_corpora_splits_time_ordered_and_consistent(corpora):
    for name, dd in corpora.items():
        assert list(dd) == ["train", "validation", "test"], name
        assert all(len(dd[s]) > 0 for s in dd), name
        for split in dd:
            for row in dd[split].select(range(min(50, len(dd[split])))):
                # the target is the completion's value; previous is the prompt's last number
                (c,) = find_numbers(row["completion"])
                assert c.value == row["target"] and c.start == 1, (name, row)
                if row["time"]:  # time series: the last value before the target's time label
                    history = row["prompt"].rsplit(";", 1)[0]
                    assert find_numbers(history)[-1].value == row["previous"], (name, row)
                else:
                    assert find_numbers(row["prompt"])[-1].value == row["previous"], (name, row)
        if name in ("arithmetic", "units", "diabetes", "engel", "heteroscedastic"):
            keys = [set(dd[s]["prompt"]) for s in dd]
            assert not (keys[0] & keys[1]) and not (keys[0] & keys[2]) and not (keys[1] & keys[2]), name
            continue
        # time series: targets strictly later in each following split, no shared target time
        idx = [dd[s]["t_index"] for s in ("train", "validation", "test")]
        for a in idx:
            assert a == sorted(a) and len(set(a)) == len(a)
        assert max(idx[0]) < min(idx[1]) and max(idx[1]) < min(idx[2]), name
        times = [set(dd[s]["time"]) for s in dd]
        assert not (times[0] & times[1]) and not (times[1] & times[2]) and not (times[0] & times[2])


def test_elnino_and_engel_exact_content(corpora):
    """statsmodels elnino (monthly, 1950-2010; split 70/15/15 by time) and engel (235 households, 231 distinct
    incomes, shuffled)."""
    el = corpora["elnino"]
    first = el["train"][0]
    assert first["prompt"].startswith("Monthly sea surface temperature, Pacific 0-10 S 90-80 W (deg C). 1950-01: 23.11; "
                                      "1950-02: 24.2; ")
    assert first["prompt"].endswith("; 1950-12: 21.8; 1951-01:") and first["completion"] == " 24.19"
    assert (first["previous"], first["time"]) == (21.8, "1951-01")
    assert [len(el[s]) for s in el] == [504, 108, 108] and el["test"][len(el["test"]) - 1]["time"] == "2010-12"
    en = corpora["engel"]
    rows = {r["prompt"]: r for s in en for r in en[s]}
    assert len(rows) == 231 and [len(en[s]) for s in en] == [161, 35, 35]
    row = rows["Household income 420.16; food expenditure:"]  # statsmodels' first household, 420.157651 -> 255.839425
    assert (row["completion"], row["target"], row["previous"]) == (" 255.84", 255.84, 420.16)


def test_sunspots_exact_content(corpora):
    dd = corpora["sunspots"]
    first = dd["train"][0]
    # statsmodels sunspots: 1700: 5, 1701: 11, 1702: 16, ..., 1710: 3; 2007: 7.5, 2008: 2.9
    assert first["prompt"].startswith("Yearly sunspot numbers. 1700: 5; 1701: 11; 1702: 16; 1703: 23;")
    assert first["prompt"].endswith("; 1710:") and first["completion"] == " 3" and first["time"] == "1710"
    assert first["prompt"].count(":") == 11  # 10 history years + the target year
    last = dd["test"][len(dd["test"]) - 1]
    assert (last["time"], last["target"], last["previous"]) == ("2008", 2.9, 7.5)
    assert sum(len(dd[s]) for s in dd) == 309 - 10
    small = sunspots_corpus(window=3)
    assert small["train"][0]["prompt"] == "Yearly sunspot numbers. 1700: 5; 1701: 11; 1702: 16; 1703:"
    with pytest.raises(ValueError, match="window"):
        sunspots_corpus(window=0)


def test_corpora_other_contents(corpora):
    co2 = corpora["co2"]
    assert co2["train"][0]["prompt"].startswith("Monthly mean CO2 at Mauna Loa (ppm). 1958-03: 316.1")
    assert co2["test"][len(co2["test"]) - 1]["time"] == "2001-12"
    macro = corpora["macro"]
    assert macro["train"][0]["prompt"].startswith("US quarterly unemployment rate (%). 1959 Q1: 5.8; 1959 Q2: 5.1;")
    nile = corpora["nile"]
    assert nile["train"][0]["prompt"].startswith("Annual flow of the Nile at Aswan (10^8 m^3). 1871: 1120; 1872: 1160;")
    ar = build_corpus("arithmetic", n=30, seed=1)
    assert [len(ar[s]) for s in ar] == [24, 3, 3]
    assert build_corpus("arithmetic", n=30, seed=1)["train"]["prompt"] == ar["train"]["prompt"]  # seeded
    assert build_corpus("arithmetic", n=30, seed=2)["train"]["prompt"] != ar["train"]["prompt"]
    for row in ar["train"]:
        nums = [n.value for n in find_numbers(row["prompt"])]
        assert len(nums) == 2
    with pytest.raises(ValueError, match="unknown corpus 'nope'"):
        build_corpus("nope")


def test_missing_optional_dependency_is_explained(monkeypatch):
    monkeypatch.setitem(sys.modules, "statsmodels.datasets.sunspots", None)
    with pytest.raises(ImportError, match=r"pip install"):
        sunspots_corpus()


def test_write_corpus_offline_in_fresh_process(tmp_path):
    """Build, write and reload corpora with HF_DATASETS_OFFLINE=1 and HF_HOME in a temp dir."""
    out = tmp_path / "corpus"
    script = textwrap.dedent(f"""
        import datasets, json
        assert datasets.config.HF_DATASETS_OFFLINE
        from causal_adapter.data.corpora import write_corpus_jsonl
        from causal_adapter.data.pipeline import load_text_dataset
        paths = write_corpus_jsonl("nile", {str(out)!r}, window=5)
        ds = load_text_dataset(paths["test"])
        st = load_text_dataset(paths["train"], streaming=True)
        print(json.dumps({{"paths": paths, "test": ds.num_rows, "train": sum(1 for _ in st),
                          "home": str(datasets.config.HF_DATASETS_CACHE)}}))
    """)
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    info = json.loads(res.stdout.strip().splitlines()[-1])
    assert info["home"].startswith(str(tmp_path / "hf"))
    assert info["test"] == 10 and info["train"] == 75  # 100 years - window 5 = 95 = 75 + 10 + 10
    assert sorted(info["paths"]) == ["test", "train", "validation"]
    with open(info["paths"]["validation"], encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh]
    assert len(rows) == 10 and rows[0]["series"] == "nile"
    assert rows[0]["time"] == "1951" and rows[-1]["time"] == "1960"  # 1876 + 75 = first validation year


def test_cli_writes_jsonl(tmp_path, capsys):
    assert data_main(["arithmetic", str(tmp_path), "--n", "20", "--seed", "3"]) == 0
    printed = capsys.readouterr().out
    path = tmp_path / "arithmetic_train.jsonl"
    assert str(path) in printed
    rows = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 16 and set(rows[0]) >= {"prompt", "completion", "target", "previous"}
    again = write_corpus_jsonl("arithmetic", str(tmp_path / "b"), n=20, seed=3)
    assert open(again["train"], encoding="utf-8").read() == path.read_text(encoding="utf-8")
