"""One control group per sandbox job: memory, process count and CPU bounded for the whole tree.

A job's processes (the jail launcher, its init, the program and everything it forks) join the
job's cgroup before the jail starts, so the limits hold for their sum, not per process:

    memory   anonymous memory, tmpfs files (the jail's /, /tmp, /dev/shm) and memfds are all
             charged to the cgroup; past the limit the kernel's OOM killer ends the job
    pids     at most `pids` tasks (processes and threads) alive at once: a fork bomb stalls
    cpu      at most one CPU's worth of time per period (where the cpu controller is there)

Both cgroup layouts are supported, wherever this process may write (`_find_layout`):

    v1 (one hierarchy per controller): under `<controller mount>/<this process's cgroup>/`,
        which root, or an administrator's delegation (the directory chowned to the user, as
        `cgcreate -a -t` does), makes writable.
    v2 (unified), as root or where the parent is delegated: a sibling of this process's own
        cgroup, `<parent>/routeweaver-sandbox-<pid>-<random>/` (a v2 cgroup that holds
        processes cannot enable controllers for children); in the root cgroup, under it.
    v2, own cgroup delegated (`systemd-run --user --scope -p Delegate=yes`, a systemd user
        service with `Delegate=yes`, a container's own cgroup namespace): this cgroup's
        processes first move into its leaf child `routeweaver-leaf/`, then the controllers are
        enabled for its children and the job groups made beside the leaf.

`CgroupUnavailable` says, for each layout, what is missing. Directories left by a dead process
are removed by the next sandbox that starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import itertools
import os
import secrets
import signal
import threading
import time
from pathlib import Path

__all__ = ["LEAF", "CgroupUnavailable", "JobCgroup", "JobCgroups"]

_MOUNTINFO = "/proc/self/mountinfo"
_PREFIX = "routeweaver-sandbox-"
LEAF = "routeweaver-leaf"  # where a delegated v2 cgroup's own processes move
_CPU_PERIOD_US = 100_000


class CgroupUnavailable(RuntimeError):
    """No usable cgroup here: the message names what is missing."""


@dataclasses.dataclass(frozen=True)
class JobCgroup:
    """The directories of one job (one per hierarchy: a single one on v2)."""

    version: int
    dirs: tuple[Path, ...]

    @property
    def procs_files(self) -> tuple[str, ...]:
        """The files a process writes its pid to (`0`: itself) to join this job."""
        return tuple(str(d / "cgroup.procs") for d in self.dirs)

    def oom_kills(self) -> int:
        """How many processes of the job the OOM killer ended."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        for d in self.dirs:
            with contextlib.suppress(OSError):
                for line in (d / name).read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        return 0

    def pids(self) -> set[int]:
        out: set[int] = set()
        for d in self.dirs:
            with contextlib.suppress(OSError):
                out |= {int(p) for p in (d / "cgroup.procs").read_text().split()}
        return out

    def destroy(self, timeout_s: float = 5.0) -> None:
        """Kill every process of the job, then remove its directories."""
        deadline = time.monotonic() + timeout_s
        for d in self.dirs:
            with contextlib.suppress(OSError):
                (d / "cgroup.kill").write_text("1")  # v2, kernel >= 5.14: the whole group at once
        while (left := self.pids()) and time.monotonic() < deadline:
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.005)
        for d in self.dirs:
            while True:
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:  # EBUSY until the killed tasks are reaped
                    if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                        break
                    time.sleep(0.005)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where the job groups go: cgroup `version`, controller -> sandbox parent directory
    (`bases`), the `controllers` to limit, and `delegated`: the v2 cgroup of this process
    whose processes must move into a leaf before it can enable controllers (else None)."""

    version: int
    bases: dict[str, Path]
    controllers: tuple[str, ...]
    delegated: Path | None = None


class JobCgroups:
    """Makes and configures one `JobCgroup` per job under this process's sandbox parent."""

    def __init__(self) -> None:
        self._layout = _find_layout()
        self._version, self._bases = self._layout.version, self._layout.bases
        self._controllers = self._layout.controllers
        self._counter = itertools.count()
        self._lock = threading.Lock()
        self._ready = False

    @property
    def version(self) -> int:
        return self._version

    @property
    def controllers(self) -> tuple[str, ...]:
        return self._controllers

    def create(self, memory_bytes: int, pids: int) -> JobCgroup:
        """A fresh job group with its limits set. Raises `CgroupUnavailable`."""
        with self._lock:
            if not self._ready:
                self._prepare()
                self._ready = True
            name = f"job-{next(self._counter)}"
        dirs = []
        try:
            for controller, base in self._bases.items():
                d = base / name
                if d in dirs:
                    continue
                d.mkdir(mode=0o755)
                dirs.append(d)
                if self._version == 1:
                    _limit_v1(d, controller, memory_bytes, pids)
            if self._version == 2:
                _limit_v2(dirs[0], memory_bytes, pids, "cpu" in self._controllers)
        except OSError as exc:
            JobCgroup(self._version, tuple(dirs)).destroy()
            raise CgroupUnavailable(f"cannot set up a job cgroup: {exc}") from exc
        return JobCgroup(self._version, tuple(dirs))

    def _prepare(self) -> None:
        for base in set(self._bases.values()):
            _remove_stale(base.parent)
        enable = " ".join("+" + c for c in self._controllers)
        try:
            if self._layout.delegated is not None:
                _move_to_leaf(self._layout.delegated)
            if self._version == 2:  # the parent may not delegate them yet
                with contextlib.suppress(OSError):
                    base = next(iter(self._bases.values()))
                    (base.parent / "cgroup.subtree_control").write_text(enable)
            for base in set(self._bases.values()):
                base.mkdir(mode=0o755, exist_ok=True)
            if self._version == 2:
                (base / "cgroup.subtree_control").write_text(enable)
        except OSError as exc:
            raise CgroupUnavailable(f"cannot create the sandbox's cgroup: {exc}") from exc

    def close(self) -> None:
        """Remove the (empty) sandbox parent directories."""
        for base in set(self._bases.values()):
            with contextlib.suppress(OSError):
                base.rmdir()


