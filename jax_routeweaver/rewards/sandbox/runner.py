"""`Sandbox`: runs untrusted programs in jailed, limited children, a bounded number at a time.

Each job is one child: the harness (`child.py`) started inside a fresh jail (`jail.py`)
whose processes all belong to a fresh control group (`cgroup.py`), under the isolation level
the caller asked for and the host gives (`isolation.py`: the levels, and the probe that
checks one); `supervisor.py` reads the child's output against its clock and says how it ended.

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
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

from jax_routeweaver.rewards.sandbox import jail, syscalls
from jax_routeweaver.rewards.sandbox.cgroup import CgroupUnavailable, JobCgroups
from jax_routeweaver.rewards.sandbox.isolation import (
    LEVELS,
    STRONGEST,
    Isolation,
    IsolationUnavailable,
    Level,
    Request,
    SandboxError,
    probe,
    requested_level,
    unavailable,
)
from jax_routeweaver.rewards.sandbox.supervisor import (
    MAX_OUTPUT_BYTES,
    RawResult,
    Status,
    child_env,
    classify,
    communicate,
    end_job,
    kill_group,
    last_line,
    rlimits,
    wait_jail_gone,
)

__all__ = [
    "CallResult",
    "FunctionRunResult",
    "RunResult",
    "Sandbox",
    "configure_default_sandbox",
    "default_sandbox",
    "run_function",
    "run_python",
]

log = logging.getLogger(__name__)

NPROC = 32  # tasks (processes + threads) the program may have, under "full"
_LAUNCHER_TASKS = 2  # bwrap (the launcher execs into it) and the jail's init
_CHILD = Path(__file__).with_name("child.py")
_LAUNCHER_PATH = "/usr/local/bin:/usr/bin:/bin"


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


# ============================================================================ the sandbox
class Sandbox:
    """Runs programs in isolated children, at most `max_workers` at a time (module doc).

    `isolation`: the level required ("full", "namespaces", "none"), or "strongest" (the first
    of those the host gives; `declined` then says why each stronger one was not); default
    from `$ROUTEWEAVER_SANDBOX`, else "full". `memory_budget_mb`: the memory all running jobs
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
        self.requested: Request = requested_level(isolation)
        self.declined: dict[Level, str] = {}  # level -> why the host did not give it
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

    def describe(self) -> str:
        """One line: the level jobs run under, and for "strongest" why each stronger level
        was not had (sets the sandbox up: `SandboxError` as for `isolation`)."""
        iso = self.isolation
        line = f"sandbox: isolation {iso.level!r}"
        if self.requested == STRONGEST:
            line += " (the strongest this host gives"
            line += "".join(f"; {level!r} is not: {why}" for level, why in self.declined.items())
            line += ")"
        if iso.level == "none":
            line += ": programs run with this user's access to the host (trusted code only)"
        return line

    def close(self) -> None:
        """Wait for running jobs and stop the worker threads."""
        self._pool.shutdown(wait=True)
        if self._cgroups is not None:
            self._cgroups.close()

    # ---------------------------------------------------------------- set-up
    def _set_up(self) -> Isolation:
        if self.requested != STRONGEST:
            return self._set_up_level(self.requested)
        for level in LEVELS:
            try:
                return self._set_up_level(level)
            except IsolationUnavailable as exc:
                self.declined[level] = exc.why
        raise AssertionError("unreachable: the level 'none' needs nothing")

    def _set_up_level(self, level: Level) -> Isolation:
        if level == "none":
            log.warning("sandbox: isolation 'none': programs run as this user with full "
                        "access to the host (trusted code only)")
            return Isolation("none")
        bwrap = jail.find_bwrap()
        if bwrap is None:
            raise unavailable(level, "bubblewrap (bwrap) is not installed")
        iso = Isolation(level, bwrap)
        if level == "full":
            try:
                self._cgroups = JobCgroups()
            except CgroupUnavailable as exc:
                raise unavailable(level, str(exc)) from exc
            atexit.register(self._cgroups.close)
            iso = dataclasses.replace(iso, cgroup=self._cgroups.version,
                                      controllers=self._cgroups.controllers)
        problems = probe(iso, self._spawn)
        if problems:
            if self._cgroups is not None:  # "strongest" goes on without them
                self._cgroups.close()
                self._cgroups = None
            raise unavailable(level, "; ".join(problems))
        return iso

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
        status, note = classify(raw, memory_mb)
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
            status, note = classify(raw, memory_mb)
            if raw.timed_out:
                error = f"timed out after {per_test:g} s"
            elif status == "ok":
                status, error = "error", "the program exited before the call returned"
            else:
                error = note or last_line(stderr) or f"exit code {raw.returncode}"
            calls.append(CallResult(len(calls), status, error=error))
        return FunctionRunResult(tuple(calls), load_error[0] if load_error else None, stderr,
                                 raw.wall_s)

    # ---------------------------------------------------------------- one child
    def _spawn(self, iso: Isolation, mode: str, payload: dict, stdin: bytes, timeout_s: float,
               memory_mb: int | None, *, idle_timeout_s: float | None = None,
               on_line: Callable[[bytes], bool] | None = None,
               max_output_bytes: int = MAX_OUTPUT_BYTES) -> RawResult:
        """One child under `iso`, with its memory held from the budget; everything it
        started is killed and everything it wrote removed before this returns. The payload
        and stdin travel in anonymous files (inherited descriptors)."""
        mb = min(memory_mb or self.memory.total_mb, self.memory.total_mb)
        with self.memory.hold(mb), tempfile.TemporaryFile() as stdin_file, \
                tempfile.TemporaryFile() as pay_file, _seccomp_filter(iso) as seccomp:
            stdin_file.write(stdin)
            stdin_file.seek(0)
            pay_file.write(json.dumps(payload).encode())
            pay_file.seek(0)
            config = json.dumps({"mode": mode, "payload_fd": pay_file.fileno(),
                                 "rlimits": rlimits(timeout_s, mb)})
            group = (self._cgroups.create(mb << 20, self.nproc + _LAUNCHER_TASKS)
                     if iso.whole_job_limits and self._cgroups is not None else None)
            # "none": the job works in a directory of its own inside one of ours, and ours
            # is what gets removed (rmtree never follows links, whatever the job renamed).
            holder = None if iso.jailed else tempfile.mkdtemp(prefix="rw-sbx-",
                                                              dir=self.tmp_root)
            info_r, info_w = os.pipe() if iso.jailed else (-1, -1)
            try:
                if iso.jailed:
                    assert seccomp is not None
                    argv = jail.launcher_argv(
                        jail.bwrap_argv(iso.bwrap or "bwrap", child_env(jail.WORKDIR),
                                        [config], seccomp_fd=seccomp.fileno(),
                                        info_fd=info_w),
                        cgroup_procs=group.procs_files if group is not None else (),
                        uid=jail.fresh_uid() if os.geteuid() == 0 else None)
                    cwd, env = "/", {"PATH": _LAUNCHER_PATH}
                    fds = (pay_file.fileno(), seccomp.fileno(), info_w)
                else:
                    cwd = os.path.join(holder, "work")
                    os.mkdir(cwd, 0o700)
                    argv = [jail.interpreter(), "-B", "-s", "-P", str(_CHILD), config]
                    env, fds = child_env(cwd), (pay_file.fileno(),)
                try:
                    proc = subprocess.Popen(argv, stdin=stdin_file, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, cwd=cwd, env=env,
                                            start_new_session=True, close_fds=True,
                                            pass_fds=fds)
                except OSError as exc:
                    raise SandboxError(f"sandbox child did not start: {exc}") from exc
                finally:
                    if info_w >= 0:
                        os.close(info_w)
                try:
                    raw = communicate(proc, timeout_s, idle_timeout_s, on_line,
                                       max_output_bytes)
                finally:
                    kill_group(proc)
                    proc.wait()
                    for f in (proc.stdout, proc.stderr):
                        f.close()
                    if info_r >= 0:
                        # Killed early, the jail's init tears its PID namespace down after
                        # we reaped bubblewrap: the job ends when that init has.
                        wait_jail_gone(info_r)
            finally:
                oom = end_job(group)
                if info_r >= 0:
                    os.close(info_r)
                if holder is not None:
                    shutil.rmtree(holder, ignore_errors=True)
        if iso.jailed and raw.returncode is not None and raw.returncode > 128:
            raw.returncode = 128 - raw.returncode  # bwrap reports a signal as 128 + signo
        raw.oom_killed = oom
        return raw


