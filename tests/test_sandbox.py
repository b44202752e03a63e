"""The sandbox runner: statuses, stdin, fresh working dirs, the environment, the function
runner, output caps, and the bounds on concurrent children and their memory (sync and async).
The hostile programs are in test_sandbox_security.py."""

import asyncio
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from jax_routeweaver.rewards.sandbox import Sandbox, SandboxError, jail

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def sb():
    box = Sandbox(2)
    yield box
    box.close()


# ------------------------------------------------------------------------------ statuses
def test_ok_with_stdin(sb):
    r = sb.run("import sys\nprint(sys.stdin.read().upper(), end='')", stdin="hello\nworld\n")
    assert r.status == "ok" and r.ok and r.returncode == 0
    assert r.stdout == "HELLO\nWORLD\n"


def test_stdin_bytes_fd0_and_buffer(sb):
    assert sb.run("print(open(0).read()[::-1])", stdin="abc").stdout == "cba\n"
    r = sb.run("import sys\nprint(sys.stdin.buffer.read())", stdin=b"\x00\xff")
    assert r.stdout == "b'\\x00\\xff'\n"


def test_error_status_keeps_the_traceback(sb):
    r = sb.run("x = 1\ny = x / 0\n")
    assert r.status == "error" and r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == "ZeroDivisionError: division by zero"
    assert '"<program>", line 2' in r.stderr  # the program's own line, not the harness's


def test_syntax_error_is_an_error(sb):
    r = sb.run("def f(:\n  pass")
    assert r.status == "error" and "SyntaxError" in r.stderr


def test_timeout_status_and_wall_clock(sb):
    t0 = time.monotonic()
    r = sb.run("while True:\n    pass", timeout_s=1.0)
    assert r.status == "timeout"
    assert 0.9 <= r.wall_s < 2.0 and time.monotonic() - t0 < 4.0


def test_sleeping_program_times_out_on_wall_clock(sb):
    r = sb.run("import time\ntime.sleep(30)", timeout_s=0.5)
    assert r.status == "timeout" and r.wall_s < 1.5


def test_memory_status(sb):
    r = sb.run("blocks = []\nwhile True:\n    blocks.append(bytearray(50 << 20))", memory_mb=256)
    assert r.status == "memory" and "MemoryError" in r.stderr
    assert sb.run("x = bytearray(200 << 20)\nprint(len(x))", memory_mb=512).stdout == \
        f"{200 << 20}\n"


def test_killed_status(sb):
    r = sb.run("import os, signal\nprint('before', flush=True)\nos.kill(os.getpid(), 9)")
    assert r.status == "killed" and r.returncode == -9 and r.stdout == "before\n"


def test_system_exit(sb):
    assert sb.run("import sys\nprint(1)\nsys.exit(3)").returncode == 3
    assert sb.run("import sys\nprint(1)\nsys.exit(3)").status == "error"
    swallowed = sb.run("import sys\nprint(1)\nsys.exit(3)", swallow_exit=True)
    assert swallowed.status == "ok" and swallowed.stdout == "1\n"


def test_output_cap_kills_and_truncates(sb):
    r = sb.run("while True:\n    print('x' * 1000)", max_output_bytes=10_000, timeout_s=5)
    assert r.status == "killed" and r.truncated and len(r.stdout) <= 10_000
    assert r.wall_s < 3


def test_stderr_keeps_the_tail(sb):
    r = sb.run("import sys\nfor i in range(200000):\n    print(i, file=sys.stderr)\n"
               "raise ValueError('the end')")
    assert r.status == "error" and r.stderr.rstrip().endswith("ValueError: the end")
    assert len(r.stderr) <= 8000


# ------------------------------------------------------------------------------ environment
def test_fresh_working_dir_each_job(sb):
    prog = ("import os\nprint(os.getcwd())\nprint(sorted(os.listdir('.')))\n"
            "open('made.txt', 'w').write('x')\nos.mkdir('sub')\nopen('sub/f', 'w').write('y')")
    first, second = sb.run(prog), sb.run(prog)
    assert first.ok and second.ok
    cwd1, listing1 = first.stdout.splitlines()
    cwd2, listing2 = second.stdout.splitlines()
    assert listing1 == listing2 == "[]"  # nothing left over from the first job
    assert cwd1 == cwd2 == "/sandbox"  # the jail's own tmpfs: no directory of the host


def test_none_level_removes_its_dir_without_following_links(tmp_path):
    """The unisolated level works in a host temp dir: removed afterwards, and a job that
    swaps it for a link to another tree does not get that tree touched."""
    victim = tmp_path / "victim"
    (victim / "sub").mkdir(parents=True)
    (victim / "sub").chmod(0o755)
    box = Sandbox(1, isolation="none", tmp_root=str(tmp_path))
    try:
        r = box.run(f"import os\ncwd = os.getcwd()\nprint(cwd)\nos.chdir('/')\n"
                    f"os.rename(cwd, cwd + '-moved')\nos.symlink({str(victim)!r}, cwd)")
        assert r.ok, r.stderr
        cwd = r.stdout.strip()
        assert os.path.dirname(os.path.dirname(cwd)) == str(tmp_path)
        assert os.listdir(tmp_path) == ["victim"]  # the job's dir, its link and its move: gone
        assert (victim / "sub").stat().st_mode & 0o777 == 0o755
    finally:
        box.close()


