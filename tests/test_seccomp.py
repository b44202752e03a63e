"""The jail's seccomp filter (rewards/sandbox/syscalls.py): the checked-in BPF programs allow
exactly the policy, jobs at `full` and `namespaces` cannot use the kernel's side doors, jobs
get a fresh session keyring, and real workloads still run under the filter."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import struct
import subprocess
import textwrap

import pytest

from jax_routeweaver.rewards.sandbox import Sandbox, check, jail, syscalls

pytestmark = pytest.mark.integration

RET_ALLOW, RET_ERRNO, ERRNO_MASK = 0x7FFF0000, 0x00050000, 0xFFFF
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
# The legacy calls aarch64's ABI does not have (it has their *at / 2 / p forms only).
NOT_ON_AARCH64 = {
    "access", "alarm", "arch_prctl", "chmod", "chown", "creat", "dup2", "epoll_create",
    "epoll_wait", "eventfd", "fork", "futimesat", "getdents", "getpgrp", "inotify_init",
    "lchown", "link", "lstat", "mkdir", "open", "pause", "pipe", "poll", "readlink", "rename",
    "rmdir", "select", "signalfd", "stat", "symlink", "time", "unlink", "utime", "utimes",
    "vfork"}


def run_bpf(program: bytes, nr: int, arch: int) -> int:
    """The action a classic BPF seccomp program returns for syscall `nr` on `arch` (all
    arguments and the instruction pointer 0): a small interpreter of the instructions
    libseccomp emits."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, *[0] * 6)  # struct seccomp_data
    insns = [struct.unpack("<HBBI", program[i:i + 8]) for i in range(0, len(program), 8)]
    pc, a, x = 0, 0, 0
    for _ in range(len(insns) + 1):
        code, jt, jf, k = insns[pc]
        cls, op, src = code & 0x07, code & 0xF0, code & 0x08
        if code == 0x20:  # ld [k] (32-bit word of seccomp_data)
            a = struct.unpack_from("<I", data, k)[0]
        elif code == 0x06:  # ret #k
            return k
        elif code == 0x16:  # ret a
            return a
        elif code == 0x05:  # ja
            pc += k
        elif cls == 0x05:  # conditional jumps
            operand = x if src else k
            taken = {0x10: a == operand, 0x20: a > operand, 0x30: a >= operand,
                     0x40: bool(a & operand)}[op]
            pc += jt if taken else jf
        elif cls == 0x04:  # alu
            operand = x if src else k
            a = {0x50: a & operand, 0x40: a | operand, 0x00: a + operand,
                 0x10: a - operand}[op] & 0xFFFFFFFF
        elif code == 0x07:  # tax
            x = a
        elif code == 0x87:  # txa
            a = x
        else:
            raise AssertionError(f"instruction {code:#x} at {pc} is not interpreted here")
        pc += 1
    raise AssertionError("the program did not return")


def verdicts(program: bytes, arch: int) -> dict[int, int]:
    return {nr: run_bpf(program, nr, arch) for nr in range(1024)}


@pytest.mark.parametrize("machine", sorted(AUDIT_ARCH))
def test_each_filter_allows_exactly_the_policy_and_refuses_the_rest_with_eperm(machine,
                                                                              tmp_path):
    bpf, meta = syscalls.filter_files(machine)
    program, arch = bpf.read_bytes(), AUDIT_ARCH[machine]
    expected = set(syscalls.ALLOWED) - (NOT_ON_AARCH64 if machine == "aarch64" else set())
    assert set(meta["allowed"]) == expected
    allowed = set(meta["allowed"].values())
    assert not allowed & set(meta["probes"].values())
    assert set(meta["probes"]) == set(syscalls.PROBES)
    got = verdicts(program, arch)
    eperm = RET_ERRNO | errno.EPERM
    assert {nr for nr, v in got.items() if v == RET_ALLOW} == allowed
    assert {v for nr, v in got.items() if nr not in allowed} == {eperm}
    other = next(a for m, a in AUDIT_ARCH.items() if m != machine)  # another ABI: refused
    assert {run_bpf(program, nr, other) for nr in sorted(allowed)[:20]} == {eperm}
    if machine == "x86_64":  # the x32 ABI's numbers (bit 30 set) too
        assert {run_bpf(program, nr | 0x40000000, arch) for nr in sorted(allowed)[:20]} \
            == {eperm}
    # Where libseccomp is installed, a rebuild from the policy gives the same filter.
    if ctypes.util.find_library("seccomp"):
        from jax_routeweaver.rewards.sandbox import seccomp_build

        fresh = seccomp_build.build(machine, tmp_path, seccomp_build.libseccomp())
        assert (fresh["allowed"], fresh["probes"]) == (meta["allowed"], meta["probes"])
        assert verdicts((tmp_path / f"{machine}.bpf").read_bytes(), arch) == got


def test_a_machine_without_a_filter_is_refused(monkeypatch):
    with pytest.raises(OSError, match="no seccomp filter for this architecture"):
        syscalls.filter_files("riscv64")
    monkeypatch.setattr(syscalls, "machine", lambda: None)
    with pytest.raises(OSError, match="no seccomp filter"):
        syscalls.filter_files()


