"""Where per-step metrics go: a JSONL file and TensorBoard, a console progress line, plots and a
first-vs-last summary table.

The JSONL file (``out_dir/metrics.jsonl``) is the run's record of truth: one object per step,
``{"step": int, name: float | null, ...}``, non-finite values written as null, flushed line by
line. `read_metrics` loads it back; `plot_run` and `summary_table` work from what it returns.
"""

from __future__ import annotations

import io
import json
import math
import operator
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress
from rich.table import Table

from jax_routeweaver.data.records import Domain
from jax_routeweaver.rl.metrics import MODES, window_mean

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"
LOSS_KEYS = ("loss/total", "loss/kl", "grad/norm")


# ------------------------------------------------------------------------------ logging
class RunLogger:
    """Write each step's metrics to ``out_dir/metrics.jsonl`` and TensorBoard (``out_dir/tb``).

    Fresh run (``resume=False``): an existing ``metrics.jsonl`` is replaced, and TensorBoard is
    told to hide the events already in ``tb/`` (a purge at step 0; nothing is deleted).
    Resumed run (``resume=True``): lines are appended, and at the first `log` the lines with
    ``step >=`` that step are dropped from the JSONL and purged from TensorBoard, so a run that
    restarts from an earlier checkpoint never logs a step twice. `truncate_after` does the same
    for an explicit checkpoint step. Non-finite values are written as null and skipped in
    TensorBoard.
    """

    def __init__(self, out_dir: str | os.PathLike, *, jsonl: bool = True,
                 tensorboard: bool = True, resume: bool = False) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.out_dir / METRICS_FILE if jsonl else None
        self.tb_dir = self.out_dir / TB_DIR if tensorboard else None
        self._file: io.TextIOWrapper | None = None
        self._writer: Any = None  # tensorboardX.SummaryWriter, created at the first log
        self._writers_opened = 0
        self._pending_resume = resume
        self._purge_step: int | None = None
        self._closed = False
        if not resume:
            if self.jsonl_path is not None:
                self._file = open(self.jsonl_path, "w", encoding="utf-8")  # noqa: SIM115
            if self.tb_dir is not None and any(self.tb_dir.glob("events.out.tfevents.*")):
                self._purge_step = 0

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record `metrics` (name -> number; jax/numpy scalars are fine) for `step`."""
        if self._closed:
            raise ValueError("RunLogger is closed")
        step = operator.index(step)
        if "step" in metrics:
            raise ValueError("'step' is reserved for the step number")
        values = {str(k): float(v) for k, v in metrics.items()}
        if self._pending_resume:
            self._pending_resume = False
            self._drop_from(step)
        if self.jsonl_path is not None:
            if self._file is None:
                self._file = open(self.jsonl_path, "a", encoding="utf-8")  # noqa: SIM115
            row = {"step": step, **{k: v if math.isfinite(v) else None
                                    for k, v in values.items()}}
            self._file.write(json.dumps(row, allow_nan=False) + "\n")
            self._file.flush()
        if self.tb_dir is not None:
            writer = self._tensorboard()
            for name, value in values.items():
                if math.isfinite(value):
                    writer.add_scalar(name, value, global_step=step)
            writer.flush()

    def truncate_after(self, step: int) -> None:
        """Forget every step after `step` (resuming from a checkpoint at `step`): rewrite the
        JSONL keeping lines with ``step <= step``, and purge later TensorBoard events."""
        if self._closed:
            raise ValueError("RunLogger is closed")
        self._drop_from(operator.index(step) + 1)

    def close(self) -> None:
        """Flush and close both sinks (idempotent)."""
        self._closed = True
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _drop_from(self, step: int) -> None:
        """Drop JSONL lines with ``step >= step``; purge TensorBoard from `step` on."""
        if self.jsonl_path is not None:
            if self._file is not None:
                self._file.close()
                self._file = None
            _rewrite_jsonl(self.jsonl_path, lambda s: s < step)
        if self.tb_dir is not None:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
            self._purge_step = step if self._purge_step is None else min(self._purge_step, step)

    def _tensorboard(self) -> Any:
        if self._writer is None:
            from tensorboardX import SummaryWriter  # deferred: only runs that log pay for it

            # A unique suffix: tensorboardX names files by the second, and a writer reopened
            # within the same second would otherwise overwrite the previous file.
            self._writers_opened += 1
            self._writer = SummaryWriter(
                str(self.tb_dir), purge_step=self._purge_step,
                filename_suffix=f".{os.getpid()}.{self._writers_opened}")
            self._purge_step = None  # a purge applies once, when the writer starts
        return self._writer


def _rewrite_jsonl(path: Path, keep: Callable[[int], bool]) -> None:
    """Atomically keep the lines of `path` whose step passes `keep`; lines that do not parse
    (a line torn by a killed run) are dropped too."""
    if not path.exists():
        return
    kept: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            continue
        if keep(step):
            kept.append(line + "\n")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(tmp, path)


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Load a ``metrics.jsonl`` (or the run directory holding one): one dict per step in file
    order, nulls read back as NaN. A torn last line (a run killed mid-write) is ignored; any
    other unreadable line raises ValueError."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    records = []
    for n, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if n == len(lines):
                break
            raise ValueError(f"{path}:{n}: not a JSON line: {e}") from None
        records.append({k: math.nan if v is None else v for k, v in row.items()})
    return records


# ------------------------------------------------------------------------------ progress
def _describe(step: int, total: int, metrics: Mapping[str, Any]) -> str:
    """``step 12/60 · reward 0.41 · S 40% M 35% A 25%``; parts whose metrics are missing are
    left out. Mode shares are the free rows' (the policy's choices), else all rows'."""
    parts = [f"step {step}/{total}"]
    reward = _number(metrics.get("reward/mean"))
    if reward is not None:
        parts.append(f"reward {reward:.2f}")
    for prefix in ("mode/share_free/", "mode/share/"):
        shares = [_number(metrics.get(prefix + m)) for m in MODES]
        if all(s is not None for s in shares):
            parts.append(" ".join(f"{m[0].upper()} {100 * s:.0f}%"
                                  for m, s in zip(MODES, shares, strict=True)))
            break
    return " · ".join(parts)


