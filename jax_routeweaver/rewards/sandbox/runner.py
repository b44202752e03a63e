"""`Sandbox`: runs untrusted programs in jailed, limited children, a bounded number at a time.

Each job is one child: the harness (`child.py`) started inside a fresh jail (`jail.py`)
whose processes all belong to a fresh control group (`cgroup.py`). The isolation level
(`Isolation.level`) is what the host gives and the caller accepts:

    full        the jail + the job cgroup (memory, pids and CPU bounded for the whole job)
    namespaces  the jail only: limits are per process (address space, CPU seconds)
    none        a plain child in a private temporary directory: NO isolation from the host
                (trusted code only)

The requested level comes from `Sandbox(isolation=...)`, else `ROUTEWEAVER_SANDBOX`, else
"full". It is checked once, by running a probe job, and a level the host cannot give is an
error (`SandboxError`, saying what is missing): the sandbox never falls back to less on its
own. `docs/sandbox.md` lists what each level guarantees; `routeweaver sandbox check` tests
those guarantees on the machine it runs on.

Memory: a job's `memory_mb` is its address-space limit per process and, under "full", the
memory limit of its whole process tree (program, forks, tmpfs files, memfds). The jobs
running at once never hold more than `memory_budget_mb` together (default: half the memory
this process may use); a job asks for at most that much.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import re
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

from jax_routeweaver.rewards.sandbox import jail
from jax_routeweaver.rewards.sandbox.cgroup import CgroupUnavailable, JobCgroup, JobCgroups

__all__ = [
    "ISOLATION_ENV",
    "CallResult",
    "FunctionRunResult",
    "Isolation",
    "IsolationUnavailable",
    "RunResult",
    "Sandbox",
    "SandboxError",
    "default_sandbox",
    "run_function",
    "run_python",
]

log = logging.getLogger(__name__)

Status = Literal["ok", "timeout", "memory", "error", "killed"]
Level = Literal["full", "namespaces", "none"]
LEVELS: tuple[Level, ...] = ("full", "namespaces", "none")
ISOLATION_ENV = "ROUTEWEAVER_SANDBOX"

FSIZE_BYTES = 16 << 20  # RLIMIT_FSIZE, as the reference
NOFILE = 256
NPROC = 32  # tasks (processes + threads) the program may have, under "full"
_LAUNCHER_TASKS = 2  # bwrap (the launcher execs into it) and the jail's init
STARTUP_TIMEOUT_S = 15.0  # from spawn until the harness is ready (a slow host, not the program)
MAX_OUTPUT_BYTES = 16 << 20  # stdout kept; more kills the child (status "killed")
STDERR_KEEP_BYTES = 64 << 10  # the tail of stderr that is kept
_READY = b"\x00routeweaver-sandbox-ready\x00\n"
_SETUP_FAILED = 97  # the harness's exit code when its limits could not be set
_CHILD = Path(__file__).with_name("child.py")
_LAUNCHER_PATH = "/usr/local/bin:/usr/bin:/bin"
_MEMORY_ERROR = re.compile(r"^(?:[\w.]+\.)?\w*MemoryError\b")


class SandboxError(RuntimeError):
    """The sandbox itself failed (the isolation asked for is not available here, or a child
    could not be set up or started): an infra error, never a verdict on the program."""


class IsolationUnavailable(SandboxError):
    """The isolation level asked for cannot be had on this host: a set-up problem to fix (or
    to accept less), never a per-row infra failure. Callers let it end the run."""


@dataclasses.dataclass(frozen=True)
class RunResult:
    """One program run. `status`: ok (exit 0) | timeout (wall clock or CPU limit) | memory
    (MemoryError, or the job's memory limit reached) | error (other non-zero exit, traceback
    in `stderr`) | killed (a signal, or stdout over the cap: `truncated`). `stderr` keeps the
    tail; `wall_s` counts from the harness being ready to the exit."""

    status: Status
    stdout: str
    stderr: str
    returncode: int | None
    wall_s: float
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclasses.dataclass(frozen=True)
class CallResult:
    """One call `fn(*args)` in `run_function`. `status`: ok | timeout | memory | error |
    killed. `value`: the return value through JSON (`encoding="json"`; tuples become lists),
    else `list(value)` through JSON (`"list"`, e.g. a set), else None (`"repr"`, see `error`
    for its repr). `error`: the exception's last line for failures."""

    index: int
    status: Status
    value: Any = None
    encoding: Literal["json", "list", "repr"] = "json"
    error: str = ""
    wall_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class FunctionRunResult:
    """`calls` in input order (possibly fewer than the inputs: stopped early, or the child
    died / timed out -- then the last call says so). `load_error`: the program failed before
    any call (syntax error, missing function, timeout at import), else None."""

    calls: tuple[CallResult, ...]
    load_error: str | None
    stderr: str
    wall_s: float


