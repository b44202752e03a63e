"""One sandbox child seen from the host: its limits, its environment, its pipes, its end.

`communicate` reads a started child's stdout and stderr until it exits, times out, writes
too much or its caller has read enough; the program's clock starts only when the harness
(`child.py`) reports ready on stderr. `classify` turns how the child ended into a job status
(`Status`) and a note for its stderr. `rlimits` and `child_env` are the per-process limits
and the whole environment a child gets; `kill_group` and `end_job` end what is left of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import select
import selectors
import signal
import subprocess
import time
from collections.abc import Callable
from typing import Literal

from jax_routeweaver.rewards.sandbox.cgroup import JobCgroup
from jax_routeweaver.rewards.sandbox.isolation import SandboxError

Status = Literal["ok", "timeout", "memory", "error", "killed"]

FSIZE_BYTES = 16 << 20  # RLIMIT_FSIZE, as the original code
NOFILE = 256
STARTUP_TIMEOUT_S = 15.0  # from spawn until the harness is ready (a slow host, not the program)
MAX_OUTPUT_BYTES = 16 << 20  # stdout kept; more kills the child (status "killed")
STDERR_KEEP_BYTES = 64 << 10  # the tail of stderr that is kept
_READY = b"\x00routeweaver-sandbox-ready\x00\n"
_SETUP_FAILED = 97  # the harness's exit code when its limits could not be set
_MEMORY_ERROR = re.compile(r"^(?:[\w.]+\.)?\w*MemoryError\b")


@dataclasses.dataclass
class RawResult:
    """What one child did, before `classify` reads it as a status."""

    stdout: bytes
    stderr: bytes
    returncode: int | None
    wall_s: float
    timed_out: bool
    stopped: bool
    truncated: bool
    oom_killed: bool = False


def end_job(group: JobCgroup | None) -> bool:
    """Kill what is left of the job and remove its cgroup; True if the OOM killer struck."""
    if group is None:
        return False
    oom = group.oom_kills() > 0
    group.destroy()
    return oom


def child_env(home: str) -> dict[str, str]:
    """The program's whole environment: nothing is inherited, so no secret reaches it."""
    return {"PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": "/tmp", "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8", "PYTHONHASHSEED": "0", "PYTHONIOENCODING": "utf-8",
            "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's whole process group (a group already gone is no error)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def wait_jail_gone(info_fd: int, timeout_s: float = 5.0) -> bool:
    """Wait until the jail's init, whose host pid bubblewrap wrote to `info_fd` as JSON
    (``child-pid``), has ended: its PID namespace, and with it every process of the job, is
    gone then (the kernel kills and reaps the namespace before its init's exit completes,
    so a zombie init counts as ended). True if it ended within `timeout_s` (or never
    started)."""
    ready, _, _ = select.select([info_fd], [], [], 0)
    data = os.read(info_fd, 65536) if ready else b""
    try:
        pid = int(json.JSONDecoder().raw_decode(data.decode().lstrip())[0]["child-pid"])
    except (ValueError, KeyError, TypeError, IndexError):
        return True  # bubblewrap wrote nothing: it never started the jail
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.002)
    return False


def _exited(proc: subprocess.Popen) -> bool:
    """True once the child exited, without reaping it (its pid, hence its process group id,
    stays reserved until we kill the group)."""
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def rlimits(cpu_s: float, memory_mb: int) -> dict[str, tuple[int, int]]:
    """The harness's per-process limits {RLIMIT_NAME: (soft, hard)}: CPU seconds (`cpu_s`
    rounded up, plus one), file size, open files, no core dumps, `memory_mb` of address space."""
    cpu = math.ceil(cpu_s) + 1
    return {"RLIMIT_CPU": (cpu, cpu + 5), "RLIMIT_FSIZE": (FSIZE_BYTES, FSIZE_BYTES),
            "RLIMIT_NOFILE": (NOFILE, NOFILE), "RLIMIT_CORE": (0, 0),
            "RLIMIT_AS": (memory_mb << 20, memory_mb << 20)}