def _remove_stale(parent: Path) -> None:
    """Remove the sandbox directories a dead process left (their job groups are empty)."""
    for d in parent.glob(_PREFIX + "*"):
        pid = d.name[len(_PREFIX):].split("-")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            for job in d.glob("job-*"):
                JobCgroup(0, (job,)).destroy(timeout_s=1.0)
            with contextlib.suppress(OSError):
                d.rmdir()


def _limit_v1(d: Path, controller: str, memory_bytes: int, pids: int) -> None:
    if controller == "memory":
        (d / "memory.limit_in_bytes").write_text(str(memory_bytes))
        if (d / "memory.memsw.limit_in_bytes").exists():  # swap counted too, where accounted
            (d / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
    elif controller == "pids":
        (d / "pids.max").write_text(str(pids))
    elif controller == "cpu":
        (d / "cpu.cfs_period_us").write_text(str(_CPU_PERIOD_US))
        (d / "cpu.cfs_quota_us").write_text(str(_CPU_PERIOD_US))


def _limit_v2(d: Path, memory_bytes: int, pids: int, cpu: bool) -> None:
    (d / "memory.max").write_text(str(memory_bytes))
    if (d / "memory.swap.max").exists():
        (d / "memory.swap.max").write_text("0")
    (d / "pids.max").write_text(str(pids))
    if cpu:
        (d / "cpu.max").write_text(f"{_CPU_PERIOD_US} {_CPU_PERIOD_US}")


def _mounts() -> list[tuple[str, str, set[str], str]]:
    """(mount point, fs type, super options, root within the hierarchy) of cgroup mounts."""
    out = []
    with open(_MOUNTINFO) as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if len(rfields) >= 3 and rfields[0] in ("cgroup", "cgroup2"):
                out.append((fields[4], rfields[0], set(rfields[2].split(",")), fields[3]))
    return out


def _own_cgroups() -> dict[str, str]:
    """Controller ("" for v2) -> this process's cgroup path."""
    out: dict[str, str] = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, names, path = line.rstrip("\n").split(":", 2)
            for name in names.split(",") if names else [""]:
                out[name] = path
    return out


def _move_to_leaf(group: Path) -> None:
    """Move every process of the v2 cgroup `group` into its child `LEAF`, so that `group`
    holds none and may enable controllers for its children (cgroup v2's rule)."""
    leaf = group / LEAF
    leaf.mkdir(mode=0o755, exist_ok=True)
    for pid in (group / "cgroup.procs").read_text().split():
        try:
            (leaf / "cgroup.procs").write_text(pid)
        except ProcessLookupError:  # it exited meanwhile
            continue


def _writable(*paths: Path) -> bool:
    return all(os.access(p, os.W_OK) for p in paths)


def _controllers_in(path: Path) -> set[str]:
    try:
        return set(path.read_text().split())
    except OSError:
        return set()


def _find_layout() -> _Layout:
    """The first layout (module doc) this process may write, or `CgroupUnavailable` saying
    what each lacks."""
    try:
        mounts, own = _mounts(), _own_cgroups()
    except OSError as exc:
        raise CgroupUnavailable(f"cannot read the cgroup mounts: {exc}") from exc
    tag = f"{_PREFIX}{os.getpid()}-{secrets.token_hex(3)}"  # one per JobCgroups
    uid, missing = os.geteuid(), []
    v1: dict[str, Path] = {}
    for point, fstype, opts, root in mounts:
        if fstype != "cgroup":
            continue
        for controller in ("memory", "pids", "cpu"):
            if controller in opts and controller in own and controller not in v1:
                v1[controller] = _under(point, root, own[controller])
    if "memory" in v1 and "pids" in v1:
        closed = sorted({str(d) for d in v1.values() if not _writable(d)})
        if not closed:
            return _Layout(1, {c: d / tag for c, d in v1.items()}, tuple(v1))
        missing.append(f"cgroup v1: {', '.join(closed)} not writable by uid {uid} (not root, "
                       "and not delegated to this user)")
    for point, fstype, _opts, root in mounts:
        if fstype != "cgroup2" or "" not in own:
            continue
        layout, why = _v2_layout(_under(point, root, own[""]), tag)
        if layout is not None:
            return layout
        missing.append(f"cgroup v2 ({point}): {why}")
    if not missing:
        missing.append(f"no cgroup hierarchy with the memory and pids controllers is mounted "
                       f"for this process (v1 controllers: {sorted(v1) or 'none'})")
    raise CgroupUnavailable("; ".join(missing))


def _v2_layout(mine: Path, tag: str) -> tuple[_Layout | None, str]:
    """The v2 layout for a process in cgroup directory `mine`, or (None, what is missing)."""
    wanted = ("memory", "pids")
    real_root = not (mine / "cgroup.type").exists()  # only non-root cgroups have the file
    if not real_root:  # a sibling: root, or a parent delegated to us
        parent = mine.parent
        enabled = _controllers_in(parent / "cgroup.subtree_control")
        if set(wanted) <= enabled and _writable(parent, parent / "cgroup.subtree_control"):
            ours = tuple(c for c in (*wanted, "cpu") if c in enabled)
            return _Layout(2, {c: parent / tag for c in ours}, ours), ""
    available = _controllers_in(mine / "cgroup.controllers")
    if not set(wanted) <= available:
        return None, (f"the memory and pids controllers are not available to {mine} "
                      f"(it has: {' '.join(sorted(available)) or 'none'})")
    if not _writable(mine, mine / "cgroup.procs", mine / "cgroup.subtree_control"):
        return None, (f"{mine} is not writable by uid {os.geteuid()} (not root, and not a "
                      "delegated subtree: systemd-run --user --scope -p Delegate=yes)")
    ours = tuple(c for c in (*wanted, "cpu") if c in available)
    return _Layout(2, {c: mine / tag for c in ours}, ours, None if real_root else mine), ""


def _under(point: str, root: str, path: str) -> Path:
    """The directory of cgroup `path` in a hierarchy mounted at `point` (showing `root`)."""
    rel = os.path.relpath(path, root) if path.startswith(root) else path.lstrip("/")
    return Path(point) if rel in (".", "") else Path(point) / rel