@dataclasses.dataclass(frozen=True)
class Isolation:
    """The isolation jobs run under: `level`, the `bwrap` used, the cgroup layout (`cgroup`
    1 or 2, None without) and its `controllers`."""

    level: Level
    bwrap: str | None = None
    cgroup: int | None = None
    controllers: tuple[str, ...] = ()

    @property
    def jailed(self) -> bool:
        return self.level != "none"

    @property
    def whole_job_limits(self) -> bool:
        return self.level == "full"


def requested_level(isolation: str | None = None) -> Level:
    """`isolation`, else `$ROUTEWEAVER_SANDBOX`, else "full"; anything else is an error."""
    value = isolation if isolation is not None else os.environ.get(ISOLATION_ENV) or "full"
    if value not in LEVELS:
        source = "isolation" if isolation is not None else f"${ISOLATION_ENV}"
        raise SandboxError(f"sandbox: {source}={value!r} is not one of {', '.join(LEVELS)}")
    return value  # type: ignore[return-value]


def memory_available_mb() -> int:
    """The memory this process may use: physical memory, or its cgroup's limit if lower."""
    limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        with contextlib.suppress(OSError, ValueError):
            limit = min(limit, int(Path(path).read_text().strip()))
    return limit >> 20


class _MemoryBudget:
    """At most `total_mb` MiB promised to running jobs at once (a counting semaphore)."""

    def __init__(self, total_mb: int) -> None:
        self.total_mb = total_mb
        self._used = 0
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def hold(self, mb: int) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: self._used + mb <= self.total_mb)
            self._used += mb
        try:
            yield
        finally:
            with self._cond:
                self._used -= mb
                self._cond.notify_all()


@dataclasses.dataclass
class _Raw:
    stdout: bytes
    stderr: bytes
    returncode: int | None
    wall_s: float
    timed_out: bool
    stopped: bool
    truncated: bool
    oom_killed: bool = False