@pytest.mark.parametrize("level", ["full", "namespaces"])
def test_jobs_cannot_use_the_kernels_side_doors(level):
    """io_uring, the keyrings, bpf, perf, userfaultfd, ptrace of a sibling process, mounts,
    module and kernel loading, handles: each fails with EPERM inside a job, and the host sees
    the filter on the job."""
    box = Sandbox(1, isolation=level)
    try:
        outcome = check.syscalls_filtered(box)
    finally:
        box.close()
    assert outcome.holds, outcome.detail
    assert f"{len(syscalls.PROBES) + 2}/{len(syscalls.PROBES) + 2} calls refused" \
        in outcome.detail  # keyctl three ways


def _keyctl(*args: int) -> tuple[int, int]:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    nr = syscalls.filter_files()[1]["probes"]["keyctl"]
    rc = libc.syscall(ctypes.c_long(nr), *(ctypes.c_long(a) for a in args))
    return rc, ctypes.get_errno()


def test_a_job_gets_a_fresh_session_keyring_and_none_of_the_trainers_keys():
    """A key in the trainer's session keyring: the launcher's child (no jail, no filter: the
    keyring alone) has another session keyring and cannot read the key; a jailed job cannot
    even ask (EPERM)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    add_key = syscalls.filter_files()[1]["probes"]["add_key"]
    key = libc.syscall(ctypes.c_long(add_key), b"user", b"rw-trainer-secret", b"sk-secret",
                       ctypes.c_long(9), ctypes.c_long(-3))
    refused = ctypes.get_errno()
    probe = textwrap.dedent(f"""
        import ctypes, json
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        L, buf = ctypes.c_long, ctypes.create_string_buffer(64)
        NR = {syscalls.filter_files()[1]["probes"]["keyctl"]}
        session = libc.syscall(L(NR), L(0), L(-3), L(0))
        read = libc.syscall(L(NR), L(11), L({max(key, 1)}), buf, L(64))
        print(json.dumps({{"session": session, "read": read, "errno": ctypes.get_errno(),
                          "data": buf.value.decode(errors="replace")}}))
    """)
    try:
        out = subprocess.run(jail.launcher_argv([jail.interpreter(), "-S", "-c", probe],
                                                cgroup_procs=(), uid=None),
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout.strip().splitlines()[-1])
        if key >= 0:
            ours, _ = _keyctl(0, -3, 0)
            assert got["session"] >= 0 and got["session"] != ours
            assert got["read"] < 0 and "sk-secret" not in got["data"]
        else:  # this host closes the keyrings to every process (its own seccomp profile)
            assert refused in (errno.EPERM, errno.ENOSYS) and got["session"] < 0
        box = Sandbox(1)
        try:
            result = box.run(probe, timeout_s=20.0)
        finally:
            box.close()
        jailed = json.loads(result.stdout.strip().splitlines()[-1])
        assert jailed["session"] < 0 and jailed["read"] < 0
        assert jailed["errno"] == errno.EPERM
    finally:
        if key >= 0:
            _keyctl(3, key, 0)  # KEYCTL_REVOKE: leave no key behind


WORKLOAD = """
import asyncio, hashlib, json, mmap, multiprocessing, os, random, select, signal, socket
import sqlite3, subprocess, sys, tempfile, threading, time, zlib
out = {}
t = threading.Thread(target=lambda: out.__setitem__("thread", sum(range(1000))))
t.start(); t.join()
with multiprocessing.get_context("fork").Pool(2) as pool:
    out["pool"] = pool.map(abs, [-1, -2, -3])
out["subprocess"] = subprocess.run([sys.executable, "-c", "print(6 * 7)"],
                                   capture_output=True, text=True).stdout.strip()
async def echo():
    async def handle(r, w):
        w.write(await r.readline()); await w.drain(); w.close()
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    r, w = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
    w.write(b"ping\\n"); await w.drain()
    line = await r.readline(); w.close(); server.close()
    return line.decode().strip()
out["asyncio"] = asyncio.run(echo())
with tempfile.NamedTemporaryFile() as f:
    f.write(b"x" * 4096); f.flush()
    with mmap.mmap(f.fileno(), 4096) as m:
        out["mmap"] = m[:1].decode()
db = sqlite3.connect(":memory:")
db.execute("create table t (x)")
db.execute("insert into t values (1)")
out["sqlite"] = db.execute("select sum(x) from t").fetchone()[0]
a, b = socket.socketpair()
a.send(b"z")
select.select([b], [], [], 1)
out["socketpair"] = b.recv(1).decode()
signal.signal(signal.SIGALRM, lambda *_: out.__setitem__("alarm", True))
signal.setitimer(signal.ITIMER_REAL, 0.01)
time.sleep(0.1)
out["hash"] = hashlib.sha256(zlib.compress(b"abc")).hexdigest()[:8]
out["random"] = len(os.urandom(8)) + random.randint(0, 0)
print(json.dumps(out))
"""


def test_real_workloads_run_under_the_filter():
    """Threads, a fork pool, a subprocess, asyncio on loopback, mmap, sqlite, select, timers:
    what a scorer's programs use runs under the filter as without it."""
    results = {}
    for level in ("full", "none"):
        box = Sandbox(1, isolation=level)
        try:
            r = box.run(WORKLOAD, timeout_s=60.0)
        finally:
            box.close()
        assert r.status == "ok", (level, r.stderr[-2000:])
        results[level] = json.loads(r.stdout.strip().splitlines()[-1])
    assert results["full"] == results["none"]
    assert results["full"]["subprocess"] == "42" and results["full"]["asyncio"] == "ping"
    assert results["full"]["pool"] == [1, 2, 3] and results["full"]["alarm"] is True
