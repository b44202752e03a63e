"""Hostile programs against the default ("full") sandbox: nothing of the host readable or
writable, nothing of the job left behind, limits over the whole job, no reward hack, and a
sandbox that refuses to run rather than run with less isolation than asked for.

Every attack here is one an attacker ran against the previous sandbox (a Python-level guard
over a plain child) and that got through; each is judged from the host side where it can be.
`check.py`'s attacks run too, against "full" (all hold) and "none" (they must be caught:
the attacks are real, not vacuous)."""

import _io  # noqa: F401  (the attacks below use the raw io layer the old guard missed)
import asyncio
import contextlib
import itertools
import json
import os
import secrets
import socket
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

from jax_routeweaver.rewards import reward as reward_module
from jax_routeweaver.rewards.feedback import EXECUTOR_ROLE, execution_verdict
from jax_routeweaver.rewards.sandbox import (
    IsolationUnavailable,
    Sandbox,
    SandboxError,
    check,
    jail,
    runner,
)
from jax_routeweaver.rewards.sandbox import cgroup as cgroup_module
from jax_routeweaver.rewards.scorers import code
from jax_routeweaver.rewards.scorers.registry import score

pytestmark = pytest.mark.integration

SECRET = "sk-secret-test"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sb():
    box = Sandbox(2)
    yield box
    box.close()


@pytest.fixture
def host_dir():
    """A world-enterable host directory with a world-readable file (as a data file would
    be), removed afterwards."""
    d = Path(f"/tmp/rw-host-{secrets.token_hex(4)}")
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    (d / "sub").mkdir(mode=0o755)
    (d / "expected.txt").write_text(f"{SECRET}\n")
    (d / "expected.txt").chmod(0o644)
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=False)


def _run(sb, program: str, **kwargs):
    return sb.run(textwrap.dedent(program), **kwargs)


# ------------------------------------------------------------------------------ host harmed
def test_cleanup_never_acts_outside_the_job(sb, host_dir):
    """The job renames its working directory and leaves a link to a host tree in its place:
    the host tree's modes stay as they were (the old clean-up chmod-ed it 0700)."""
    r = _run(sb, f"""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)  # the system calls, past any Python wrapper
        cwd = os.getcwd().encode()
        print(libc.rename(cwd, cwd + b"-moved"), libc.symlink({str(host_dir).encode()!r}, cwd),
              libc.symlink({str(host_dir).encode()!r}, b"link"))
    """)
    assert r.ok, r.stderr
    assert host_dir.stat().st_mode & 0o777 == 0o755
    assert (host_dir / "sub").stat().st_mode & 0o777 == 0o755
    assert sorted(p.name for p in host_dir.iterdir()) == ["expected.txt", "sub"]


# ------------------------------------------------------------------------------ reward hack
def test_hidden_test_data_cannot_be_read(sb, host_dir):
    """The program knows where the graded data lies and searches the file system for it: the
    stdin scorer must still score it wrong."""
    program = textwrap.dedent(f"""
        import os
        try:
            print(open({str(host_dir / 'expected.txt')!r}).read(), end="")
        except OSError:
            for root, _dirs, files in os.walk("/"):
                for name in files:
                    if name == "expected.txt":
                        print(open(os.path.join(root, name)).read(), end="")
    """)
    result = score("stdin", f"```python\n{program}\n```", [],
                   {"tests": [{"input": "", "output": SECRET}]})
    assert not result.correct, result.detail


@pytest.mark.parametrize("target", ["/etc/passwd", "/etc/hostname", str(REPO / ".git/config"),
                                    str(REPO / "tests" / "conftest.py"), str(REPO)])
def test_host_files_are_not_readable(sb, target):
    r = _run(sb, f"""
        import os
        path = {target!r}
        try:
            print(os.listdir(path) if os.path.isdir(path) else open(path, "rb").read(64))
        except OSError as e:
            print("denied", type(e).__name__)
    """)
    assert r.ok and r.stdout.startswith("denied"), r.stdout


def test_no_host_process_is_visible(sb):
    """Only the job's own processes exist in its /proc (no host cmdline, no host environ)."""
    r = _run(sb, f"""
        import os
        pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
        print(pids)
        try:
            print(open("/proc/{os.getpid()}/cmdline", "rb").read())
        except OSError:
            print("absent")
    """)
    pids, mine = r.stdout.splitlines()
    assert len(eval(pids)) <= 3 and mine == "absent"


def test_calc_feedback_cannot_carry_a_host_file_to_the_router(host_dir):
    reply = f"```python\nprint(open({str(host_dir / 'expected.txt')!r}).read())\n```"
    verdict = execution_verdict(reply, role=EXECUTOR_ROLE, scorer_dataset="math", meta={})
    assert verdict is not None and verdict.startswith("[calc] the program errored")
    assert SECRET not in verdict