# ============================================================================ the sandbox
class Sandbox:
    """Runs programs in isolated children, at most `max_workers` at a time (module doc).

    `isolation`: the level required ("full", "namespaces", "none"; default from
    `$ROUTEWEAVER_SANDBOX`, else "full"). `memory_budget_mb`: the memory all running jobs
    may hold together (default: half of `memory_available_mb()`). `tmp_root`: where the
    "none" level makes its working directories (default: the system temp dir). `nproc`:
    tasks a job may have under "full".
    """

    def __init__(self, max_workers: int | None = None, *, isolation: str | None = None,
                 memory_budget_mb: int | None = None, tmp_root: str | None = None,
                 nproc: int = NPROC) -> None:
        # At least 2: a child is mostly interpreter start-up (CPU) while its caller waits, so
        # two overlap even on 2 cores (24 short jobs: 1.71 s with 1 worker, 0.92 s with 2).
        n = max(2, (os.cpu_count() or 2) // 2) if max_workers is None else int(max_workers)
        if n < 1:
            raise ValueError(f"Sandbox: max_workers must be >= 1, got {max_workers!r}")
        budget = memory_available_mb() // 2 if memory_budget_mb is None else memory_budget_mb
        if budget < 64:
            raise ValueError(f"Sandbox: memory_budget_mb must be >= 64, got {budget!r}")
        if nproc < 1:
            raise ValueError(f"Sandbox: nproc must be >= 1, got {nproc!r}")
        self.max_workers = n
        self.requested: Level = requested_level(isolation)
        self.memory = _MemoryBudget(budget)
        self.tmp_root = os.path.realpath(tmp_root or tempfile.gettempdir())
        self.nproc = nproc
        self._pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="sandbox")
        self._isolation: Isolation | None = None
        self._cgroups: JobCgroups | None = None
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- public, sync
    def run(self, program: str, *, stdin: str | bytes = "", timeout_s: float = 6.0,
            memory_mb: int | None = 1024, recursion_limit: int | None = None,
            swallow_exit: bool = False, max_output_bytes: int = MAX_OUTPUT_BYTES) -> RunResult:
        """Run `program` as `__main__` with `stdin`; wall clock `timeout_s` (CPU likewise).
        `swallow_exit`: `SystemExit` counts as a clean exit (graders compare output only)."""
        return self._pool.submit(self._run_job, program, stdin, timeout_s, memory_mb,
                                 recursion_limit, swallow_exit, max_output_bytes).result()

    def run_tests(self, program: str, stdins: Sequence[str | bytes], *,
                  per_test_timeout_s: float = 6.0, total_timeout_s: float = 90.0,
                  memory_mb: int | None = 1024, recursion_limit: int | None = None,
                  swallow_exit: bool = True,
                  check: Callable[[int, RunResult], bool] | None = None) -> list[RunResult]:
        """Run `program` once per stdin, each in a fresh child, in order, inside one worker
        slot. Stops when `check(i, result)` is False or the total budget is spent (so the list
        may be shorter than `stdins`)."""
        return self._pool.submit(self._tests_job, program, list(stdins), per_test_timeout_s,
                                 total_timeout_s, memory_mb, recursion_limit, swallow_exit,
                                 check).result()

    def run_function(self, program: str, func_name: str, args_list: Sequence[Sequence[Any]], *,
                     style: Literal["apps", "lcb"] = "apps", prelude: str = "",
                     per_test_timeout_s: float = 6.0, total_timeout_s: float = 90.0,
                     memory_mb: int | None = 1024, recursion_limit: int | None = None,
                     stop_on_error: bool = False,
                     check: Callable[[int, CallResult], bool] | None = None
                     ) -> FunctionRunResult:
        """Load `program` (after `prelude`) in one child and call the function once per args
        list: `style="apps"`: `Solution().<func_name>` if `Solution` has it, else the module
        level `<func_name>`; `"lcb"`: `Solution().<func_name>` only. A fresh `Solution()` per
        call; stdout is discarded. Each call (and the load) has `per_test_timeout_s`, the
        child `total_timeout_s`. Stops after a failed call if `stop_on_error`, and (killing
        the child) when `check(i, call)` is False. Arguments and results cross the process
        boundary as JSON; expected outputs never enter the child."""
        return self._pool.submit(self._function_job, program, func_name,
                                 [list(a) for a in args_list], style, prelude,
                                 per_test_timeout_s, total_timeout_s, memory_mb, recursion_limit,
                                 stop_on_error, check).result()

    # ---------------------------------------------------------------- public, async
    async def arun(self, program: str, **kwargs: Any) -> RunResult:
        """`run` for asyncio callers (the event loop is not blocked)."""
        return await asyncio.wrap_future(self._pool.submit(
            functools.partial(self._run_kw, program, **kwargs)))

    async def arun_tests(self, program: str, stdins: Sequence[str | bytes],
                         **kwargs: Any) -> list[RunResult]:
        """`run_tests` for asyncio callers."""
        return await asyncio.wrap_future(self._pool.submit(
            functools.partial(self._tests_kw, program, list(stdins), **kwargs)))

    async def arun_function(self, program: str, func_name: str,
                            args_list: Sequence[Sequence[Any]], **kwargs: Any
                            ) -> FunctionRunResult:
        """`run_function` for asyncio callers."""
        return await asyncio.wrap_future(self._pool.submit(
            functools.partial(self._function_kw, program, func_name,
                              [list(a) for a in args_list], **kwargs)))

    @property
    def isolation(self) -> Isolation:
        """The isolation jobs run under, set up and probed on first use. Raises
        `SandboxError` if the requested level is not available on this host."""
        with self._lock:
            if self._isolation is None:
                self._isolation = self._set_up()
            return self._isolation

    def close(self) -> None:
        """Wait for running jobs and stop the worker threads."""
        self._pool.shutdown(wait=True)
        if self._cgroups is not None:
            self._cgroups.close()

    # ---------------------------------------------------------------- set-up
    def _set_up(self) -> Isolation:
        level = self.requested
        if level == "none":
            log.warning("sandbox: isolation 'none': programs run as this user with full "
                        "access to the host (trusted code only)")
            return Isolation("none")
        bwrap = jail.find_bwrap()
        if bwrap is None:
            raise _unavailable(level, "bubblewrap (bwrap) is not installed")
        iso = Isolation(level, bwrap)
        if level == "full":
            try:
                self._cgroups = JobCgroups()
            except CgroupUnavailable as exc:
                raise _unavailable(level, str(exc)) from exc
            atexit.register(self._cgroups.close)
            iso = dataclasses.replace(iso, cgroup=self._cgroups.version,
                                      controllers=self._cgroups.controllers)
        problems = self._probe(iso)
        if problems:
            raise _unavailable(level, "; ".join(problems))
        return iso

    def _probe(self, iso: Isolation) -> list[str]:
        """What keeps `iso` from working here (empty: it works), from one probe job."""
        try:
            raw = self._spawn(iso, "probe", {}, b"", 10.0, 256)
            report = json.loads(raw.stdout.decode().strip().splitlines()[-1])
        except (SandboxError, CgroupUnavailable, ValueError, IndexError, OSError) as exc:
            return [str(exc)[:500]]
        problems = []
        if raw.returncode != 0:
            problems.append(f"the probe exited with {raw.returncode}")
        if report.get("ifaces") != ["lo"]:
            problems.append(f"network interfaces in the jail: {report.get('ifaces')}")
        if not report.get("imports"):
            problems.append(f"the standard library does not import: {report.get('error')}")
        if not report.get("cwd_write"):
            problems.append("the working directory is not writable")
        return problems

    # ---------------------------------------------------------------- jobs (in a worker)
    def _run_kw(self, program: str, *, stdin: str | bytes = "", timeout_s: float = 6.0,
                memory_mb: int | None = 1024, recursion_limit: int | None = None,
                swallow_exit: bool = False, max_output_bytes: int = MAX_OUTPUT_BYTES
                ) -> RunResult:
        return self._run_job(program, stdin, timeout_s, memory_mb, recursion_limit,
                             swallow_exit, max_output_bytes)

    def _tests_kw(self, program: str, stdins: list, *, per_test_timeout_s: float = 6.0,
                  total_timeout_s: float = 90.0, memory_mb: int | None = 1024,
                  recursion_limit: int | None = None, swallow_exit: bool = True,
                  check: Callable[[int, RunResult], bool] | None = None) -> list[RunResult]:
        return self._tests_job(program, stdins, per_test_timeout_s, total_timeout_s, memory_mb,
                               recursion_limit, swallow_exit, check)

    def _function_kw(self, program: str, func_name: str, args_list: list, *,
                     style: str = "apps", prelude: str = "", per_test_timeout_s: float = 6.0,
                     total_timeout_s: float = 90.0, memory_mb: int | None = 1024,
                     recursion_limit: int | None = None, stop_on_error: bool = False,
                     check: Callable[[int, CallResult], bool] | None = None
                     ) -> FunctionRunResult:
        return self._function_job(program, func_name, args_list, style, prelude,
                                  per_test_timeout_s, total_timeout_s, memory_mb,
                                  recursion_limit, stop_on_error, check)

    def _run_job(self, program: str, stdin: str | bytes, timeout_s: float,
                 memory_mb: int | None, recursion_limit: int | None, swallow_exit: bool,
                 max_output_bytes: int) -> RunResult:
        return self._script(program, stdin, timeout_s, memory_mb, recursion_limit,
                            swallow_exit, max_output_bytes)

    def _tests_job(self, program: str, stdins: list, per_test: float, total: float,
                   memory_mb: int | None, recursion_limit: int | None, swallow_exit: bool,
                   check: Callable[[int, RunResult], bool] | None) -> list[RunResult]:
        results: list[RunResult] = []
        deadline = time.monotonic() + total
        for i, stdin in enumerate(stdins):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            result = self._script(program, stdin, min(per_test, remaining), memory_mb,
                                  recursion_limit, swallow_exit, MAX_OUTPUT_BYTES)
            results.append(result)
            if check is not None and not check(i, result):
                break
        return results

    def _script(self, program: str, stdin: str | bytes, timeout_s: float,
                memory_mb: int | None, recursion_limit: int | None, swallow_exit: bool,
                max_output_bytes: int) -> RunResult:
        payload = {"program": program, "recursion_limit": recursion_limit,
                   "swallow_exit": swallow_exit}
        data = stdin.encode() if isinstance(stdin, str) else bytes(stdin)
        raw = self._spawn(self.isolation, "script", payload, data, timeout_s, memory_mb,
                          max_output_bytes=max_output_bytes)
        status, note = _status(raw, memory_mb)
        stderr = raw.stderr.decode("utf-8", "replace")
        if note:
            stderr = (stderr + "\n" + note).lstrip("\n")
        return RunResult(status, raw.stdout.decode("utf-8", "replace"), stderr[-8000:],
                         raw.returncode, raw.wall_s, raw.truncated)

    def _function_job(self, program: str, func_name: str, args_list: list, style: str,
                      prelude: str, per_test: float, total: float, memory_mb: int | None,
                      recursion_limit: int | None, stop_on_error: bool,
                      check: Callable[[int, CallResult], bool] | None) -> FunctionRunResult:
        if style not in ("apps", "lcb"):
            raise ValueError(f"run_function: style must be 'apps' or 'lcb', got {style!r}")
        calls: list[CallResult] = []
        load_error: list[str] = []

        def on_line(line: bytes) -> bool:
            try:
                rec = json.loads(line)
                index = int(rec["i"])
            except (ValueError, KeyError, TypeError):
                return False  # not ours (the program wrote to the result fd): ignore
            if index < 0:
                load_error.append(str(rec.get("error", "")))
                return True
            if index != len(calls):
                return False
            call = CallResult(index, rec.get("status", "error"), rec.get("value"),
                              rec.get("encoding", "json"), str(rec.get("error", ""))[:2000],
                              float(rec.get("t", 0.0)))
            calls.append(call)
            return check is not None and not check(index, call)

        payload = {"program": program, "func_name": func_name, "style": style,
                   "prelude": prelude, "inputs": args_list, "per_test_timeout": per_test,
                   "stop_on_error": stop_on_error, "recursion_limit": recursion_limit}
        raw = self._spawn(self.isolation, "functional", payload, b"", total, memory_mb,
                          idle_timeout_s=per_test + 1.0, on_line=on_line)
        stderr = raw.stderr.decode("utf-8", "replace")[-8000:]
        finished = raw.stopped or load_error or len(calls) == len(args_list) or (
            stop_on_error and calls and calls[-1].status != "ok")
        if not finished:  # the child died or ran out of time in call len(calls) (or loading)
            status, note = _status(raw, memory_mb)
            if raw.timed_out:
                error = f"timed out after {per_test:g} s"
            elif status == "ok":
                status, error = "error", "the program exited before the call returned"
            else:
                error = note or _last_line(stderr) or f"exit code {raw.returncode}"
            calls.append(CallResult(len(calls), status, error=error))
        return FunctionRunResult(tuple(calls), load_error[0] if load_error else None, stderr,
                                 raw.wall_s)

    # ---------------------------------------------------------------- one child
    def _spawn(self, iso: Isolation, mode: str, payload: dict, stdin: bytes, timeout_s: float,
               memory_mb: int | None, *, idle_timeout_s: float | None = None,
               on_line: Callable[[bytes], bool] | None = None,
               max_output_bytes: int = MAX_OUTPUT_BYTES) -> _Raw:
        """One child under `iso`, with its memory held from the budget; everything it
        started is killed and everything it wrote removed before this returns. The payload
        and stdin travel in anonymous files (inherited descriptors)."""
        mb = min(memory_mb or self.memory.total_mb, self.memory.total_mb)
        with self.memory.hold(mb), tempfile.TemporaryFile() as stdin_file, \
                tempfile.TemporaryFile() as pay_file:
            stdin_file.write(stdin)
            stdin_file.seek(0)
            pay_file.write(json.dumps(payload).encode())
            pay_file.seek(0)
            config = json.dumps({"mode": mode, "payload_fd": pay_file.fileno(),
                                 "rlimits": _limits(timeout_s, mb)})
            group = (self._cgroups.create(mb << 20, self.nproc + _LAUNCHER_TASKS)
                     if iso.whole_job_limits and self._cgroups is not None else None)
            # "none": the job works in a directory of its own inside one of ours, and ours
            # is what gets removed (rmtree never follows links, whatever the job renamed).
            holder = None if iso.jailed else tempfile.mkdtemp(prefix="rw-sbx-",
                                                              dir=self.tmp_root)
            try:
                if iso.jailed:
                    argv = jail.launcher_argv(
                        jail.bwrap_argv(iso.bwrap or "bwrap", _child_env(jail.WORKDIR),
                                        [config]),
                        cgroup_procs=group.procs_files if group is not None else (),
                        uid=jail.fresh_uid() if os.geteuid() == 0 else None)
                    cwd, env = "/", {"PATH": _LAUNCHER_PATH}
                else:
                    cwd = os.path.join(holder, "work")
                    os.mkdir(cwd, 0o700)
                    argv = [jail.interpreter(), "-B", "-s", "-P", str(_CHILD), config]
                    env = _child_env(cwd)
                try:
                    proc = subprocess.Popen(argv, stdin=stdin_file, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, cwd=cwd, env=env,
                                            start_new_session=True, close_fds=True,
                                            pass_fds=(pay_file.fileno(),))
                except OSError as exc:
                    raise SandboxError(f"sandbox child did not start: {exc}") from exc
                try:
                    raw = _communicate(proc, timeout_s, idle_timeout_s, on_line,
                                       max_output_bytes)
                finally:
                    _kill_group(proc)
                    proc.wait()
                    for f in (proc.stdout, proc.stderr):
                        f.close()
            finally:
                oom = _end(group)
                if holder is not None:
                    shutil.rmtree(holder, ignore_errors=True)
        if iso.jailed and raw.returncode is not None and raw.returncode > 128:
            raw.returncode = 128 - raw.returncode  # bwrap reports a signal as 128 + signo
        raw.oom_killed = oom
        return raw


