"""Where per-step metrics go: a JSONL file and TensorBoard, and a console progress line.

The JSONL file (``out_dir/metrics.jsonl``) is the run's record of truth: one object per step,
``{"step": int, name: float | null, ...}``, non-finite values written as null, flushed line by
line. `read_metrics` loads it back; `rl.reports.run_plots.plot_run` and
`rl.reports.run_plots.summary_table` work from what it returns.
"""

from __future__ import annotations

import io
import json
import math
import operator
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress

from jax_routeweaver.rl.reports.metrics import MODES

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"


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
    reward = as_number(metrics.get("reward/mean"))
    if reward is not None:
        parts.append(f"reward {reward:.2f}")
    for prefix in ("mode/share_free/", "mode/share/"):
        shares = [as_number(metrics.get(prefix + m)) for m in MODES]
        if all(s is not None for s in shares):
            parts.append(" ".join(f"{m[0].upper()} {100 * s:.0f}%"
                                  for m, s in zip(MODES, shares, strict=True)))
            break
    return " · ".join(parts)


def as_number(value: Any) -> float | None:
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