def test_environment_is_minimal_and_hash_seed_fixed(sb, monkeypatch):
    monkeypatch.setenv("ROUTEWEAVER_TEST_VAR", "leak")
    prog = "import os, json\nprint(json.dumps(dict(os.environ)))\nprint(hash('routeweaver'))"
    r1, r2 = sb.run(prog), sb.run(prog)
    env = json.loads(r1.stdout.splitlines()[0])
    assert "ROUTEWEAVER_TEST_VAR" not in env and "leak" not in r1.stdout
    assert set(env) <= {"PATH", "HOME", "TMPDIR", "LANG", "LC_ALL", "PYTHONHASHSEED",
                        "PYTHONIOENCODING", "PYTHONDONTWRITEBYTECODE", "OMP_NUM_THREADS",
                        "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "LC_CTYPE", "PWD"}
    assert env["PYTHONHASHSEED"] == "0"
    assert r1.stdout.splitlines()[1] == r2.stdout.splitlines()[1]  # deterministic str hash


def test_isolation_report_matches_the_child(sb):
    iso = sb.isolation
    assert iso.level == "full" and iso.jailed and iso.whole_job_limits and iso.cgroup in (1, 2)
    r = sb.run("import os, socket\nprint(os.getuid())\n"
               "print(sorted(n for _, n in socket.if_nameindex()))")
    uid, ifaces = r.stdout.splitlines()
    assert int(uid) == 65534 and ifaces == "['lo']"


def test_threads_and_deep_recursion_work(sb):
    r = sb.run("import threading\nthreading.stack_size(2**26)\n"
               "t = threading.Thread(target=lambda: print('thread'))\nt.start(); t.join()")
    assert r.stdout == "thread\n"
    r = sb.run("def f(n):\n    return 0 if n == 0 else 1 + f(n - 1)\nprint(f(50000))",
               recursion_limit=100_000)
    assert r.stdout == "50000\n"


def test_child_that_cannot_start_is_a_sandbox_error(sb, monkeypatch):
    sb.isolation  # probed with the real interpreter first  # noqa: B018
    monkeypatch.setattr(jail, "interpreter", lambda: "/bin/false")
    with pytest.raises(SandboxError, match="did not start"):
        sb.run("print(1)")


def test_program_cannot_fake_a_setup_failure(sb):
    r = sb.run("import os\nos.write(2, b'routeweaver sandbox setup failed: x\\n')\nos._exit(97)")
    assert r.status == "error" and r.returncode == 97  # a verdict, not an infra error


# ------------------------------------------------------------------------------ run_tests
def test_run_tests_each_in_a_fresh_child(sb):
    prog = "import os\nn = int(input())\nprint(n * 2, len(os.listdir('.')))\nopen('f', 'w')"
    results = sb.run_tests(prog, ["1", "2", "3"])
    assert [r.stdout for r in results] == ["2 0\n", "4 0\n", "6 0\n"]


def test_run_tests_check_stops_and_budget_ends(sb):
    results = sb.run_tests("print(int(input()))", ["1", "2", "3"],
                           check=lambda i, r: r.stdout.strip() != "2")
    assert len(results) == 2
    t0 = time.monotonic()
    results = sb.run_tests("import time\ntime.sleep(0.6)", ["a", "b", "c", "d"],
                           per_test_timeout_s=5, total_timeout_s=1.0)
    assert len(results) == 2 and results[-1].status == "timeout"
    assert time.monotonic() - t0 < 3


# ------------------------------------------------------------------------------ run_function
def test_function_values_cross_as_json(sb):
    prog = ("def f(a, b):\n    print('noise')\n    return a + b\n")
    res = sb.run_function(prog, "f", [[1, 2], [[1], [2]], [(1,), (2,)], ["a", 1]])
    assert res.load_error is None
    assert [(c.index, c.status, c.value) for c in res.calls[:3]] == [
        (0, "ok", 3), (1, "ok", [1, 2]), (2, "ok", [1, 2])]
    assert res.calls[3].status == "error" and res.calls[3].error.startswith("TypeError")


def test_function_unencodable_values(sb):
    prog = "def f(x):\n    return {x, x + 1} if x else object()\n"
    res = sb.run_function(prog, "f", [[1], [0]])
    assert res.calls[0].encoding == "list" and sorted(res.calls[0].value) == [1, 2]
    assert res.calls[1].encoding == "repr" and "object" in res.calls[1].error


def test_function_solution_class_and_styles(sb):
    prog = ("class Solution:\n    def f(self, x):\n        return x * 10\n"
            "def f(x):\n    return -x\n")
    assert sb.run_function(prog, "f", [[2]]).calls[0].value == 20  # Solution wins
    assert sb.run_function("def f(x):\n    return -x\n", "f", [[2]]).calls[0].value == -2
    lcb = sb.run_function("def f(x):\n    return -x\n", "f", [[2]], style="lcb")
    assert lcb.calls[0].status == "error" and "Solution" in lcb.calls[0].error
    pre = sb.run_function("class Solution:\n    def f(self, xs: List[int]):\n"
                          "        return list(accumulate(xs))\n", "f", [[[1, 2, 3]]],
                          style="lcb", prelude="from typing import *\n"
                                               "from itertools import accumulate\n")
    assert pre.calls[0].value == [1, 3, 6]


def test_function_load_errors(sb):
    assert sb.run_function("def f(:", "f", [[1]]).load_error.startswith("SyntaxError")
    missing = sb.run_function("def g(x):\n    return x\n", "f", [[1]])
    assert missing.calls[0].status == "error" and "'f' is not defined" in missing.calls[0].error
    slow = sb.run_function("import time\ntime.sleep(20)\ndef f(x):\n    return x\n", "f",
                           [[1]], per_test_timeout_s=0.5)
    assert slow.load_error is not None and "timed out" in slow.load_error


def test_function_per_call_timeout_continues_or_stops(sb):
    prog = "def f(x):\n    while x:\n        pass\n    return 7\n"
    res = sb.run_function(prog, "f", [[0], [1], [0]], per_test_timeout_s=0.5)
    assert [c.status for c in res.calls] == ["ok", "timeout", "ok"]
    res = sb.run_function(prog, "f", [[0], [1], [0]], per_test_timeout_s=0.5,
                          stop_on_error=True)
    assert [c.status for c in res.calls] == ["ok", "timeout"]


def test_function_ignoring_the_alarm_is_caught_by_the_watchdog(sb):
    prog = ("import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
            "def f(x):\n    while x:\n        pass\n    return 1\n")
    t0 = time.monotonic()
    res = sb.run_function(prog, "f", [[0], [1], [0]], per_test_timeout_s=0.5)
    assert [c.status for c in res.calls] == ["ok", "timeout"]
    assert time.monotonic() - t0 < 4


def test_function_check_stops_early_and_process_death(sb):
    res = sb.run_function("def f(x):\n    return x\n", "f", [[0], [1], [2]],
                          check=lambda i, c: c.value == 0)
    assert [c.value for c in res.calls] == [0, 1]
    died = sb.run_function("import os\ndef f(x):\n    os._exit(3)\n", "f", [[0], [1]])
    assert len(died.calls) == 1 and died.calls[0].status == "error"
    assert died.calls[0].error == "exit code 3"


# ------------------------------------------------------------------------------ parallelism
_TIMED = ("import time\nprint(time.time(), flush=True)\ntime.sleep(0.4)\n"
          "print(time.time(), flush=True)")


def _max_overlap(results) -> int:
    events = []
    for r in results:
        start, end = map(float, r.stdout.split())
        events += [(start, 1), (end, -1)]
    alive = peak = 0
    for _, step in sorted(events, key=lambda e: (e[0], e[1])):
        alive += step
        peak = max(peak, alive)
    return peak


def test_parallelism_bound_async():
    box = Sandbox(2)
    try:
        async def main():
            return await asyncio.gather(*(box.arun(_TIMED) for _ in range(8)))

        results = asyncio.run(main())
        assert all(r.ok for r in results)
        assert _max_overlap(results) == 2  # bounded, and the two slots are really used
    finally:
        box.close()


def test_parallelism_bound_sync_threads_and_default_size():
    box = Sandbox(2)
    try:
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda _: box.run(_TIMED), range(8)))
        assert all(r.ok for r in results) and _max_overlap(results) <= 2
    finally:
        box.close()
    assert Sandbox().max_workers == max(2, (os.cpu_count() or 2) // 2)  # 2 even on 2 cores
    with pytest.raises(ValueError, match="max_workers"):
        Sandbox(0)


def test_async_api_does_not_block_the_loop():
    box = Sandbox(1)
    ticks = []

    async def ticker():
        for _ in range(5):
            ticks.append(time.monotonic())
            await asyncio.sleep(0.05)

    async def main():
        return await asyncio.gather(box.arun("import time\ntime.sleep(0.5)\nprint('done')"),
                                    ticker())

    try:
        result, _ = asyncio.run(main())
        assert result.stdout == "done\n" and len(ticks) == 5
        assert ticks[-1] - ticks[0] < 0.45  # the ticker ran while the child slept
    finally:
        box.close()
    assert threading.active_count() < 50