def classify(raw: RawResult, memory_mb: int | None) -> tuple[Status, str]:
    """(status, note) of a finished child."""
    if raw.timed_out:
        return "timeout", ""
    if raw.truncated:
        return "killed", f"[sandbox] stdout exceeded {MAX_OUTPUT_BYTES} bytes"
    if raw.oom_killed:
        return "memory", f"[sandbox] the job's memory limit ({memory_mb} MiB) was reached"
    rc = raw.returncode
    if rc is None or rc < 0:
        if rc == -signal.SIGXCPU:
            return "timeout", "[sandbox] CPU time limit"
        name = signal.Signals(-rc).name if rc is not None and -rc in signal.valid_signals() \
            else str(rc)
        return "killed", f"[sandbox] killed by {name}"
    if rc == 0:
        return "ok", ""
    last = last_line(raw.stderr.decode("utf-8", "replace"))
    # MemoryError or a subclass (numpy's _ArrayMemoryError), as the traceback's last line.
    return ("memory" if _MEMORY_ERROR.match(last) else "error"), ""


def last_line(text: str) -> str:
    """The last non-blank line of `text`, stripped ("" when there is none)."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def communicate(proc: subprocess.Popen, timeout_s: float, idle_timeout_s: float | None,
                 on_line: Callable[[bytes], bool] | None, max_output_bytes: int) -> RawResult:
    """Read the child's pipes until it exits, times out, overflows or `on_line` says stop.
    The program's clock starts when the harness reports ready."""
    start = time.monotonic()
    out, err = bytearray(), bytearray()
    ready = timed_out = stopped = truncated = False
    deadline = start + STARTUP_TIMEOUT_S
    ready_at = last = start
    exited_at: float | None = None
    scanned = 0
    sel = selectors.DefaultSelector()
    for f in (proc.stdout, proc.stderr):
        os.set_blocking(f.fileno(), False)
        sel.register(f, selectors.EVENT_READ)
    try:
        while sel.get_map():
            now = time.monotonic()
            limit = deadline if not (ready and idle_timeout_s) else min(
                deadline, last + idle_timeout_s)
            if now >= limit:
                timed_out = ready
                break
            if exited_at is None and _exited(proc):
                # Leftovers would hold the pipes open: give them half a second, then abandon
                # the pipes (the jail's PID namespace or the job cgroup ends them).
                kill_group(proc)
                exited_at = now
            if exited_at is not None and now > exited_at + 0.5:
                break
            for key, _ in sel.select(min(limit - now, 0.1)):
                try:
                    chunk = os.read(key.fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                if key.fileobj is proc.stderr:
                    err += chunk
                    if not ready and len(err) >= len(_READY) and err.startswith(_READY):
                        ready, ready_at = True, time.monotonic()
                        deadline, last = ready_at + timeout_s, ready_at
                        del err[:len(_READY)]
                    if ready and len(err) > 2 * STDERR_KEEP_BYTES:
                        del err[:-STDERR_KEEP_BYTES]
                    continue
                out += chunk
                if len(out) > max_output_bytes:
                    truncated = True
                    del out[max_output_bytes:]
                    break
                if on_line is not None:
                    while (nl := out.find(b"\n", scanned)) >= 0:
                        line, scanned = bytes(out[scanned:nl]), nl + 1
                        last = time.monotonic()
                        if on_line(line):
                            stopped = True
                            break
                if stopped:
                    break
            if truncated or stopped:
                break
    finally:
        sel.close()
    kill_group(proc)
    try:
        returncode = proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        returncode = None
    if not stopped and not truncated:  # what the child wrote just before it ended
        for f, buf in ((proc.stdout, out), (proc.stderr, err)):
            with contextlib.suppress(OSError):
                while chunk := os.read(f.fileno(), 1 << 16):
                    buf += chunk
        if not ready and err.startswith(_READY):
            ready = True
            del err[:len(_READY)]
        if on_line is not None and ready:
            while not stopped and (nl := out.find(b"\n", scanned)) >= 0:
                line, scanned = bytes(out[scanned:nl]), nl + 1
                stopped = on_line(line)
    if not ready:
        raise SandboxError("sandbox child did not start: "
                           + (bytes(err).decode("utf-8", "replace").strip()[-2000:]
                              or f"no output, return code {returncode}"))
    wall = time.monotonic() - ready_at
    return RawResult(bytes(out), bytes(err[-STDERR_KEEP_BYTES:]), returncode, wall, timed_out,
                stopped, truncated)
