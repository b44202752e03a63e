"""The attack behind `syscalls_filtered`: a job tries the kernel's side doors, and the host
reads the job's seccomp state.

Inside, the job makes each call of `syscalls.PROBES` (by number, through libc's `syscall`),
with arguments that succeed, or fail with another error than EPERM, where no filter stands
in the way (io_uring_setup with a zeroed setup block returns a ring; keyctl reads the session
and user keyrings; add_key adds a key to the session keyring; ptrace attaches to the job's
own child; ...), and prints each call's outcome: "ok" or the errno's name. Outside, while
the job waits, the host finds it by its process name and reads `Seccomp` and
`Seccomp_filters` from its /proc status. The guarantee holds when every call failed with
EPERM and the host saw a filter (mode 2) on the job.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jax_routeweaver.rewards.sandbox import syscalls

# The program; {numbers}, {marker} and {wait_s} are filled in. Each entry: the call and its
# arguments (c_long values, byte strings, a zeroed 4 KiB buffer `buf`, `child`: a sleeping
# child's pid). Harmless where nothing refuses them, even as root (`none`, or a host without
# the filter): no real mount target, file, module or kernel image; keys go to the job's own
# process keyring; the namespace unshared is the job's own.
PROGRAM = """
import ctypes, errno, json, os, time
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
L, buf = ctypes.c_long, ctypes.create_string_buffer(4096)
libc.prctl(15, {marker!r})  # PR_SET_NAME: the host finds the job by this name
child = os.fork()
if child == 0:
    time.sleep(30)
    os._exit(0)
NR = {numbers!r}
ATTEMPTS = {{
    "io_uring_setup": ("io_uring_setup", L(8), buf),
    "keyctl session keyring": ("keyctl", L(0), L(-3), L(0)),
    "keyctl user keyring": ("keyctl", L(0), L(-4), L(0)),
    "keyctl read session keyring": ("keyctl", L(11), L(-3), buf, L(4096)),
    "add_key": ("add_key", b"user", b"rw-probe", b"x", L(1), L(-2)),
    "request_key": ("request_key", b"user", b"rw-probe", None, L(-2)),
    "bpf": ("bpf", L(0), buf, L(72)),
    "perf_event_open": ("perf_event_open", buf, L(0), L(-1), L(-1), L(0)),
    "userfaultfd": ("userfaultfd", L(0)),
    "ptrace attach": ("ptrace", L(16), L(child), None, None),
    "process_vm_readv": ("process_vm_readv", L(child), None, L(0), None, L(0), L(0)),
    "mount": ("mount", b"none", b"rw-probe", b"rw-no-such-fs", L(0), None),
    "umount2": ("umount2", b"rw-probe", L(0)),
    "pivot_root": ("pivot_root", b"/rw-no-such-dir", b"/rw-no-such-dir"),
    "chroot": ("chroot", b"/rw-no-such-dir"),
    "unshare": ("unshare", L(0x00020000)),
    "setns": ("setns", L(-1), L(0)),
    "kexec_load": ("kexec_load", L(0), L(0), None, L(0x7FFF0000)),
    "init_module": ("init_module", buf, L(16), b""),
    "finit_module": ("finit_module", L(-1), b"", L(0)),
    "delete_module": ("delete_module", b"rw_no_such_module", L(0)),
    "open_by_handle_at": ("open_by_handle_at", L(-100), buf, L(0)),
    "name_to_handle_at": ("name_to_handle_at", L(-100), b"/", buf, buf, L(0)),
    "fsopen": ("fsopen", b"tmpfs", L(0)),
    "open_tree": ("open_tree", L(-100), b"/", L(0)),
    "move_mount": ("move_mount", L(-1), b"", L(-1), b"", L(0)),
    "reboot": ("reboot", L(0), L(0), L(0), None),
    "swapon": ("swapon", b"/rw-no-such-file", L(0)),
}}
out = {{}}
for what, (name, *args) in ATTEMPTS.items():
    if name not in NR:
        continue
    ctypes.set_errno(0)
    rc = libc.syscall(L(NR[name]), *args)
    out[what] = "ok" if rc >= 0 else errno.errorcode.get(ctypes.get_errno(), "?")
os.kill(child, 9)
time.sleep({wait_s})  # the host reads our seccomp state meanwhile
print(json.dumps(out))
"""


def attack(run: Callable[[str], str], find: Callable[[str], list[int]], *,
           wait_s: float = 2.0) -> tuple[bool, str, dict[str, Any]]:
    """(holds, detail, what was seen) of the attack, with `run(program)` running one job
    and returning its stdout (on a thread while the host watches) and `find(name)` the
    host pids of processes named `name`."""
    marker = f"rws{secrets.token_hex(4)}"  # the job's process name (15 characters at most)
    _, meta = syscalls.filter_files()
    program = PROGRAM.format(numbers=meta["probes"], marker=marker.encode(), wait_s=wait_s)
    stdout: list[str] = []
    job = threading.Thread(target=lambda: stdout.append(run(textwrap.dedent(program))))
    job.start()
    seen = _seccomp_of(marker, find, deadline=time.monotonic() + wait_s + 8.0)
    job.join(60)
    lines = stdout[0].strip().splitlines() if stdout else []
    calls = json.loads(lines[-1]) if lines else {}
    allowed = sorted(k for k, v in calls.items() if v != "EPERM")
    filtered = seen.get("Seccomp") == "2" and int(seen.get("Seccomp_filters") or 0) >= 1
    holds = bool(calls) and not allowed and filtered
    detail = (f"{len(calls) - len(allowed)}/{len(calls)} calls refused with EPERM"
              + (f" (not refused: {', '.join(f'{k}: {calls[k]}' for k in allowed)})"
                 if allowed else "")
              + f"; the host saw Seccomp {seen.get('Seccomp', '?')}, filters "
                f"{seen.get('Seccomp_filters', '?')}")
    return holds, detail, {"calls": calls, "status": seen}


def _seccomp_of(marker: str, find: Callable[[str], list[int]], deadline: float
                ) -> dict[str, str]:
    """`Seccomp` and `Seccomp_filters` of the first host process named `marker` (`find`: its
    pids) seen before `deadline`; {} if none."""
    while time.monotonic() < deadline:
        for pid in find(marker):
            with contextlib.suppress(OSError):
                status = dict(line.split(":", 1) for line in
                              Path(f"/proc/{pid}/status").read_text().splitlines()
                              if ":" in line)
                return {k: status.get(k, "").strip() for k in ("Seccomp", "Seccomp_filters")}
        time.sleep(0.05)
    return {}