def _seccomp_filter(iso: Isolation) -> contextlib.AbstractContextManager[Any]:
    """The job's seccomp filter, opened for bubblewrap to read (jailed levels; a missing
    filter is a `SandboxError`: no job runs without it), else None."""
    if not iso.jailed:
        return contextlib.nullcontext()
    try:
        return open(syscalls.filter_files()[0], "rb")
    except OSError as exc:
        raise SandboxError(f"sandbox: {exc}") from exc


# ============================================================================ module level
_DEFAULT: Sandbox | None = None
_DEFAULT_LOCK = threading.Lock()


def default_sandbox() -> Sandbox:
    """The process-wide sandbox the scorers use (`max(2, cpu_count // 2)` workers, the
    isolation `$ROUTEWEAVER_SANDBOX` names, else "full", unless `configure_default_sandbox`
    set another)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = Sandbox()
        return _DEFAULT


def configure_default_sandbox(isolation: str | None) -> Sandbox:
    """Make the process-wide sandbox one of `isolation` (a level, "strongest", or None: the
    default's rule) and return it. A run calls this before its first job (`rl.run.preflight`).
    The one it replaces is left open: a caller may still hold it (its idle worker threads
    end when it is collected)."""
    global _DEFAULT
    box = Sandbox(isolation=isolation)
    with _DEFAULT_LOCK:
        _DEFAULT = box
    return box


def run_python(program: str, *, stdin: str | bytes = "", timeout_s: float = 6.0,
               memory_mb: int | None = 1024, **kwargs: Any) -> RunResult:
    """`Sandbox.run` on the default sandbox."""
    return default_sandbox().run(program, stdin=stdin, timeout_s=timeout_s,
                                 memory_mb=memory_mb, **kwargs)


def run_function(program: str, func_name: str, args_list: Sequence[Sequence[Any]],
                 **kwargs: Any) -> FunctionRunResult:
    """`Sandbox.run_function` on the default sandbox."""
    return default_sandbox().run_function(program, func_name, args_list, **kwargs)
