"""Hostile programs: each is contained, scored wrong, leaves the host unharmed, and ends in
seconds. Each attack comes in the naive form (stopped by the guard) and, where this host has
the kernel layer (`Sandbox.isolation`), in a form that bypasses the guard with ctypes."""

import hashlib
import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from jax_routeweaver.rewards import sandbox
from jax_routeweaver.rewards.sandbox import Sandbox
from jax_routeweaver.rewards.scorers import code
from jax_routeweaver.rewards.scorers.registry import score

pytestmark = pytest.mark.integration

SECRET = "sk-secret-test"


@pytest.fixture(scope="module")
def sb():
    box = Sandbox(2)
    yield box
    box.close()


def needs(sb, what):
    if not getattr(sb.isolation, what):
        pytest.skip(f"this host does not allow the kernel layer {what!r}: {sb.isolation}")


def _live_processes(uid: int) -> list[int]:
    """Processes of `uid` that still run (killed ones linger as zombies until init reaps)."""
    pids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
                if int(fields["Uid"].split()[0]) == uid and fields["State"].split()[0] != "Z":
                    pids.append(int(pid))
            except (OSError, ValueError, KeyError):
                pass
    return pids


def _process_count() -> int:
    """Live processes on the host (zombies excluded)."""
    count = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    count += f.read().rsplit(")", 1)[1].split()[0] != "Z"
            except (OSError, IndexError):
                pass
    return count


# ------------------------------------------------------------------------------ fork bombs
def test_fork_bomb_naive(sb):
    before = _process_count()
    r = sb.run("import os\nwhile True:\n    os.fork()", timeout_s=3)
    assert r.status == "error" and "PermissionError" in r.stderr
    r = sb.run("import subprocess\nsubprocess.Popen(['sleep', '100'])", timeout_s=3)
    assert r.status == "error" and "PermissionError" in r.stderr
    assert _process_count() <= before + 5