# ------------------------------------------------------------------------------ writes
def test_writes_end_with_the_job(sb):
    marker = f"rw-attack-{secrets.token_hex(4)}"
    r = _run(sb, f"""
        import _io
        written = 0
        for path in ("/tmp/{marker}", "/dev/shm/{marker}"):
            with _io.FileIO(path, "w") as f:
                written += f.write(b"x")
        flood = 0
        try:
            with _io.FileIO("/tmp/{marker}-flood", "w") as f:
                for _ in range(128):
                    flood += f.write(b"x" * (1 << 20))
        except OSError as e:
            print(type(e).__name__)
        print(written, flood >> 20)
    """, memory_mb=512)
    assert r.ok, r.stderr
    assert r.stdout.split()[-2:][0] == "2"  # the writes worked inside the jail ...
    assert int(r.stdout.split()[-1]) <= 64  # ... the flood stopped at the scratch size ...
    for left in (f"/tmp/{marker}", f"/dev/shm/{marker}", f"/tmp/{marker}-flood"):
        assert not os.path.lexists(left)  # ... and nothing reached the host


def test_the_interpreter_and_the_jail_root_are_read_only(sb):
    r = _run(sb, f"""
        import os
        for path in ({jail.interpreter()!r} + "-x", "/made-at-root", "/usr/lib/x"):
            try:
                open(path, "w")
                print("wrote", path)
            except OSError as e:
                print(type(e).__name__)
    """)
    assert "wrote" not in r.stdout and r.stdout.count("Error") == 3, r.stdout


# ------------------------------------------------------------------------------ whole-job limits
def test_memory_limit_bounds_the_process_tree(sb):
    """Six forks of 120 MiB under memory_mb=256: at most two can hold their block at once
    (the old per-process limit let all six, ~780 MiB, through)."""
    r = _run(sb, """
        import os, time
        r, w = os.pipe()
        for _ in range(6):
            if os.fork() == 0:
                block = bytearray(120 << 20)
                block[::4096] = b"x" * len(block[::4096])
                os.write(w, b"k")
                time.sleep(30)
                os._exit(0)
        time.sleep(2)
        os.set_blocking(r, False)
        try:
            print(len(os.read(r, 64)))
        except BlockingIOError:
            print(0)
    """, memory_mb=256, timeout_s=10)
    assert r.status in ("ok", "memory"), r.stderr
    if r.status == "ok":
        assert int(r.stdout.split()[-1]) <= 2


def test_memfds_count_against_the_job(sb):
    """memfds of 8 MiB each (under the file-size limit) up to 192 MiB under memory_mb=128."""
    r = _run(sb, """
        import os
        held = 0
        chunk = b"x" * (8 << 20)
        for _ in range(24):
            held += os.write(os.memfd_create("m"), chunk)
        print(held >> 20)
    """, memory_mb=128)
    assert r.status in ("memory", "error", "killed") or int(r.stdout.split()[-1]) < 128


def test_code_scorer_jobs_fit_the_memory_budget():
    """4 jobs asking 256 MiB under a 300 MiB budget run one at a time; a job asking more than
    the budget gets the budget."""
    box = Sandbox(4, memory_budget_mb=300)
    prog = ("import time\nprint(time.time(), flush=True)\ntime.sleep(0.3)\n"
            "print(time.time(), flush=True)")
    try:
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda _: box.run(prog, memory_mb=256), range(4)))
        spans = sorted(tuple(map(float, r.stdout.split())) for r in results)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
        big = box.run("x = bytearray(400 << 20)\nprint('ok')", memory_mb=1 << 20)
        assert big.status == "memory"
    finally:
        box.close()
    default = Sandbox(1)
    assert default.memory.total_mb <= runner.memory_available_mb() // 2
    default.close()


# ------------------------------------------------------------------------------ side channels
def test_host_unix_socket_in_tmp_is_unreachable(sb):
    path = f"/tmp/rw-attack-{secrets.token_hex(4)}.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    os.chmod(path, 0o777)
    server.listen()
    server.setblocking(False)
    try:
        r = _run(sb, f"""
            import socket
            raw = [c for c in type.mro(socket.socket) if c.__module__ == "_socket"][0]
            s = raw(socket.AF_UNIX, socket.SOCK_STREAM)  # the C type, past any wrapper
            try:
                s.connect({path!r})
                print("connected")
            except OSError as e:
                print(type(e).__name__)
        """)
        assert "connected" not in r.stdout
        with pytest.raises(BlockingIOError):
            server.accept()
    finally:
        server.close()
        os.unlink(path)


