"""Hold-out for per-row value units: eleven real quarterly series at mixed scales (0.016 .. 5,000) that neither
benchmarks/scales.py nor the chat corpus holds (statsmodels' macrodata columns other than unemp / infl /
realgdp, and the German interest_inflation data), in ONE training file, split 70/15/15 by time, windows of 8.
Scored as benchmarks/scales.py scores a set (`baselines.score_series`: baselines per series, the best chosen on
validation), trained and predicted as scales.py does (`common.train_and_predict`, every training setting the default).

    python benchmarks/scales_holdout.py [STEPS]     # default 60 optimizer steps; about 3 minutes on 2 cores
"""
import sys
import tempfile
from argparse import Namespace
from pathlib import Path
import numpy as np
import statsmodels.api as sm
from baselines import gmean, score_entries, series_entry, split_rows
from common import train_and_predict

def series():
    m = sm.datasets.macrodata.load_pandas().data
    t = [f"{int(y)} Q{int(q)}" for y, q in zip(m.year, m.quarter)]
    titles = {"realcons": "US real personal consumption (bn 2005 USD)", "realinv": "US real private investment (bn 2005 USD)",
              "realgovt": "US real government spending (bn 2005 USD)", "realdpi": "US real disposable income (bn 2005 USD)",
              "cpi": "US consumer price index", "m1": "US M1 money stock (bn USD)", "tbilrate": "US 3-month T-bill rate (%)",
              "pop": "US population (millions)", "realint": "US real interest rate (%)"}
    out = [(k, v + ".", t, [float(x) for x in m[k]]) for k, v in titles.items()]
    ii = sm.datasets.interest_inflation.load_pandas().data
    t2 = [f"{int(y)} Q{int(q)}" for y, q in zip(ii.year, ii.quarter)]
    out += [("de/Dp", "German quarterly inflation (log difference of the deflator).", t2, [round(float(x), 5) for x in ii.Dp]),
            ("de/R", "German long-term interest rate (fraction).", t2, [round(float(x), 5) for x in ii.R])]
    return out

# the settings scales.py runs its sets with (every training setting the default), 60 steps unless told
args = Namespace(steps=int(sys.argv[1]) if len(sys.argv) > 1 else 60, tiny={}, recent_values=None, seed=42)
entries = [series_entry(n, title, t, v, 8, None) for n, title, t, v in series()]
parts = [split_rows(e) for e in entries]
tr = [r for p in parts for r in p["train"]]; va = [r for p in parts for r in p["validation"]]; te = [r for p in parts for r in p["test"]]
print(f"{len(entries)} series, {len(tr)}/{len(va)}/{len(te)} rows")
preds, info = train_and_predict(args, "holdout", tr, va, te, Path(tempfile.mkdtemp(prefix="scales_holdout_")))
rows = score_entries(entries, parts, preds)
print("| series | level | n test | MAE / persistence | MAE / best (validation) | cov 50 | cov 90 |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for r, e in zip(rows, entries):
    print(f"| {r['series']} | {np.median(np.abs(e['y'])):.4g} | {r['n_test']} | {r['vs_persistence']:.3f} | {r['vs_best']:.3f} ({r['best_baseline']}) | {r['cov50']:.2f} | {r['cov90']:.2f} |")
gm = gmean(r["vs_persistence"] for r in rows); gb = gmean(r["vs_best"] for r in rows)
print(f"RESULT holdout_gm_vs_persistence={gm:.4g} holdout_gm_vs_best={gb:.4g} min_cov90={min(r['cov90'] for r in rows):.3g} "
      f"n_beat_persistence={sum(r['vs_persistence'] < 1 for r in rows)}/{len(rows)} calibrated={info['calibrated']} steps={info['steps']}")
