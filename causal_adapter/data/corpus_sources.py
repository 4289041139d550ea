"""The real series the corpora are built from, each a loader of (time labels, values) from data a package bundles
(statsmodels: sunspots, nile, co2, elnino, macrodata); the optional ``demo`` packages are imported lazily
(`_require`), with an error that names the package to install."""
from __future__ import annotations

import importlib


def _require(module: str, package: str, corpus: str):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"the {corpus!r} corpus needs the optional package {package!r}: "
            f"pip install {package}  (or pip install 'causal_adapter[demo]')"
        ) from e


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