def _end(group: JobCgroup | None) -> bool:
    """Kill what is left of the job and remove its cgroup; True if the OOM killer struck."""
    if group is None:
        return False
    oom = group.oom_kills() > 0
    group.destroy()
    return oom


def _unavailable(level: str, why: str) -> IsolationUnavailable:
    return IsolationUnavailable(
        f"sandbox: isolation {level!r} is not available on this host: {why}. Install "
        f"bubblewrap and run as root (or with a delegated cgroup v2 subtree), or accept less "
        f"with {ISOLATION_ENV}=namespaces (no whole-job limits) or {ISOLATION_ENV}=none (no "
        f"isolation: trusted code only); `routeweaver sandbox check` tells what this host "
        f"gives (docs/sandbox.md)")


def _child_env(home: str) -> dict[str, str]:
    """The program's whole environment: nothing is inherited, so no secret reaches it."""
    return {"PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": "/tmp", "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8", "PYTHONHASHSEED": "0", "PYTHONIOENCODING": "utf-8",
            "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _exited(proc: subprocess.Popen) -> bool:
    """True once the child exited, without reaping it (its pid, hence its process group id,
    stays reserved until we kill the group)."""
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _limits(cpu_s: float, memory_mb: int) -> dict[str, tuple[int, int]]:
    cpu = math.ceil(cpu_s) + 1
    return {"RLIMIT_CPU": (cpu, cpu + 5), "RLIMIT_FSIZE": (FSIZE_BYTES, FSIZE_BYTES),
            "RLIMIT_NOFILE": (NOFILE, NOFILE), "RLIMIT_CORE": (0, 0),
            "RLIMIT_AS": (memory_mb << 20, memory_mb << 20)}


def _status(raw: _Raw, memory_mb: int | None) -> tuple[Status, str]:
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
    last = _last_line(raw.stderr.decode("utf-8", "replace"))
    # MemoryError or a subclass (numpy's _ArrayMemoryError), as the traceback's last line.
    return ("memory" if _MEMORY_ERROR.match(last) else "error"), ""


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _communicate(proc: subprocess.Popen, timeout_s: float, idle_timeout_s: float | None,
                 on_line: Callable[[bytes], bool] | None, max_output_bytes: int) -> _Raw:
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
                _kill_group(proc)
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
    _kill_group(proc)
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
    return _Raw(bytes(out), bytes(err[-STDERR_KEEP_BYTES:]), returncode, wall, timed_out,
                stopped, truncated)


# ============================================================================ module level
_DEFAULT: Sandbox | None = None
_DEFAULT_LOCK = threading.Lock()


def default_sandbox() -> Sandbox:
    """The process-wide sandbox the scorers use (`max(2, cpu_count // 2)` workers, the
    isolation `$ROUTEWEAVER_SANDBOX` names, else "full")."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = Sandbox()
        return _DEFAULT


def run_python(program: str, *, stdin: str | bytes = "", timeout_s: float = 6.0,
               memory_mb: int | None = 1024, **kwargs: Any) -> RunResult:
    """`Sandbox.run` on the default sandbox."""
    return default_sandbox().run(program, stdin=stdin, timeout_s=timeout_s,
                                 memory_mb=memory_mb, **kwargs)


def run_function(program: str, func_name: str, args_list: Sequence[Sequence[Any]],
                 **kwargs: Any) -> FunctionRunResult:
    """`Sandbox.run_function` on the default sandbox."""
    return default_sandbox().run_function(program, func_name, args_list, **kwargs)
