"""Run untrusted Python (generated programs) in a separate, limited, network-less process.

Every program runs in a fresh child `python -B -s -P -c <harness>` of the same interpreter,
in a new session (its own process group), in a fresh temporary working directory that is
deleted afterwards, with an environment built from scratch (PATH, HOME=TMPDIR=the working
directory, UTF-8, one BLAS/OMP thread, PYTHONHASHSEED=0 -- nothing is inherited, so no API key
reaches the child). `-I` would also drop PYTHONHASHSEED; `-s -P` keep the rest of isolated
mode (no user site, no script directory on sys.path) and the environment is ours anyway.

What is enforced where (`Sandbox.isolation` says what this host allows; probed once):

    threat                      kernel layer (harness, before the program runs)   guard layer
    network                     new network namespace (loopback only, down);       socket creation
                                non-root: user + network namespace
    fork bomb                   RLIMIT_NPROC: 32 tasks for the fresh uid (root),   os.fork/exec/
                                the user's count + 32 otherwise; process-group     spawn, subprocess
                                kill + kill(-1) as the uid after the job
    runaway time                wall clock (parent kills the group), RLIMIT_CPU    -
    memory                      RLIMIT_AS (`memory_mb`)                            -
    huge files / outputs        RLIMIT_FSIZE 16 MiB; stdout capped by the parent    -
    writes outside the dir      fresh unprivileged uid (root only): DAC            open/os.open for
                                                                                   writing, remove,
                                                                                   rename, rmtree...
                                                                                   outside the dir
    killing other processes     fresh uid: EPERM                                   os.kill/killpg
    reading secrets             empty environment; fresh uid cannot read           -
                                /proc/<parent>/environ or the parent's home
    setuid binaries             PR_SET_NO_NEW_PRIVS                                -

The "fresh uid" is a random unused uid per job (root parent only); when the interpreter lives
under a directory other users cannot enter (e.g. /root/.pyenv), a private mount namespace lays
a tmpfs over that directory and re-exposes only the interpreter's own directories, so the
dropped uid can import the standard library (and sees nothing else of that home). The guard is
a Python-level "reliability guard" (as in the reference): it turns the common destructive calls
into PermissionError but can be bypassed by determined code (ctypes); the kernel layer cannot.
Not covered: world-writable directories (/tmp, /dev/shm) stay writable at kernel level for
the fresh uid (the guard refuses them); without root, writes, kills and /proc reads of the
same user rely on the guard alone.

Bounded parallelism: a `Sandbox` runs at most `max_workers` children at a time (a thread pool
of that size; default `max(2, os.cpu_count() // 2)`), for sync (`run`, `run_tests`,
`run_function`) and async (`arun`, `arun_tests`, `arun_function`) callers alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import re
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

__all__ = [
    "CallResult",
    "FunctionRunResult",
    "Isolation",
    "RunResult",
    "Sandbox",
    "SandboxError",
    "default_sandbox",
    "run_function",
    "run_python",
]

log = logging.getLogger(__name__)

Status = Literal["ok", "timeout", "memory", "error", "killed"]

FSIZE_BYTES = 16 << 20  # RLIMIT_FSIZE, as the reference
NOFILE = 256
NPROC = 32  # tasks (processes + threads) the program may have
STARTUP_TIMEOUT_S = 15.0  # from spawn until the harness is ready (a slow host, not the program)
MAX_OUTPUT_BYTES = 16 << 20  # stdout kept; more kills the child (status "killed")
STDERR_KEEP_BYTES = 64 << 10  # the tail of stderr that is kept
_READY = b"\x00routeweaver-sandbox-ready\x00\n"
_CHILD_PATH = "/usr/local/bin:/usr/bin:/bin"
_MEMORY_ERROR = re.compile(r"^(?:[\w.]+\.)?\w*MemoryError\b")


class SandboxError(RuntimeError):
    """The sandbox itself failed (the child could not be set up or started): an infra error,
    never a verdict on the program."""


@dataclasses.dataclass(frozen=True)
class RunResult:
    """One program run. `status`: ok (exit 0) | timeout (wall clock or CPU limit) | memory
    (MemoryError) | error (other non-zero exit, traceback in `stderr`) | killed (a signal, or
    stdout over the cap: `truncated`). `stderr` keeps the tail; `wall_s` counts from the
    harness being ready to the exit."""

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
    """The kernel-level isolation this host allows (see the module doc)."""

    netns: bool
    userns: bool
    uid_drop: bool
    exposed: tuple[tuple[str, tuple[str, ...]], ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def nproc_enforced(self) -> bool:
        """RLIMIT_NPROC binds (the kernel ignores it for uid 0)."""
        return self.uid_drop or os.geteuid() != 0


# ============================================================================ child harness
# Runs in the child as `python -c _CHILD_SOURCE <config json>`. Setup (namespaces, rlimits,
# privilege drop) happens before anything of the program is read; then the ready token goes to
# stderr (the program cannot un-write it, so it cannot fake a setup failure), the payload is
# read from an inherited fd, the guard is installed and the program runs.
_CHILD_SOURCE = r'''
import json, os, sys

READY = b"\x00routeweaver-sandbox-ready\x00\n"


def count_tasks(uid):
    n = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open("/proc/%s/status" % pid) as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                n += int(fields.get("Threads", "1"))
        except (OSError, KeyError, ValueError):
            pass
    return n


def setup(cfg):
    import ctypes, resource
    libc = ctypes.CDLL(None, use_errno=True)

    def check(ret, what):
        if ret != 0:
            err = ctypes.get_errno()
            raise OSError(err, "%s: %s" % (what, os.strerror(err)))

    nproc = cfg.get("nproc")
    if nproc is not None and cfg.get("nproc_relative"):
        nproc += count_tasks(os.getuid())
    flags = 0
    if cfg.get("userns"):
        flags |= 0x10000000
    if cfg.get("netns"):
        flags |= 0x40000000
    if cfg.get("expose"):
        flags |= 0x00020000
    if flags:
        check(libc.unshare(flags), "unshare")
    if cfg.get("expose"):
        mount = libc.mount
        mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                          ctypes.c_char_p]
        ms_nosuid, ms_nodev, ms_bind, ms_move, ms_rec, ms_private = 2, 4, 4096, 8192, 16384, 1 << 18
        check(mount(None, b"/", None, ms_rec | ms_private, None), "make / private")
        for k, (hidden, paths) in enumerate(cfg["expose"]):
            stages = []
            for j, path in enumerate(paths):
                stage = os.path.join(os.getcwd(), ".stage-%d-%d" % (k, j))
                os.mkdir(stage, 0o700)
                check(mount(path.encode(), stage.encode(), None, ms_bind | ms_rec, None),
                      "bind " + path)
                stages.append((stage, path))
            check(mount(b"tmpfs", hidden.encode(), b"tmpfs", ms_nosuid | ms_nodev,
                        b"mode=755,size=1m"), "tmpfs over " + hidden)
            for stage, path in stages:
                os.makedirs(path, 0o755, exist_ok=True)
                check(mount(stage.encode(), path.encode(), None, ms_move, None), "move " + path)
                os.rmdir(stage)
    limits = dict(cfg["rlimits"])
    if nproc is not None:
        limits["RLIMIT_NPROC"] = (nproc, nproc)
    for name, (soft, hard) in limits.items():
        which = getattr(resource, name)
        cur_hard = resource.getrlimit(which)[1]
        if os.geteuid() != 0 and cur_hard != resource.RLIM_INFINITY:
            hard = min(hard, cur_hard)  # an unprivileged process cannot raise its hard limit
        resource.setrlimit(which, (min(soft, hard), hard))
    check(libc.prctl(38, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")
    uid = cfg.get("uid")
    if uid is not None:
        os.setgroups([])
        os.setgid(cfg["gid"])
        os.setuid(uid)
        if os.getuid() != uid or os.geteuid() != uid or os.getgid() != cfg["gid"]:
            raise OSError("the privilege drop did not take")


def guard(root):
    """The reliability guard: common destructive calls raise PermissionError."""
    import builtins, io, posix, resource, shutil, socket, subprocess, _socket
    try:
        import _posixsubprocess
    except ImportError:
        _posixsubprocess = None
    root = os.path.realpath(root)
    realpath, fspath, fsdecode = os.path.realpath, os.fspath, os.fsdecode
    getpid, getpgid = os.getpid, os.getpgid

    def denied(what):
        raise PermissionError("sandbox: %s is not allowed" % what)

    def inside(path):
        if isinstance(path, int):
            return True  # a file descriptor the program already holds
        try:
            p = realpath(fsdecode(fspath(path)))
        except Exception:
            return False
        return p == root or p.startswith(root + os.sep) or p == os.devnull

    def blocked(name):
        def f(*args, **kwargs):
            denied(name)
        return f

    def checked(name, fn, nargs):
        def f(*args, **kwargs):
            if kwargs.get("dir_fd") is not None or kwargs.get("src_dir_fd") is not None \
                    or kwargs.get("dst_dir_fd") is not None:
                denied(name + " with dir_fd")
            for p in args[:nargs]:
                if not inside(p):
                    denied("%s outside the working directory (%r)" % (name, p))
            return fn(*args, **kwargs)
        return f

    real_open = builtins.open

    def guarded_open(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+") and not inside(file):
            denied("writing outside the working directory (%r)" % (file,))
        return real_open(file, mode, *args, **kwargs)

    builtins.open = io.open = guarded_open
    real_os_open = os.open
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def guarded_os_open(path, flags, mode=0o777, *, dir_fd=None):
        if flags & write_flags and (dir_fd is not None or not inside(path)):
            denied("writing outside the working directory (%r)" % (path,))
        return real_os_open(path, flags, mode, dir_fd=dir_fd)

    real_kill, real_killpg = os.kill, os.killpg

    def guarded_kill(pid, sig):
        if pid != getpid():
            denied("signalling another process")
        return real_kill(pid, sig)

    def guarded_killpg(pgid, sig):
        if pgid != getpgid(0):
            denied("signalling another process group")
        return real_killpg(pgid, sig)

    patches = {"open": guarded_os_open, "kill": guarded_kill, "killpg": guarded_killpg}
    for name in ("remove", "unlink", "rmdir", "removedirs", "mkdir", "makedirs", "chmod",
                 "chown", "lchown", "truncate", "utime", "mkfifo", "mknod"):
        if hasattr(os, name):
            patches[name] = checked(name, getattr(os, name), 1)
    for name in ("rename", "renames", "replace", "link", "symlink"):
        if hasattr(os, name):
            patches[name] = checked(name, getattr(os, name), 2)
    for name in ("system", "popen", "fork", "forkpty", "vfork", "posix_spawn", "posix_spawnp",
                 "execl", "execle", "execlp", "execlpe", "execv", "execve", "execvp", "execvpe",
                 "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp",
                 "spawnvpe", "plock"):
        if hasattr(os, name):
            patches[name] = blocked("os." + name)
    for name, fn in patches.items():
        setattr(os, name, fn)
        if hasattr(posix, name):
            setattr(posix, name, fn)
    shutil.rmtree = checked("shutil.rmtree", shutil.rmtree, 1)
    shutil.move = checked("shutil.move", shutil.move, 2)
    shutil.chown = checked("shutil.chown", shutil.chown, 1)

    class NoPopen:
        def __init__(self, *args, **kwargs):
            denied("subprocess")

    subprocess.Popen = NoPopen
    for name in ("run", "call", "check_call", "check_output", "getoutput", "getstatusoutput"):
        setattr(subprocess, name, blocked("subprocess." + name))
    if _posixsubprocess is not None:
        _posixsubprocess.fork_exec = blocked("fork_exec")

    class NoSocket(socket.socket):
        def __init__(self, *args, **kwargs):
            denied("network access")

    socket.socket = socket.SocketType = _socket.socket = NoSocket
    for name in ("create_connection", "create_server", "socketpair", "fromfd"):
        setattr(socket, name, blocked("socket." + name))
    resource.prlimit = blocked("resource.prlimit")
    builtins.help = None


def write_all(fd, data):
    while data:
        data = data[os.write(fd, data):]


def run_script(payload):
    import builtins, linecache, traceback
    program = payload["program"]
    linecache.cache["<program>"] = (len(program), None, program.splitlines(True), "<program>")
    if payload.get("recursion_limit"):
        sys.setrecursionlimit(payload["recursion_limit"])
    try:
        exec(compile(program, "<program>", "exec"),
             {"__name__": "__main__", "__builtins__": builtins})
    except SystemExit as e:
        if not payload.get("swallow_exit"):
            raise
        code = 0
    except BaseException as e:
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        code = 1
    else:
        code = 0
    raise SystemExit(code)


class TestTimeout(BaseException):
    pass


def on_alarm(signum, frame):
    raise TestTimeout()


def encode(value):
    def default(obj):
        if hasattr(obj, "tolist"):  # numpy arrays and scalars
            return obj.tolist()
        raise TypeError("not JSON serialisable: %s" % type(obj).__name__)
    try:
        return {"value": json.loads(json.dumps(value, default=default)), "encoding": "json"}
    except Exception:
        pass
    try:
        return {"value": json.loads(json.dumps(list(value), default=default)),
                "encoding": "list"}
    except Exception:
        return {"value": None, "encoding": "repr",
                "error": "unencodable value: " + repr(value)[:200]}


def run_functional(payload, out):
    import builtins, signal, time, traceback
    limit = payload["per_test_timeout"]
    signal.signal(signal.SIGALRM, on_alarm)
    if payload.get("recursion_limit"):
        sys.setrecursionlimit(payload["recursion_limit"])

    def emit(rec):
        write_all(out, (json.dumps(rec) + "\n").encode())

    def describe(e):
        if isinstance(e, TestTimeout):
            return "timeout", "timed out after %g s" % limit
        if isinstance(e, MemoryError):
            return "memory", "MemoryError"
        return "error", traceback.format_exception_only(type(e), e)[-1].strip()

    def timed(fn):
        signal.setitimer(signal.ITIMER_REAL, limit)
        try:
            return fn()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)

    ns = {"__name__": "solution", "__builtins__": builtins}
    name, style = payload["func_name"], payload["style"]
    try:
        def load():
            if payload.get("prelude"):
                exec(compile(payload["prelude"], "<prelude>", "exec"), ns)
            exec(compile(payload["program"], "<program>", "exec"), ns)
        timed(load)
    except BaseException as e:
        status, error = describe(e)
        emit({"i": -1, "status": status, "error": error})
        return

    def resolve():
        cls = ns.get("Solution")
        if style == "lcb":
            if cls is None:
                raise NameError("class Solution is not defined")
            return getattr(cls(), name)
        if isinstance(cls, type) and hasattr(cls, name):
            return getattr(cls(), name)
        if callable(ns.get(name)):
            return ns[name]
        raise NameError("function %r is not defined" % name)

    for i, args in enumerate(payload["inputs"]):
        t0 = time.perf_counter()
        try:
            rec = timed(lambda: dict(encode(resolve()(*args)), status="ok"))
        except BaseException as e:
            status, error = describe(e)
            rec = {"status": status, "error": error}
        rec["i"], rec["t"] = i, time.perf_counter() - t0
        emit(rec)
        if rec["status"] != "ok" and payload.get("stop_on_error"):
            return


def probe(payload):
    import socket
    report = {"uid": os.getuid(), "ifaces": sorted(n for _, n in socket.if_nameindex())}
    try:
        import decimal, fractions, statistics  # not imported yet: read from the stdlib now
        report["imports"] = all(os.access(d, os.R_OK | os.X_OK) for d in payload["dirs"])
    except Exception as e:
        report["imports"] = False
        report["error"] = repr(e)
    try:
        with open("probe.txt", "w") as f:
            f.write("x")
        report["cwd_write"] = True
    except OSError:
        report["cwd_write"] = False
    print(json.dumps(report))


def main():
    cfg = json.loads(sys.argv[1])
    try:
        setup(cfg)
    except BaseException as e:
        write_all(2, ("routeweaver sandbox setup failed: %r\n" % (e,)).encode())
        os._exit(97)
    write_all(2, READY)
    with os.fdopen(cfg["payload_fd"], "rb") as f:
        payload = json.loads(f.read())
    if cfg["mode"] == "probe":
        return probe(payload)
    if cfg["mode"] == "functional":
        out = os.dup(1)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)  # the program's prints go nowhere; results go to `out`
        os.close(devnull)
        guard(os.getcwd())
        return run_functional(payload, out)
    guard(os.getcwd())
    run_script(payload)


main()
'''


# ============================================================================ isolation plan
def _needed_dirs() -> list[str]:
    """The interpreter's own directories (stdlib, extension modules, site-packages)."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             os.path.dirname(os.path.realpath(sys.executable))}
    paths |= {p for k, p in sysconfig.get_paths().items()
              if k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return sorted({os.path.realpath(p) for p in paths if p and os.path.isdir(p)})


def _exposures(dirs: Sequence[str]
               ) -> tuple[tuple[str, tuple[str, ...]], ...] | None:
    """For the dirs whose ancestors other users cannot traverse: (topmost hidden ancestor,
    dirs to re-expose under it). () if nothing is hidden; None if it cannot be fixed (the
    hidden ancestor is / or the dir itself is unreadable)."""
    groups: dict[str, list[str]] = {}
    for d in dirs:
        if not os.stat(d).st_mode & stat.S_IROTH or not os.stat(d).st_mode & stat.S_IXOTH:
            return None
        parts = d.strip("/").split("/")
        for k in range(len(parts)):
            ancestor = "/" + "/".join(parts[:k])
            if not os.stat(ancestor).st_mode & stat.S_IXOTH:
                if ancestor == "/":
                    return None
                groups.setdefault(ancestor, []).append(d)
                break
    out = []
    for hidden, paths in sorted(groups.items()):
        keep = [p for p in sorted(set(paths))
                if not any(p != q and p.startswith(q + "/") for q in paths)]
        out.append((hidden, tuple(keep)))
    return tuple(out)


def _uid_range() -> tuple[int, int]:
    """Where to draw fresh uids: high, inside this user namespace's uid map."""
    try:
        with open("/proc/self/uid_map") as f:
            ranges = [tuple(map(int, line.split())) for line in f if line.strip()]
    except OSError:
        ranges = [(0, 0, 1 << 32)]
    for lo, hi in ((200_000, 1 << 30), (40_000, 60_000)):
        for inside, _outside, count in ranges:
            if inside <= lo and hi <= inside + count:
                return lo, hi
    return 40_000, 60_000


def _fresh_uid(lo: int, hi: int) -> int:
    import grp
    import pwd
    for _ in range(64):
        uid = lo + secrets.randbelow(hi - lo)
        try:
            pwd.getpwuid(uid)
            continue
        except KeyError:
            pass
        try:
            grp.getgrgid(uid)
            continue
        except KeyError:
            return uid
    raise SandboxError(f"no free uid found in [{lo}, {hi})")


def _child_env(workdir: str) -> dict[str, str]:
    return {"PATH": _CHILD_PATH, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8", "PYTHONHASHSEED": "0", "PYTHONIOENCODING": "utf-8",
            "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    if not os.path.lexists(path):
        return
    # A non-root program may have made a directory unreadable: reopen the real directories
    # (never through a symlink) and try again.
    with contextlib.suppress(OSError):
        if stat.S_ISDIR(os.lstat(path).st_mode):
            os.chmod(path, 0o700)
    for root, dirs, _files in os.walk(path):
        for d in dirs:
            p = os.path.join(root, d)
            with contextlib.suppress(OSError):
                if stat.S_ISDIR(os.lstat(p).st_mode):
                    os.chmod(p, 0o700)
    shutil.rmtree(path, ignore_errors=True)
    if os.path.lexists(path):
        log.warning("sandbox: could not remove %s", path)


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of `uid` (a fresh sandbox uid): kill(-1) run as that uid.

    The killer drops to the uid itself (`setpriv`, or a bare interpreter without it) rather
    than through Popen's `user=`, which makes CPython fork instead of vfork: with the trainer's
    gigabytes mapped, that fork took ~175 ms per job against ~4 ms (bench/RESULTS.md)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(_killer_argv(uid), env={"PATH": _CHILD_PATH}, stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10, cwd="/")


def _killer_argv(uid: int) -> list[str]:
    setpriv, kill = _killer_tools()
    if setpriv and kill:
        return [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--",
                kill, "-9", "-1"]
    return [sys.executable, "-S", "-I", "-c", _KILL_AS_UID, str(uid)]


@functools.cache
def _killer_tools() -> tuple[str | None, str | None]:
    """`setpriv` and `kill` on the children's PATH, looked up once (not on every job)."""
    return shutil.which("setpriv", path=_CHILD_PATH), shutil.which("kill", path=_CHILD_PATH)


# kill(-1) signals every process the caller may signal except itself: as the uid, its own.
_KILL_AS_UID = """import os, sys
uid = int(sys.argv[1])
os.setgroups([]); os.setgid(uid); os.setuid(uid)
try:
    os.kill(-1, 9)
except ProcessLookupError:
    pass
"""


# ============================================================================ one child
@dataclasses.dataclass
class _Raw:
    stdout: bytes
    stderr: bytes
    returncode: int | None
    wall_s: float
    ready: bool
    timed_out: bool
    stopped: bool
    truncated: bool


def _exited(proc: subprocess.Popen) -> bool:
    """True once the child exited, without reaping it (its pid, hence its process group id,
    stays reserved until we kill the group)."""
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _limits(cpu_s: float, memory_mb: int | None) -> dict[str, tuple[int, int]]:
    cpu = math.ceil(cpu_s) + 1
    limits = {"RLIMIT_CPU": (cpu, cpu + 5), "RLIMIT_FSIZE": (FSIZE_BYTES, FSIZE_BYTES),
              "RLIMIT_NOFILE": (NOFILE, NOFILE), "RLIMIT_CORE": (0, 0)}
    if memory_mb is not None:
        limits["RLIMIT_AS"] = (memory_mb << 20, memory_mb << 20)
    return limits


def _status(raw: _Raw) -> tuple[Status, str]:
    """(status, note) of a finished child."""
    if raw.timed_out:
        return "timeout", ""
    if raw.truncated:
        return "killed", f"[sandbox] stdout exceeded {MAX_OUTPUT_BYTES} bytes"
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


# ============================================================================ the sandbox
class Sandbox:
    """Runs programs in limited children, at most `max_workers` at a time (see module doc).

    `tmp_root`: where the per-run working directories are made (default: the system temp
    dir); it must be enterable by other users for the uid drop. `nproc`: RLIMIT_NPROC budget.
    """

    def __init__(self, max_workers: int | None = None, *, tmp_root: str | None = None,
                 nproc: int = NPROC) -> None:
        # At least 2: a child is mostly interpreter start-up (CPU) while its caller waits, so
        # two overlap even on 2 cores (24 short jobs: 1.71 s with 1 worker, 0.92 s with 2).
        n = max(2, (os.cpu_count() or 2) // 2) if max_workers is None else int(max_workers)
        if n < 1:
            raise ValueError(f"Sandbox: max_workers must be >= 1, got {max_workers!r}")
        self.max_workers = n
        self.tmp_root = os.path.realpath(tmp_root or tempfile.gettempdir())
        self.nproc = nproc
        self._pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="sandbox")
        self._isolation: Isolation | None = None
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
        """What this host allows (probed once per process and temp root)."""
        with self._lock:
            if self._isolation is None:
                self._isolation = _probe(self.tmp_root, self.nproc)
                if not (self._isolation.netns and self._isolation.nproc_enforced):
                    log.warning("sandbox: reduced isolation on this host: %s", self._isolation)
            return self._isolation

    def close(self) -> None:
        """Wait for running jobs and stop the worker threads."""
        self._pool.shutdown(wait=True)

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

    @contextlib.contextmanager
    def _uid(self):
        """A fresh uid for one job (None without the uid drop); its leftovers die after."""
        iso = self.isolation
        if not iso.uid_drop:
            yield None
            return
        uid = _fresh_uid(*_uid_range())
        try:
            yield uid
        finally:
            _kill_uid(uid)

    def _run_job(self, program: str, stdin: str | bytes, timeout_s: float,
                 memory_mb: int | None, recursion_limit: int | None, swallow_exit: bool,
                 max_output_bytes: int) -> RunResult:
        with self._uid() as uid:
            return self._script(uid, program, stdin, timeout_s, memory_mb, recursion_limit,
                                swallow_exit, max_output_bytes)

    def _tests_job(self, program: str, stdins: list, per_test: float, total: float,
                   memory_mb: int | None, recursion_limit: int | None, swallow_exit: bool,
                   check: Callable[[int, RunResult], bool] | None) -> list[RunResult]:
        results: list[RunResult] = []
        deadline = time.monotonic() + total
        with self._uid() as uid:
            for i, stdin in enumerate(stdins):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                result = self._script(uid, program, stdin, min(per_test, remaining), memory_mb,
                                      recursion_limit, swallow_exit, MAX_OUTPUT_BYTES)
                results.append(result)
                if check is not None and not check(i, result):
                    break
        return results

    def _script(self, uid: int | None, program: str, stdin: str | bytes, timeout_s: float,
                memory_mb: int | None, recursion_limit: int | None, swallow_exit: bool,
                max_output_bytes: int) -> RunResult:
        payload = {"program": program, "recursion_limit": recursion_limit,
                   "swallow_exit": swallow_exit}
        data = stdin.encode() if isinstance(stdin, str) else bytes(stdin)
        raw = _spawn(self.isolation, self.tmp_root, self.nproc, uid, "script", payload, data,
                     timeout_s, memory_mb, max_output_bytes=max_output_bytes)
        status, note = _status(raw)
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
        with self._uid() as uid:
            raw = _spawn(self.isolation, self.tmp_root, self.nproc, uid, "functional",
                         payload, b"", total, memory_mb, idle_timeout_s=per_test + 1.0,
                         on_line=on_line)
        stderr = raw.stderr.decode("utf-8", "replace")[-8000:]
        finished = raw.stopped or load_error or len(calls) == len(args_list) or (
            stop_on_error and calls and calls[-1].status != "ok")
        if not finished:  # the child died or ran out of time in call len(calls) (or loading)
            status, note = _status(raw)
            if raw.timed_out:
                error = f"timed out after {per_test:g} s"
            elif status == "ok":
                status, error = "error", "the program exited before the call returned"
            else:
                error = note or _last_line(stderr) or f"exit code {raw.returncode}"
            calls.append(CallResult(len(calls), status, error=error))
        return FunctionRunResult(tuple(calls), load_error[0] if load_error else None, stderr,
                                 raw.wall_s)


def _spawn(iso: Isolation, tmp_root: str, nproc: int, uid: int | None, mode: str,
           payload: dict, stdin: bytes, timeout_s: float, memory_mb: int | None, *,
           idle_timeout_s: float | None = None, on_line: Callable[[bytes], bool] | None = None,
           max_output_bytes: int = MAX_OUTPUT_BYTES) -> _Raw:
    """One child in a fresh working directory (removed afterwards), its group killed at the
    end. The payload and stdin travel in anonymous files (inherited fds), never in the dir."""
    workdir = tempfile.mkdtemp(prefix="rw-sbx-", dir=tmp_root)
    try:
        if uid is not None:
            os.chown(workdir, uid, uid)
        os.chmod(workdir, 0o700)
        with tempfile.TemporaryFile() as stdin_file, tempfile.TemporaryFile() as pay_file:
            stdin_file.write(stdin)
            stdin_file.seek(0)
            pay_file.write(json.dumps(payload).encode())
            pay_file.seek(0)
            cfg = {"mode": mode, "payload_fd": pay_file.fileno(), "netns": iso.netns,
                   "userns": iso.userns, "expose": iso.exposed if uid is not None else [],
                   "uid": uid, "gid": uid, "nproc": nproc,
                   "nproc_relative": uid is None and os.geteuid() != 0,
                   "rlimits": _limits(timeout_s, memory_mb)}
            argv = [sys.executable, "-B", "-s", "-P", "-c", _CHILD_SOURCE, json.dumps(cfg)]
            try:
                proc = subprocess.Popen(argv, stdin=stdin_file, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, cwd=workdir,
                                        env=_child_env(workdir), start_new_session=True,
                                        close_fds=True, pass_fds=(pay_file.fileno(),))
            except OSError as exc:
                raise SandboxError(f"sandbox child did not start: {exc}") from exc
            try:
                return _communicate(proc, timeout_s, idle_timeout_s, on_line, max_output_bytes)
            finally:
                _kill_group(proc)
                proc.wait()
                for f in (proc.stdout, proc.stderr):
                    f.close()
    finally:
        _remove_tree(workdir)


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
                # Leftovers of the group would hold the pipes open; a process that left the
                # group gets half a second, then the pipes are abandoned (the uid kill ends it).
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
    return _Raw(bytes(out), bytes(err[-STDERR_KEEP_BYTES:]), returncode, wall, True, timed_out,
                stopped, truncated)


# ============================================================================ probing
_PROBES: dict[tuple[str, int], Isolation] = {}
_PROBES_LOCK = threading.Lock()


def _candidates() -> list[Isolation]:
    if os.geteuid() != 0:
        return [Isolation(netns=True, userns=True, uid_drop=False), Isolation(False, False, False)]
    exposed = _exposures(_needed_dirs())
    plans = []
    for netns, drop in ((True, True), (True, False), (False, True), (False, False)):
        if drop and exposed is None:
            continue
        plans.append(Isolation(netns=netns, userns=False, uid_drop=drop,
                               exposed=exposed if drop else ()))
    return plans


def _probe(tmp_root: str, nproc: int) -> Isolation:
    """The strongest plan that works here: each is tried with a probe child."""
    key = (tmp_root, os.geteuid())
    with _PROBES_LOCK:
        if key in _PROBES:
            return _PROBES[key]
        notes: list[str] = []
        chosen = Isolation(False, False, False, notes=("no plan worked",))
        for plan in _candidates():
            uid = _fresh_uid(*_uid_range()) if plan.uid_drop else None
            try:
                raw = _spawn(plan, tmp_root, nproc, uid, "probe", {"dirs": _needed_dirs()}, b"",
                             10.0, 1024)
                report = json.loads(raw.stdout.decode().strip().splitlines()[-1])
                problems = []
                if raw.returncode != 0:
                    problems.append(f"return code {raw.returncode}")
                if plan.netns and report["ifaces"] != ["lo"]:
                    problems.append(f"interfaces {report['ifaces']}")
                if uid is not None and report["uid"] != uid:
                    problems.append(f"uid {report['uid']}")
                if not report["imports"]:
                    problems.append(f"imports: {report.get('error', 'dirs unreadable')}")
                if not report["cwd_write"]:
                    problems.append("cannot write the working directory")
            except (SandboxError, ValueError, KeyError, IndexError, OSError) as exc:
                problems = [str(exc)[:300]]
            finally:
                if uid is not None:
                    _kill_uid(uid)
            if not problems:
                chosen = dataclasses.replace(plan, notes=tuple(notes))
                break
            notes.append(f"netns={plan.netns} userns={plan.userns} uid_drop={plan.uid_drop}: "
                         + "; ".join(problems))
        _PROBES[key] = chosen
        return chosen


# ============================================================================ module level
_DEFAULT: Sandbox | None = None
_DEFAULT_LOCK = threading.Lock()


def default_sandbox() -> Sandbox:
    """The process-wide sandbox the scorers use (`max(2, cpu_count // 2)` workers)."""
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