def test_the_job_is_not_root_on_the_host(sb):
    """Seen from the host, the job's processes run under an unprivileged uid (a host uid 0,
    even without capabilities, may write /proc/sys: the kernel checks the uid alone there)."""
    import threading
    marker = f"rwj{secrets.token_hex(4)}"
    seen: list[int] = []

    def watch():
        deadline = time.monotonic() + 8
        while not seen and time.monotonic() < deadline:
            for entry in os.listdir("/proc"):
                try:
                    if entry.isdigit() and Path(f"/proc/{entry}/comm").read_text().strip() \
                            == marker:
                        status = Path(f"/proc/{entry}/status").read_text()
                        seen.append(int(status.split("Uid:")[1].split()[1]))  # effective
                except (OSError, IndexError):
                    pass
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    r = _run(sb, f"""
        import ctypes, time
        ctypes.CDLL(None).prctl(15, {marker.encode()!r})
        try:
            open("/proc/sys/kernel/core_pattern", "r+").close()
            print("sysctl writable")
        except OSError as e:
            print("sysctl", e.errno)
        time.sleep(1.5)
    """)
    watcher.join()
    assert r.stdout.strip() == "sysctl 13", r.stdout
    assert seen and seen[0] != 0


def test_no_user_namespace_inside_the_job(sb):
    r = _run(sb, """
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        print(libc.unshare(0x10000000), libc.unshare(0x00020000))  # NEWUSER, NEWNS
    """)
    assert r.stdout.split() == ["-1", "-1"]


# ------------------------------------------------------------------------------ check.py
def test_every_guarantee_holds_under_full(sb):
    outcomes = check.check(sb)
    report, ok = check.format_report(sb, outcomes)
    assert ok, report
    assert [o.name for o in outcomes] == list(check.GUARANTEES)
    assert all(o.holds for o in outcomes), report


def test_a_killed_jobs_daemon_is_gone_when_run_returns():
    """Without a cgroup ("namespaces"), a job killed at its timeout ends when the jail's
    init has torn its PID namespace down, not when bubblewrap is reaped: a daemon it left
    is gone by the time `run` returns. (Without `wait_jail_gone` most such jobs left their
    daemons alive for a moment.)"""
    box = Sandbox(2, isolation="namespaces")
    program = textwrap.dedent("""
        import ctypes, os, signal, time
        for _ in range(16):  # many to kill: the namespace's teardown takes a while
            if os.fork() == 0:
                os.setsid()
                if os.fork() == 0:
                    signal.signal(signal.SIGTERM, signal.SIG_IGN)
                    ctypes.CDLL(None).prctl(15, MARKER)  # PR_SET_NAME
                    time.sleep(120)
                os._exit(0)
        time.sleep(30)
    """)

    async def job() -> list[int]:
        marker = f"rwd{secrets.token_hex(4)}"
        result = await box.arun(program.replace("MARKER", repr(marker.encode())),
                                timeout_s=0.5)
        assert result.status == "timeout"
        return check._processes_with(marker)

    try:
        left = [pids for pids in (asyncio.run(job()) for _ in range(6)) if pids]
    finally:
        box.close()
    for pids in left:
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, 9)
    assert not left, left


def test_the_attacks_break_an_unisolated_child():
    """Without isolation each attack but the environment one succeeds: the checks can fail."""
    box = Sandbox(2, isolation="none")
    try:
        outcomes = {o.name: o for o in check.check(box)}
        report, ok = check.format_report(box, list(outcomes.values()))
    finally:
        box.close()
    assert ok, report  # "none" promises only a clean environment ...
    broken = {name for name, o in outcomes.items() if not o.holds}
    assert broken == set(check.GUARANTEES) - {"env_clean"}, report  # ... and it keeps to that


# ------------------------------------------------------------------------------ fail closed
def test_missing_bwrap_refuses_to_run(monkeypatch):
    monkeypatch.setattr(jail, "find_bwrap", lambda: None)
    box = Sandbox(1)
    with pytest.raises(IsolationUnavailable, match="bubblewrap .* not installed"):
        box.run("print(1)")
    box.close()


def test_missing_cgroups_refuse_full_but_not_namespaces(monkeypatch):
    def no_cgroups():
        raise cgroup_module.CgroupUnavailable("no memory controller (test)")

    monkeypatch.setattr(runner, "JobCgroups", no_cgroups)
    box = Sandbox(1)
    with pytest.raises(IsolationUnavailable, match="'full'.*no memory controller"):
        box.run("print(1)")
    monkeypatch.setenv("ROUTEWEAVER_SANDBOX", "namespaces")
    weaker = Sandbox(1)
    try:
        assert weaker.run("print(1)").stdout == "1\n"
        assert weaker.isolation.level == "namespaces" and not weaker.isolation.whole_job_limits
    finally:
        weaker.close()
        box.close()


