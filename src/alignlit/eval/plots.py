"""Plots (PNG, matplotlib's Agg backend): training curves (one panel per metric, one line per run) and
the gold-reward-vs-KL frontier of evaluated policies."""

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


def plot_frontier(
    points: Sequence[Mapping],
    out_file: str | Path,
    *,
    title: str | None = None,
    baseline: str | None = None,
) -> Path:
    """Gold reward against KL to the reference policy, one marker per policy: the over-optimisation
    frontier (Gao et al. 2023; the best-of-n curve is the frontier a policy has to beat at its KL).

    Args:
        points: one mapping per policy with ``name``, ``kl`` and ``gold`` (floats; ``kl`` None leaves
            the point out), optional ``kl_err``/``gold_err`` (error bars, e.g. the std over seeds) and
            ``series`` (a name or a list of names): points sharing a series name are joined by a
            dashed line in order of KL (best-of-n for growing n, starting at the sampling policy).
        out_file: PNG path (parent directories are created).
        title: figure title.
        baseline: the name of the point drawn as a dashed horizontal line across the plot (the
            reference policy's gold, e.g. ``"SFT"``).

    Returns:
        the written path.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [p for p in points if p.get("kl") is not None and p.get("gold") is not None]
    if not shown:
        raise ValueError("plot_frontier needs at least one point with both 'kl' and 'gold'")
    fig, ax = plt.subplots(figsize=(7.5, 5.0))
    series: dict[str, list[Mapping]] = {}
    for p in shown:
        names = p.get("series") or []
        for name in [names] if isinstance(names, str) else names:
            series.setdefault(name, []).append(p)
    for name, members in series.items():
        members = sorted(members, key=lambda p: p["kl"])
        ax.plot([p["kl"] for p in members], [p["gold"] for p in members], "--", linewidth=1, label=name)
    markers = "osD^v<>pPX*h"
    for i, p in enumerate(shown):
        ax.errorbar(
            p["kl"],
            p["gold"],
            xerr=p.get("kl_err") or None,
            yerr=p.get("gold_err") or None,
            fmt=markers[i % len(markers)],
            markersize=6,
            capsize=2,
            label=p["name"],
        )
        ax.annotate(p["name"], (p["kl"], p["gold"]), fontsize=7, xytext=(4, 3), textcoords="offset points")
    if baseline is not None:
        base = next((p for p in shown if p["name"] == baseline), None)
        if base is None:
            raise ValueError(f"baseline {baseline!r} is not among the points {[p['name'] for p in shown]}")
        ax.axhline(base["gold"], color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("KL to the reference policy (nats per response)")
    ax.set_ylabel("gold reward (held-out prompts)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best", ncol=2)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    out = Path(out_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