def test_fork_bomb_bypassing_the_guard(sb):
    needs(sb, "uid_drop")
    before = _process_count()
    prog = textwrap.dedent("""
        import ctypes, os, time
        libc = ctypes.CDLL(None, use_errno=True)
        print(os.getuid(), flush=True)
        made, end = 0, time.time() + 1.0
        while time.time() < end:
            pid = libc.fork()
            if pid == 0:
                libc.setsid()  # leave the process group, too
                time.sleep(60)
                os._exit(0)
            made += pid > 0
        print("forked", made, flush=True)
        time.sleep(60)
    """)
    t0 = time.monotonic()
    r = sb.run(prog, timeout_s=2.5)
    assert r.status == "timeout" and time.monotonic() - t0 < 8
    uid_line, forked = r.stdout.splitlines()
    assert int(forked.split()[1]) < sb.nproc  # RLIMIT_NPROC held
    deadline = time.monotonic() + 2.0  # SIGKILL is asynchronous: allow the exits to land
    while _live_processes(int(uid_line)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _live_processes(int(uid_line)) == []  # every fork is gone, setsid or not
    assert _process_count() <= before + 5


@pytest.mark.parametrize("killer", ["setpriv", "interpreter"])
def test_kill_uid_kills_the_uid_only(sb, monkeypatch, killer):
    """What runs after every job: every process of the job's uid dies, others' live on."""
    needs(sb, "uid_drop")
    if killer == "interpreter":  # a host without util-linux's setpriv
        monkeypatch.setattr(sandbox, "_killer_tools", lambda: (None, None))
    elif sandbox._killer_tools()[0] is None:
        pytest.skip("no setpriv on this host")
    uid, other = (sandbox._fresh_uid(*sandbox._uid_range()) for _ in range(2))
    procs = [subprocess.Popen(["sleep", "60"], user=u, group=u, extra_groups=[],
                              start_new_session=True) for u in (uid, uid, other)]
    try:
        sandbox._kill_uid(uid)
        assert [p.wait(timeout=5) for p in procs[:2]] == [-9, -9]
        assert procs[2].poll() is None  # another uid's process is untouched
    finally:
        for p in procs:
            p.kill()
            p.wait()


# ------------------------------------------------------------------------------ time, memory
def test_infinite_loop(sb):
    t0 = time.monotonic()
    r = sb.run("while True:\n    pass", timeout_s=1.5)
    assert r.status == "timeout" and time.monotonic() - t0 < 5


def test_cpu_limit_backs_up_the_wall_clock(sb):
    # A child that outlives its CPU budget is killed by the kernel (SIGXCPU) even if the wall
    # clock allowed more: `timeout_s` sets RLIMIT_CPU to ceil(timeout_s) + 1 seconds.
    r = sb.run("import signal, time\nsignal.signal(signal.SIGXCPU, signal.SIG_DFL)\n"
               "t = time.process_time()\nwhile time.process_time() - t < 30:\n    pass",
               timeout_s=1.0)
    assert r.status == "timeout"


def test_memory_hog(sb):
    t0 = time.monotonic()
    r = sb.run("x = bytearray(64 << 30)", memory_mb=256)
    assert r.status == "memory"
    r = sb.run("import numpy\nx = numpy.ones((1 << 16, 1 << 16))", memory_mb=512)
    assert r.status == "memory"
    assert time.monotonic() - t0 < 8


def test_huge_file_is_capped(sb):
    r = sb.run("with open('big', 'wb') as f:\n    f.write(b'x' * (64 << 20))", timeout_s=5)
    assert r.status == "error" and "File too large" in r.stderr  # RLIMIT_FSIZE 16 MiB


# ------------------------------------------------------------------------------ network
@pytest.fixture()
def listener():
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    yield server
    server.close()


def _nothing_connected(server) -> bool:
    try:
        conn, _ = server.accept()
    except BlockingIOError:
        return True
    conn.close()
    return False


def test_socket_naive(sb, listener):
    port = listener.getsockname()[1]
    r = sb.run(f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
               "print('CONNECTED')", timeout_s=5)
    assert r.status == "error" and "CONNECTED" not in r.stdout
    r = sb.run(f"import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))\n"
               "print('CONNECTED')", timeout_s=5)
    assert r.status == "error" and "CONNECTED" not in r.stdout
    time.sleep(0.1)
    assert _nothing_connected(listener)


def test_socket_bypassing_the_guard(sb, listener):
    needs(sb, "netns")
    port = listener.getsockname()[1]
    prog = textwrap.dedent(f"""
        import ctypes, socket, struct
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.socket(2, 1, 0)
        addr = struct.pack("<HH4s8x", 2, socket.htons({port}), socket.inet_aton("127.0.0.1"))
        rc = libc.connect(fd, addr, 16)
        print("CONNECTED" if rc == 0 else "refused", ctypes.get_errno())
    """)
    r = sb.run(prog, timeout_s=5)
    assert r.status == "ok" and r.stdout.startswith("refused")
    time.sleep(0.1)
    assert _nothing_connected(listener)


# ------------------------------------------------------------------------------ filesystem
@pytest.fixture()
def victim(tmp_path):
    path = tmp_path / "victim.txt"
    path.write_text("original")
    return path


def test_write_outside_naive(sb, victim, tmp_path):
    fresh = tmp_path / "new.txt"
    prog = textwrap.dedent(f"""
        import os, shutil, pathlib
        attempts = [
            lambda: open({str(victim)!r}, "w").write("pwned"),
            lambda: open({str(fresh)!r}, "x"),
            lambda: pathlib.Path({str(victim)!r}).write_text("pwned"),
            lambda: os.open({str(fresh)!r}, os.O_CREAT | os.O_WRONLY),
            lambda: os.remove({str(victim)!r}),
            lambda: os.rename({str(victim)!r}, "here.txt"),
            lambda: shutil.rmtree({str(tmp_path)!r}),
            lambda: os.symlink({str(victim)!r}, "link") or open("link", "w").write("pwned"),
        ]
        for attempt in attempts:
            try:
                attempt()
                print("DONE")
            except PermissionError as e:
                print("denied")
    """)
    r = sb.run(prog)
    assert r.status == "ok" and "DONE" not in r.stdout, r.stdout
    assert victim.read_text() == "original" and not fresh.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["victim.txt"]


def test_write_outside_bypassing_the_guard(sb, victim, tmp_path):
    needs(sb, "uid_drop")
    fresh = tmp_path / "new.txt"
    prog = textwrap.dedent(f"""
        import _io, ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        for path in ({str(victim)!r}, {str(fresh)!r}):
            try:
                _io.FileIO(path, "w").write(b"pwned")
                print("DONE")
            except OSError as e:
                print("denied", e.errno)
            fd = libc.open(path.encode(), 0o1101, 0o644)  # O_WRONLY | O_CREAT | O_TRUNC
            print("DONE" if fd >= 0 else "denied")
    """)
    r = sb.run(prog)
    assert r.status == "ok" and "DONE" not in r.stdout, r.stdout
    assert victim.read_text() == "original" and not fresh.exists()


# ------------------------------------------------------------------------------ parent process
_PARENT = textwrap.dedent("""
    import hashlib, json, os, sys
    from jax_routeweaver.rewards.sandbox import Sandbox
    box = Sandbox(1)
    r = box.run(sys.argv[1], timeout_s=5)
    key = os.environ.get("OPENROUTER_API_KEY", "").encode()
    print(json.dumps({"status": r.status, "stdout": r.stdout, "stderr": r.stderr,
                      "parent_has_key": hashlib.sha256(key).hexdigest() == sys.argv[2]}))
""")


def _via_parent(program: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    """Run `program` in a sandbox owned by a separate parent process that holds the secret in
    its environment from the start (so it is in /proc/<parent>/environ, too)."""
    env = dict(os.environ, OPENROUTER_API_KEY=SECRET)
    digest = hashlib.sha256(SECRET.encode()).hexdigest()  # the secret itself stays off argv
    proc = subprocess.run([sys.executable, "-c", _PARENT, program, digest], env=env,
                          capture_output=True, text=True, timeout=60,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    lines = proc.stdout.strip().splitlines()
    return proc, (json.loads(lines[-1]) if proc.returncode == 0 and lines else None)


def test_environment_secrets_do_not_reach_the_program(sb, monkeypatch):
    monkeypatch.setenv("OPENROUTER_API_KEY", SECRET)
    r = sb.run("import os\nprint(dict(os.environ))\ntry:\n"
               "    print(open('/proc/self/environ').read())\nexcept OSError as e:\n"
               "    print(e)")
    assert r.ok and SECRET not in r.stdout and "PATH" in r.stdout


def test_parent_environ_is_unreadable(sb):
    prog = textwrap.dedent("""
        import os
        print(dict(os.environ))
        for path in (f"/proc/{os.getppid()}/environ", f"/proc/{os.getppid()}/cmdline"):
            try:
                print(open(path, "rb").read())
            except OSError as e:
                print("denied", e.errno)
    """)
    proc, result = _via_parent(prog)
    assert result is not None, proc.stderr
    assert result["parent_has_key"]  # the parent really holds the secret
    assert SECRET not in result["stdout"] + result["stderr"]
    if sb.isolation.uid_drop:
        denied = [line for line in result["stdout"].splitlines() if line.startswith("denied ")]
        assert denied == ["denied 13"]  # environ: EACCES; cmdline (harmless) readable


def test_killing_the_parent(sb):
    proc, result = _via_parent("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)")
    assert result is not None and result["status"] == "error", proc.stderr
    assert "PermissionError" in result["stderr"]
    assert sb.run("import os\nos.killpg(1, 9)").status == "error"


def test_killing_the_parent_bypassing_the_guard(sb):
    needs(sb, "uid_drop")
    prog = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "print(libc.kill(os.getppid(), 9), ctypes.get_errno())\n"
            "print(libc.kill(1, 9), ctypes.get_errno())")
    proc, result = _via_parent(prog)
    assert proc.returncode == 0 and result is not None, proc.stderr  # the parent survived
    assert result["stdout"].split() == ["-1", "1", "-1", "1"]  # EPERM twice


# ------------------------------------------------------------------------------ scored wrong
ATTACKS = {
    "fork_bomb": "import os\nwhile True:\n    os.fork()",
    "infinite_loop": "while True:\n    pass",
    "memory_hog": "x = bytearray(64 << 30)\nprint('ok')",
    "socket": "import socket\nsocket.create_connection(('127.0.0.1', 9))\nprint('ok')",
    "write_outside": "open('/tmp/routeweaver-attack.txt', 'w').write('x')\nprint('ok')",
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
