"""A run's plots and its first-vs-last summary table, drawn from the records
`rl.reports.run_log.read_metrics` loads back from ``metrics.jsonl``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.table import Table

from jax_routeweaver.data.records import Domain
from jax_routeweaver.rl.reports.metrics import MODES, window_mean
from jax_routeweaver.rl.reports.run_log import as_number

LOSS_KEYS = ("loss/total", "loss/kl", "grad/norm")


# ------------------------------------------------------------------------------ plots
def _series(records: Sequence[Mapping[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the records holding a finite value for `key`."""
    points = [(r.get("step", i + 1), v) for i, r in enumerate(records)
              if (v := as_number(r.get(key))) is not None]
    if not points:
        return np.zeros(0), np.zeros(0)
    steps, values = zip(*points, strict=True)
    return np.asarray(steps, float), np.asarray(values, float)


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over up to `window` points (shorter at the start)."""
    csum = np.concatenate([[0.0], np.cumsum(values)])
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(idx - window, 0)
    return (csum[idx] - csum[lo]) / (idx - lo)


def _domains(records: Iterable[Mapping[str, Any]], *prefixes: str) -> list[str]:
    """Domains named by keys ``{prefix}{DOMAIN}[/...]``, in `Domain` order then by name."""
    found = {k[len(p):].split("/")[0] for r in records for k in r
             for p in prefixes if k.startswith(p)}
    order = {d.value: i for i, d in enumerate(Domain)}
    return sorted(found, key=lambda d: (order.get(d, len(order)), d))


def _plot_with_average(ax: Any, steps: np.ndarray, values: np.ndarray, label: str,
                       window: int, color: Any = None) -> None:
    if not len(values):
        return
    (raw,) = ax.plot(steps, values, alpha=0.3, linewidth=1, color=color)
    ax.plot(steps, moving_average(values, window), color=raw.get_color(), linewidth=2,
            label=f"{label} (avg {window})")


def _save(fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=100)
    return path


def plot_run(records: Sequence[Mapping[str, Any]], out_dir: str | os.PathLike, *,
             window: int = 10) -> list[Path]:
    """Write PNG plots of a run into `out_dir` and return their paths:

    - ``reward.png``: ``reward/mean`` and ``reward/by_domain/*`` per step, raw (faint) and a
      trailing moving average over `window` steps;
    - ``mode_shares.png``: single/multi/agentic shares per step, one panel for all free rows
      (``mode/share_free/*``) and one per domain (``mode/share_by_domain/*``);
    - ``loss.png``, only if any of ``loss/total``, ``loss/kl``, ``grad/norm`` was logged.

    Steps missing a key are skipped for that series. Rendering goes through
    `matplotlib.figure.Figure` (the Agg canvas), so the global pyplot backend is left alone.
    """
    from matplotlib.figure import Figure  # deferred: matplotlib is slow to import

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []

    fig = Figure(figsize=(9, 5), layout="constrained")
    ax = fig.add_subplot()
    _plot_with_average(ax, *_series(records, "reward/mean"), "all", window, color="black")
    for domain in _domains(records, "reward/by_domain/"):
        _plot_with_average(ax, *_series(records, f"reward/by_domain/{domain}"), domain, window)
    ax.set(title="task reward", xlabel="step", ylabel="r_task")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    written.append(_save(fig, out / "reward.png"))

    panels = [("all (free rows)", "mode/share_free/")]
    panels += [(d, f"mode/share_by_domain/{d}/")
               for d in _domains(records, "mode/share_by_domain/")]
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig = Figure(figsize=(4.5 * cols, 3.2 * rows), layout="constrained")
    for k, (title, prefix) in enumerate(panels):
        ax = fig.add_subplot(rows, cols, k + 1)
        for mode in MODES:
            steps, values = _series(records, prefix + mode)
            if len(values):
                ax.plot(steps, values, label=mode)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "no free rows", ha="center", va="center",
                    transform=ax.transAxes)
        ax.set(title=title, xlabel="step", ylim=(-0.02, 1.02))
    written.append(_save(fig, out / "mode_shares.png"))

    loss_keys = [k for k in LOSS_KEYS if any(as_number(r.get(k)) is not None for r in records)]
    if loss_keys:
        fig = Figure(figsize=(4.5 * len(loss_keys), 3.2), layout="constrained")
        for k, key in enumerate(loss_keys):
            ax = fig.add_subplot(1, len(loss_keys), k + 1)
            _plot_with_average(ax, *_series(records, key), key, window)
            ax.set(title=key, xlabel="step")
        written.append(_save(fig, out / "loss.png"))
    return written


# ------------------------------------------------------------------------------ summary
def _fmt(value: float, spec: str) -> str:
    return "–" if math.isnan(value) else format(value, spec)


def _pct(share: float) -> str:
    return "–" if math.isnan(share) else f"{100 * share:.1f}%"


def summary_table(records: Sequence[Mapping[str, Any]], *, first: int = 10,
                  last: int = 10) -> Table:
    """Per domain and overall: mean reward over the first `first` and the last `last` steps,
    their difference, and the mode shares S/M/A (mean over the last window) of free rows.
    Domains come from ``reward/by_domain/*`` and ``mode/share_by_domain/*`` keys; the overall
    row uses ``reward/mean`` and ``mode/share_free/*``. Undefined cells show "–"."""
    table = Table(title=f"reward: first {first} vs last {last} steps; mode shares: last {last}")
    for name in ("domain", "reward first", "reward last", "Δ", "S", "M", "A"):
        table.add_column(name, justify="left" if name == "domain" else "right")
    domains = _domains(records, "reward/by_domain/", "mode/share_by_domain/")
    rows = [(d, f"reward/by_domain/{d}", f"mode/share_by_domain/{d}/") for d in domains]
    rows.append(("all", "reward/mean", "mode/share_free/"))
    for name, reward_key, share_prefix in rows:
        a = window_mean(records, reward_key, first=first)
        b = window_mean(records, reward_key, last=last)
        shares = [window_mean(records, share_prefix + m, last=last) for m in MODES]
        table.add_row(name, _fmt(a, ".3f"), _fmt(b, ".3f"), _fmt(b - a, "+.3f"),
                      *(_pct(s) for s in shares))
    return table
