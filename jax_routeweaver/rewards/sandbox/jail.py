"""The jail: bubblewrap's namespaces around a mount tree that holds only the interpreter.

`bwrap_argv` builds the command line of one job. What the program sees:

    /                       a fresh tmpfs, read-only once set up
    /usr/lib, /lib*, ...    the system's shared libraries, read-only
    <stdlib>                this interpreter's standard library, read-only; its
                            site-packages (and Debian's dist-packages) covered by empty,
                            read-only tmpfs: the program imports the standard library only
    <python>                the interpreter binary (and libpython, when shared), read-only
    /.sandbox/child.py      the harness (`child.py`), read-only
    /sandbox                the working directory and HOME: an empty tmpfs of `SCRATCH_BYTES`
    /tmp, /dev/shm          empty tmpfs of `SCRATCH_BYTES` each
    /proc                   the job's own PID namespace only
    /dev                    null, zero, full, random, urandom, tty, pts

Nothing else of the host exists inside: no /etc, no home directories, no project checkout,
no data files, no other process. Namespaces: user (no capabilities, nested user namespaces
refused), mount, PID (the job's processes die with its init), network (its own loopback
only; abstract unix sockets are per network namespace), IPC, UTS and cgroup. Everything
written lives in the jail's tmpfs and is gone when the job ends. System calls: the seccomp
allow-list of `syscalls` (others fail with EPERM).

`launcher_argv` wraps that command in `launch.py`, which joins the job's cgroups, gives the
job a fresh session keyring and, when this process is root, drops to a fresh unprivileged
uid first (`fresh_uid`): bubblewrap then
runs unprivileged and its user namespace maps the job to that uid, never to root. Host
directories that uid cannot enter but the jail needs (`exposures`) are re-exposed in a
private mount namespace, holding only those paths.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import shutil
import site
import stat
import sys
import sysconfig
from collections.abc import Mapping, Sequence
from pathlib import Path

from jax_routeweaver.rewards.sandbox import syscalls

__all__ = ["HARNESS", "SCRATCH_BYTES", "WORKDIR", "bwrap_argv", "exposures", "find_bwrap",
           "fresh_uid", "launcher_argv", "readable_paths"]

HARNESS = "/.sandbox/child.py"  # the harness's path inside the jail
WORKDIR = "/sandbox"
SCRATCH_BYTES = 64 << 20  # each writable tmpfs; its pages count against the job's memory too
_ROOT_BYTES = 1 << 20  # the skeleton of mount points
_SANDBOX_UID = 65534  # "nobody" inside; outside, the user namespace maps it to the caller
_SYSTEM_LIBS = ("/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/libx32", "/lib", "/lib64",
                "/lib32", "/libx32")
_LOADER_CACHE = "/etc/ld.so.cache"
_CHILD_SOURCE = Path(__file__).with_name("child.py")
_LAUNCHER = Path(__file__).with_name("launch.py")


@functools.cache
def find_bwrap() -> str | None:
    """The `bwrap` executable, looked up once."""
    return shutil.which("bwrap") or shutil.which("bwrap", path="/usr/bin:/bin:/usr/local/bin")


def interpreter() -> str:
    """The base interpreter (a virtual environment's python is a link to it)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


@functools.cache
def _python_paths() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(paths to bind, site-packages dirs to cover) of the base interpreter (looked up once,
    not on every job)."""
    exe = interpreter()
    scheme = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix})
    binds = [exe, scheme["stdlib"], scheme["platstdlib"]]
    libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    if sysconfig.get_config_var("Py_ENABLE_SHARED") and libdir and soname:
        binds.append(os.path.join(libdir, soname))
    hidden = site.getsitepackages([sys.base_prefix, sys.base_exec_prefix])
    hidden += ["/usr/lib/python3/dist-packages",
               f"/usr/lib/python3.{sys.version_info.minor}/dist-packages"]
    return tuple(binds), tuple(hidden)


def readable_paths() -> list[str]:
    """Every host path the jail binds read-only."""
    out = [d for d in _SYSTEM_LIBS if os.path.isdir(d) and not os.path.islink(d)]
    if os.path.exists(_LOADER_CACHE):
        out.append(_LOADER_CACHE)
    binds, _ = _python_paths()
    for p in binds:
        if os.path.exists(p) and not any(_within(p, q) for q in out):
            out.append(p)
    return [*out, str(_CHILD_SOURCE)]


@functools.cache
def exposures() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(topmost host directory other users cannot enter, the jail's paths under it), for
    each such directory (e.g. /root when the interpreter is /root/.pyenv/...)."""
    groups: dict[str, list[str]] = {}
    for path in readable_paths():
        parts = Path(path).parts
        for k in range(1, len(parts)):
            ancestor = str(Path(*parts[:k]))
            if not os.stat(ancestor).st_mode & stat.S_IXOTH:
                if ancestor == "/":
                    raise OSError(f"the root directory is closed to other users; {path} "
                                  f"cannot be exposed")
                groups.setdefault(ancestor, []).append(path)
                break
    return tuple((hidden, tuple(sorted(set(paths)))) for hidden, paths in sorted(groups.items()))


def fresh_uid() -> int:
    """A random uid (and gid) that no account and no process uses, inside this process's uid
    map: one per job."""
    import grp
    import pwd
    lo, hi = _uid_range()
    for _ in range(64):
        uid = lo + secrets.randbelow(hi - lo)
        try:
            pwd.getpwuid(uid)
            continue
        except KeyError:
            pass
        try:
            grp.getgrgid(uid)
        except KeyError:
            return uid
    raise OSError(f"no free uid found in [{lo}, {hi})")


def _uid_range() -> tuple[int, int]:
    """High uids, inside this user namespace's uid map."""
    try:
        with open("/proc/self/uid_map") as f:
            ranges = [tuple(map(int, line.split())) for line in f if line.strip()]
    except OSError:
        ranges = [(0, 0, 1 << 32)]
    for lo, hi in ((200_000, 1 << 30), (40_000, 60_000)):
        if any(inside <= lo and hi <= inside + count for inside, _, count in ranges):
            return lo, hi
    return 40_000, 60_000


@functools.cache
def stage_dir() -> str:
    """A host directory that no path of the jail is under, nor any hidden directory: the
    launcher's private tmpfs goes there while it re-exposes paths (it hides what was there,
    in the launcher's own mount namespace only)."""
    taken = [*readable_paths(), *(hidden for hidden, _ in exposures())]
    for d in ("/var/tmp", "/tmp", "/dev/shm", "/mnt", "/media", "/srv"):
        if os.path.isdir(d) and not os.path.islink(d) and not any(
                _within(p, d) or _within(d, p) for p in taken):
            return d
    raise OSError(f"no directory to stage the jail's binds in: every candidate holds one of "
                  f"{taken}")


def launcher_argv(jail_argv: Sequence[str], *, cgroup_procs: Sequence[str],
                  uid: int | None) -> list[str]:
    """`jail_argv` started by `launch.py`: cgroups joined, then (root only) the uid drop."""
    expose = [[h, list(p)] for h, p in exposures()] if uid is not None else []
    config = {"cgroup_procs": list(cgroup_procs), "uid": uid, "argv": list(jail_argv),
              "expose": expose, "stage": stage_dir() if expose else None,
              "keyctl": syscalls.filter_files()[1]["probes"]["keyctl"]}
    return [interpreter(), "-S", "-I", str(_LAUNCHER), json.dumps(config)]


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def bwrap_argv(bwrap: str, env: Mapping[str, str], args: list[str], *, seccomp_fd: int,
               info_fd: int | None = None, user_namespace: bool = True) -> list[str]:
    """The command line that runs the harness with `args` inside a fresh jail, under the
    seccomp filter that bubblewrap reads from the inherited descriptor `seccomp_fd`
    (`syscalls`: a compiled BPF program, installed just before the harness starts).
    `info_fd`: a descriptor bubblewrap writes its JSON information to at start, among it
    ``child-pid``, the host pid of the jail's init (the runner waits for that pid to end).

    `user_namespace` False leaves out `--unshare-user` (for hosts that forbid user namespaces
    to this user while allowing bwrap's other namespaces, e.g. a setuid bwrap)."""
    argv = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--hostname", "sandbox", "--clearenv", "--seccomp", str(seccomp_fd)]
    if info_fd is not None:
        argv += ["--info-fd", str(info_fd)]
    if user_namespace:
        argv += ["--unshare-user", "--disable-userns", "--uid", str(_SANDBOX_UID),
                 "--gid", str(_SANDBOX_UID)]
    for key, value in env.items():
        argv += ["--setenv", key, value]
    argv += ["--size", str(_ROOT_BYTES), "--tmpfs", "/"]
    bound: list[str] = []
    for d in _SYSTEM_LIBS:
        if os.path.islink(d):
            argv += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            argv += ["--ro-bind", d, d]
            bound.append(d)
    if os.path.exists(_LOADER_CACHE):
        argv += ["--ro-bind", _LOADER_CACHE, _LOADER_CACHE]
    binds, hidden = _python_paths()
    for p in binds:
        if os.path.exists(p) and not any(_within(p, q) for q in bound):
            argv += ["--ro-bind", p, p]
            bound.append(p)
    for p in hidden:
        if os.path.isdir(p) and any(_within(p, q) for q in bound):
            argv += ["--size", "4096", "--tmpfs", p, "--remount-ro", p]
    argv += ["--ro-bind", str(_CHILD_SOURCE), HARNESS,
             "--proc", "/proc", "--dev", "/dev"]
    for scratch in ("/tmp", "/dev/shm", WORKDIR):
        argv += ["--size", str(SCRATCH_BYTES), "--tmpfs", scratch]
    argv += ["--remount-ro", "/", "--chdir", WORKDIR, interpreter(), "-B", "-s", "-P", HARNESS,
             *args]
    return argv
