"""Training-curve plots: one panel per metric, one line per run (PNG, matplotlib's Agg backend)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

PPO_PANELS: tuple[tuple[str, str], ...] = (
    ("reward/raw", "reward (raw)"),
    ("reward/normalized", "reward (normalised)"),
    ("kl/ref", "KL(π‖π0) per response"),
    ("response/length", "response length (tokens)"),
    ("response/ppl", "perplexity on own samples"),
    ("policy/entropy", "entropy (nats/token)"),
    ("policy/clip_frac", "clip fraction"),
    ("policy/approx_kl", "approx. KL old→new"),
    ("value/explained_var", "value explained variance"),
    ("val/gold", "held-out gold reward"),
    ("time/rollout_s", "rollout time (s)"),
    ("time/train_s", "train time (s)"),
)
"""The PPO-max §5.2 monitoring metrics, as ``(history key, panel title)``."""


def plot_curves(
    runs: Mapping[str, Sequence[Mapping[str, float]]],
    out_file: str | Path,
    *,
    panels: Sequence[tuple[str, str]] = PPO_PANELS,
    x_key: str = "rollout",
    columns: int = 4,
    title: str | None = None,
) -> Path:
    """Write a grid of line plots: for each ``(key, title)`` panel, ``key`` against ``x_key`` for every run.

    Args:
        runs: run name -> history, a list of per-step records (dicts of floats); a record without
            ``key`` is skipped in that panel, so sparse metrics (validation) plot at their own steps.
        out_file: PNG path (parent directories are created).
        panels: ``(key, title)`` per panel; panels no run has data for are left out.
        x_key: the x axis of every panel.
        columns: panels per row.
        title: figure title.

    Returns:
        the written path.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not runs:
        raise ValueError("plot_curves needs at least one run")
    shown = [(k, t) for k, t in panels if any(k in rec for hist in runs.values() for rec in hist)]
    if not shown:
        raise ValueError(f"none of the panel keys {[k for k, _ in panels]} occurs in the runs' histories")
    rows = math.ceil(len(shown) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.6 * columns, 2.6 * rows), squeeze=False)
    for ax, (key, panel_title) in zip(axes.flat, shown):
        for name, history in runs.items():
            points = [(rec[x_key], rec[key]) for rec in history if key in rec and x_key in rec]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, label=name, linewidth=1.2, marker="." if len(points) < 20 else None)
        ax.set_title(panel_title, fontsize=9)
        ax.set_xlabel(x_key, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(shown) :]:
        ax.axis("off")
    if len(runs) > 1:
        handles, labels = axes.flat[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=min(len(runs), 6), fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.04 if len(runs) > 1 else 0, 1, 0.97 if title else 1))
    out = Path(out_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