def test_unknown_level_is_an_error(monkeypatch):
    with pytest.raises(SandboxError, match="isolation='strict'"):
        Sandbox(1, isolation="strict")
    monkeypatch.setenv("ROUTEWEAVER_SANDBOX", "loose")
    with pytest.raises(SandboxError, match="ROUTEWEAVER_SANDBOX='loose'"):
        Sandbox(1)


def test_unavailable_isolation_ends_grading_instead_of_marking_rows_infra():
    def scorer(*args):
        raise IsolationUnavailable("sandbox: isolation 'full' is not available (test)")

    traj = types.SimpleNamespace(record=types.SimpleNamespace(
        scorer_dataset="stdin", gold=(), meta={"tests": []}))
    with pytest.raises(IsolationUnavailable):
        reward_module._call_scorer(scorer, traj, "print(1)")
    result, error = reward_module._call_scorer(
        lambda *a: (_ for _ in ()).throw(SandboxError("flaky")), traj, "print(1)")
    assert result is None and "flaky" in error


def test_the_harness_is_a_real_module_file():
    argv = jail.bwrap_argv("bwrap", {}, ["{}"], seccomp_fd=7)
    assert "-c" not in argv and argv[-2] == jail.HARNESS
    assert argv[argv.index("--seccomp") + 1] == "7"  # the filter, before the harness runs
    assert f"{jail._CHILD_SOURCE}" in argv and jail._CHILD_SOURCE.is_file()
    # the launcher's staging tmpfs never hides a path the jail binds (a checkout under /tmp)
    assert not any(jail._within(p, jail.stage_dir()) for p in jail.readable_paths())


# ------------------------------------------------------------------------------ scored wrong
ATTACKS = {
    "fork_bomb": "import os\nwhile True:\n    os.fork()",
    "infinite_loop": "while True:\n    pass",
    "memory_hog": "x = bytearray(64 << 30)\nprint('ok')",
    "socket": "import socket\nsocket.create_connection(('127.0.0.1', 9))\nprint('ok')",
    "write_outside": "import _io\n_io.FileIO('/tmp/routeweaver-attack.txt', 'w').write(b'x')\n"
                     "print('ok')",
    "env_secret": "import os\nprint(os.environ.get('OPENROUTER_API_KEY', 'none'))",
    "kill_parent": "import os\nos.kill(os.getppid(), 9)\nprint('ok')",
    "fake_setup_failure": "import os\nos.write(2, b'setup failed')\nos._exit(97)",
    "forged_results": ("import os\nfor fd in range(64):\n    try:\n"
                       "        os.write(fd, b'{\"i\": 0, \"status\": \"ok\", \"value\": 1}\\n')\n"
                       "    except OSError:\n        pass\nos._exit(0)"),
}


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_attacks_are_scored_wrong(name, monkeypatch):
    monkeypatch.setattr(code, "PER_TEST_TIMEOUT_S", 1.0)
    monkeypatch.setattr(code, "MEMORY_MB", 256)
    monkeypatch.setenv("OPENROUTER_API_KEY", SECRET)
    program = f"```python\n{ATTACKS[name]}\n```"
    t0 = time.monotonic()
    stdin = score("stdin", program, [], {"tests": [{"input": "", "output": SECRET}]})
    apps = score("apps_functional", program + "\ndef f():\n    return 1\n", [],
                 {"func_name": "f", "tests": [{"input": [], "output": 2}]})
    assert not stdin.correct and not apps.correct
    assert time.monotonic() - t0 < 10
    assert not os.path.exists("/tmp/routeweaver-attack.txt")


def test_secrets_stay_out_of_a_separate_parent_process():
    """A parent process holding an API key from its start: the job sees neither its
    environment nor the key (the jail's /proc has only the job's own processes)."""
    parent = textwrap.dedent("""
        import json, sys
        from jax_routeweaver.rewards.sandbox import Sandbox
        box = Sandbox(1)
        r = box.run(sys.argv[1], timeout_s=5)
        print(json.dumps({"status": r.status, "out": r.stdout + r.stderr}))
    """)
    program = ("import os\nfor pid in [p for p in os.listdir('/proc') if p.isdigit()]:\n"
               "    for f in ('environ', 'cmdline'):\n        try:\n"
               "            print(open(f'/proc/{pid}/{f}', 'rb').read())\n"
               "        except OSError:\n            pass\nprint(dict(os.environ))")
    proc = subprocess.run([sys.executable, "-c", parent, program],
                          env=dict(os.environ, OPENROUTER_API_KEY=SECRET), capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["status"] == "ok" and SECRET not in result["out"]
