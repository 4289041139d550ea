"""The PNG of a training run: the curves and the validation values with their predicted bands."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import torch

from ..modeling.intervals import interval


def plot_training(history: Sequence[dict], predictions: dict | None, path: str | os.PathLike,
                  calibration: dict | None = None, value_map=None) -> Path | None:
    """PNG with the training curves (train/eval losses, eval metrics) and the validation values
    (data order) with loc_Y and its 50% / 90% interval bands: calibrated by `calibration` (the adapter's
    `value_calibration`, as `CausalModel.value_interval`), raw Cauchy without one. Returns None
    (quietly) without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None

    train = [h for h in history if h.get("split") == "train"]
    evals = [h for h in history if h.get("split") == "eval"]
    fig = Figure(figsize=(16, 4.6))
    FigureCanvasAgg(fig)
    ax1, ax2, ax3 = fig.subplots(1, 3)
    for key, style in (("loss_cls", "-"), ("loss_reg", "--")):
        if train:
            ax1.plot([h["step"] for h in train], [h[key] for h in train], style, label=f"train {key}")
        pts = [(h["step"], h[key]) for h in evals if h.get(key) is not None]
        if pts:
            ax1.plot(*zip(*pts), style + "o", label=f"eval {key}")
    ax1.set_yscale("symlog")
    ax1.set_xlabel("step")
    ax1.set_title("losses")
    _legend(ax1)
    for key in ("accuracy", "num_recall", "num_f1", "coverage_50", "coverage_90"):
        pts = [(h["step"], h[key]) for h in evals if h.get(key) is not None]
        if pts:
            ax2.plot(*zip(*pts), "o-", label=key)
    for h in history:  # the final evaluation after the scale calibration
        if h.get("split") == "eval_calibrated":
            for key, color in (("coverage_50", "tab:red"), ("coverage_90", "tab:purple")):
                if h.get(key) is not None:
                    ax2.plot([h["step"]], [h[key]], "*", color=color, ms=12, label=f"{key} (calibrated)")
    ax2.set_ylim(-0.02, 1.02)
    ax2.set_xlabel("step")
    ax2.set_title("validation metrics")
    _legend(ax2)
    if predictions and predictions["y_true"]:
        # in data order (time order for the built-in series): the truth, loc_Y and its interval bands
        y = torch.tensor(predictions["y_true"], dtype=torch.float64)
        loc = torch.tensor(predictions["loc"], dtype=torch.float64)
        scale = torch.tensor(predictions["scale"], dtype=torch.float64)
        x = torch.arange(len(y)).numpy()
        kind = "calibrated" if calibration else "raw Cauchy"
        if value_map is not None and len(predictions.get("log") or []) == len(y):  # a "series" head: per row
            value_map = value_map.rows(torch.tensor(predictions["log"], dtype=torch.bool))
        for q, alpha in ((0.9, 0.18), (0.5, 0.35)):
            lo, hi = interval(loc, scale, q, calibration, value_map)
            ax3.fill_between(x, lo.numpy(), hi.numpy(), color="tab:blue", alpha=alpha, lw=0,
                             label=f"{round(100 * q)}% interval ({kind})")
        point = loc if value_map is None else value_map.to_value(loc)
        ax3.plot(x, point.numpy(), "-", color="tab:blue", lw=1.2, label="the predicted value (median)")
        ax3.plot(x, y.numpy(), "ko", ms=3, label="true value")
        span = float(y.max() - y.min()) or 1.0
        ax3.set_ylim(float(y.min()) - 0.6 * span, float(y.max()) + 0.6 * span)
        ax3.set_xlabel("validation example (data order)")
        ax3.set_ylabel("value")
        ax3.legend(fontsize=8)
    ax3.set_title("validation: value at <NUM> with its intervals")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    return path


def _legend(ax) -> None:
    """A legend when the panel has labelled lines (an empty history draws none; matplotlib would warn)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