def _number(value: Any) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _clock(seconds: float) -> str:
    minutes, s = divmod(round(seconds), 60)
    h, m = divmod(minutes, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """Training progress on the console: a live rich bar (description, bar, elapsed, ETA) on a
    terminal; otherwise (``enabled=False`` or a console that is not a terminal, e.g. CI logs or
    ``Console(file=io.StringIO())``) one plain line per `update`:
    ``step 12/60 · reward 0.41 · S 40% M 35% A 25% · eta 3:20``.

    `start`: the step the run resumes after (the ETA counts only steps done in this process).
    """

    def __init__(self, total: int, *, start: int = 0, enabled: bool = True,
                 console: Console | None = None) -> None:
        self.total = total
        self.start = start
        self.console = console if console is not None else Console()
        self._t0 = time.monotonic()
        self._bar: RichProgress | None = None
        if enabled and self.console.is_terminal:
            # A long speed window: RL steps take minutes, rich's default (30 s) sees no rate.
            self._bar = RichProgress(TextColumn("{task.description}"), BarColumn(),
                                     TimeElapsedColumn(), TimeRemainingColumn(),
                                     console=self.console, speed_estimate_period=24 * 3600.0)
            self._task = self._bar.add_task(_describe(start, total, {}), total=total,
                                            completed=start)
            self._bar.start()

    @property
    def live(self) -> bool:
        """True when the rich bar is shown (else plain lines)."""
        return self._bar is not None

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Show that `step` is done, with its metrics."""
        description = _describe(step, self.total, metrics)
        if self._bar is not None:
            self._bar.update(self._task, completed=step, description=description)
            return
        done = step - self.start
        if done > 0:
            eta = (time.monotonic() - self._t0) / done * max(self.total - step, 0)
            description += f" · eta {_clock(eta)}"
        self.console.out(description, highlight=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


# ------------------------------------------------------------------------------ plots
def _series(records: Sequence[Mapping[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the records holding a finite value for `key`."""
    points = [(r.get("step", i + 1), v) for i, r in enumerate(records)
              if (v := _number(r.get(key))) is not None]
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

    loss_keys = [k for k in LOSS_KEYS if any(_number(r.get(k)) is not None for r in records)]
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
