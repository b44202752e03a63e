"""`routeweaver sandbox check`: attack this host's sandbox and report which guarantees hold.

Each guarantee is tested by a hostile program run through a real `Sandbox`, judged from the
host side where it can be (the host listener saw no connection, the host file is still
absent, no process with the job's marker is alive):

    host_unreadable   no host file, directory or process beyond the interpreter is readable
    writes_vanish     what the job writes (working dir, /tmp, /dev/shm) is gone afterwards
    no_network        no TCP, UDP, path-named or abstract unix socket reaches the host
    no_privilege      no capabilities, no uid 0, no host sysctl, no new user namespace
    env_clean         no environment variable of the host (API keys) reaches the job
    leftovers_killed  a double-forked, SIGTERM-ignoring daemon does not outlive the job
    memory_whole_job  the job's processes together hold at most `memory_mb`
    tasks_whole_job   the job's processes together number at most the task limit
    syscalls_filtered the kernel's side doors (io_uring, keyrings, bpf, ptrace, mount, module
                      loading, ...) fail with EPERM, and the host sees a seccomp filter on
                      the job (`syscall_attack`)

`EXPECTED[level]` says which of them the level promises; `check()` runs them all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import socket
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

from jax_routeweaver.rewards.sandbox import syscall_attack
from jax_routeweaver.rewards.sandbox.isolation import LEVELS, Level, SandboxError
from jax_routeweaver.rewards.sandbox.runner import RunResult, Sandbox

__all__ = ["EXPECTED", "GUARANTEES", "Outcome", "check", "format_report"]

_MEMORY_MB = 256
_ALL = ("host_unreadable", "writes_vanish", "no_network", "no_privilege", "env_clean",
        "leftovers_killed", "syscalls_filtered", "memory_whole_job", "tasks_whole_job")
EXPECTED: dict[Level, tuple[str, ...]] = {
    "full": _ALL,
    "namespaces": _ALL[:7],
    "none": ("env_clean",),
}


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One guarantee on this host: `holds`, and what the attack saw (`detail`)."""

    name: str
    holds: bool
    detail: str


def _run(sb: Sandbox, program: str, **kwargs: object) -> RunResult:
    return sb.run(textwrap.dedent(program), timeout_s=kwargs.pop("timeout_s", 10.0),
                  **kwargs)  # type: ignore[arg-type]


def _last_json(result: RunResult) -> dict:
    lines = result.stdout.strip().splitlines()
    if not lines:
        raise ValueError(f"the attack printed nothing ({result.status}: "
                         f"{result.stderr.strip()[-300:]})")
    return json.loads(lines[-1])


def host_unreadable(sb: Sandbox) -> Outcome:
    """A world-readable host file, /etc/passwd, the package's source, the working dir of
    this process (a project checkout), this process's command line, and the list of host
    processes: none may be readable."""
    import jax_routeweaver
    with _world_readable_file("expected output 42\n") as secret:
        targets = [str(secret), "/etc/passwd", "/etc/hostname",
                   str(Path(jax_routeweaver.__file__).resolve()), os.getcwd(),
                   f"/proc/{os.getpid()}/cmdline"]
        result = _run(sb, f"""
            import json, os
            seen = {{}}
            for path in {targets!r}:
                try:
                    seen[path] = (os.listdir(path)[:3] if os.path.isdir(path)
                                  else open(path, "rb").read(40).decode("latin-1"))
                except OSError:
                    pass
            pids = [p for p in os.listdir("/proc") if p.isdigit()]
            print(json.dumps({{"seen": seen, "pids": len(pids)}}))
        """)
    report = _last_json(result)
    seen = {p: v for p, v in report["seen"].items() if v not in ([], "")}
    holds = not seen and report["pids"] <= 4
    return Outcome("host_unreadable", holds,
                   f"readable: {sorted(seen) or 'none'}; processes visible: {report['pids']}")


def writes_vanish(sb: Sandbox) -> Outcome:
    """Files written with the raw io layer into the working dir, /tmp and /dev/shm, and a
    128 MiB flood of /tmp: none may outlive the job, and the flood may not land on the host."""
    marker = f"rw-check-{secrets.token_hex(4)}"
    places = [f"/tmp/{marker}", f"/dev/shm/{marker}", marker]
    result = _run(sb, f"""
        import _io, json
        done = []
        for path in {places!r}:
            try:
                with _io.FileIO(path, "w") as f:
                    f.write(b"x")
                done.append(path)
            except OSError:
                pass
        flood = 0
        try:
            with _io.FileIO("/tmp/{marker}-flood", "w") as f:
                for _ in range(128):
                    flood += f.write(b"x" * (1 << 20))
        except OSError:
            pass
        print(json.dumps({{"written": done, "flood_mib": flood >> 20}}))
    """, memory_mb=_MEMORY_MB)
    report = _last_json(result)
    left = [p for p in (f"/tmp/{marker}", f"/dev/shm/{marker}", f"/tmp/{marker}-flood")
            if os.path.lexists(p)]
    for p in left:
        with contextlib.suppress(OSError):
            os.unlink(p)
    return Outcome("writes_vanish", not left,
                   f"written inside: {len(report['written'])} files, {report['flood_mib']} "
                   f"MiB of flood; left on the host: {left or 'nothing'}")


def no_network(sb: Sandbox) -> Outcome:
    """Host listeners on TCP/UDP loopback, a path-named unix socket in /tmp and an abstract
    unix socket: the job may reach none of them."""
    with _listeners() as (tcp, udp, unix_path, abstract, heard):
        result = _run(sb, f"""
            import json, socket
            # the C socket type itself, past any Python-level wrapper of socket.socket
            raw = [c for c in type.mro(socket.socket) if c.__module__ == "_socket"][0]
            reached = []
            def attempt(name, family, kind, address):
                try:
                    s = raw(family, kind)
                    s.settimeout(1.0)
                    s.connect(address)
                    s.send(b"ping")
                    reached.append(name)
                except OSError:
                    pass
            attempt("tcp", socket.AF_INET, socket.SOCK_STREAM, ("127.0.0.1", {tcp}))
            attempt("udp", socket.AF_INET, socket.SOCK_DGRAM, ("127.0.0.1", {udp}))
            attempt("unix", socket.AF_UNIX, socket.SOCK_STREAM, {unix_path!r})
            attempt("abstract", socket.AF_UNIX, socket.SOCK_STREAM, {abstract!r})
            print(json.dumps(reached))
        """)
    reached = _last_json_list(result)
    # A UDP send "succeeds" on the jail's own loopback: only the host listener can tell.
    connected = [r for r in reached if r != "udp"]
    return Outcome("no_network", not heard and not connected,
                   f"connections made: {connected or 'none'}; host listeners (tcp, udp, unix, "
                   f"abstract) heard: {sorted(heard) or 'nothing'}")


def no_privilege(sb: Sandbox) -> Outcome:
    """Capabilities, setuid(0), writable host sysctls (/proc/sys checks the host uid alone),
    a new user namespace (with full capabilities inside it)."""
    result = _run(sb, """
        import ctypes, json, os
        libc = ctypes.CDLL(None, use_errno=True)
        status = dict(l.split(":", 1) for l in open("/proc/self/status") if ":" in l)
        got = {"cap_eff": status["CapEff"].strip(), "no_new_privs": status["NoNewPrivs"].strip()}
        try:
            os.setuid(0)
        except OSError:
            pass
        got["root"] = os.geteuid() == 0
        try:  # host-wide settings that check the uid alone (opened, never written)
            open("/proc/sys/kernel/core_pattern", "r+").close()
            got["sysctl"] = True
        except OSError:
            got["sysctl"] = False
        got["userns"] = libc.unshare(0x10000000) == 0  # last: it changes our uid
        print(json.dumps(got))
    """)
    got = _last_json(result)
    holds = (int(got["cap_eff"], 16) == 0 and got["no_new_privs"] == "1"
             and not got["userns"] and not got["root"] and not got["sysctl"])
    return Outcome("no_privilege", holds,
                   f"CapEff {got['cap_eff']}, NoNewPrivs {got['no_new_privs']}, new user "
                   f"namespace {'created' if got['userns'] else 'refused'}, uid 0 "
                   f"{'held' if got['root'] else 'not held'}, host sysctls "
                   f"{'writable' if got['sysctl'] else 'read-only'}")


def env_clean(sb: Sandbox) -> Outcome:
    """A secret in this process's environment: not in the job's environment."""
    key, value = "ROUTEWEAVER_CHECK_SECRET", "sk-" + secrets.token_hex(8)
    os.environ[key] = value
    try:
        result = _run(sb, "import os\nprint(dict(os.environ))\n"
                          "print(open('/proc/self/environ', 'rb').read())")
    finally:
        del os.environ[key]
    leaked = value in result.stdout
    return Outcome("env_clean", not leaked, "the secret " + ("leaked" if leaked else
                                                             "did not reach the job"))


def leftovers_killed(sb: Sandbox) -> Outcome:
    """A daemon (double fork, new session, SIGTERM ignored) that outlives the program."""
    marker = f"rwd{secrets.token_hex(4)}"  # the daemon's process name (15 characters at most)
    _run(sb, f"""
        import ctypes, os, signal, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                ctypes.CDLL(None).prctl(15, {marker.encode()!r})  # PR_SET_NAME
                time.sleep(120)
            os._exit(0)
        time.sleep(0.2)
        print("parent done")
    """)
    alive = _processes_with(marker)
    for pid in alive:
        with contextlib.suppress(OSError):
            os.kill(pid, 9)
    return Outcome("leftovers_killed", not alive, f"processes alive after the job: "
                   f"{len(alive)}")


def memory_whole_job(sb: Sandbox) -> Outcome:
    """Under memory_mb=256: six forked children touching 120 MiB each, then memfds of up
    to 320 MiB."""
    result = _run(sb, """
        import json, os, time
        r, w = os.pipe()
        children = []
        for _ in range(6):
            pid = os.fork()
            if pid == 0:
                block = bytearray(120 << 20)
                block[::4096] = b"x" * len(block[::4096])
                os.write(w, b"k")
                time.sleep(30)
                os._exit(0)
            children.append(pid)
        time.sleep(2)
        os.set_blocking(r, False)
        try:
            held = len(os.read(r, 64))
        except BlockingIOError:
            held = 0
        for pid in children:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        memfd, chunk = 0, b"x" * (8 << 20)  # each file under the file-size limit
        try:
            for _ in range(40):
                memfd += os.write(os.memfd_create("m"), chunk)
        except (OSError, MemoryError):
            pass
        print(json.dumps({"forks_mib": held * 120, "memfd_mib": memfd >> 20}))
    """, memory_mb=_MEMORY_MB)
    try:
        got = _last_json(result)
    except ValueError:  # the whole job was ended by the OOM killer: the limit held
        return Outcome("memory_whole_job", result.status in ("memory", "killed"),
                       f"the job ended with status {result.status!r}")
    holds = got["forks_mib"] <= _MEMORY_MB and got["memfd_mib"] < _MEMORY_MB
    return Outcome("memory_whole_job", holds,
                   f"under memory_mb={_MEMORY_MB}: forks held {got['forks_mib']} MiB at once, "
                   f"memfds {got['memfd_mib']} MiB")


def tasks_whole_job(sb: Sandbox) -> Outcome:
    """Forks that sleep, as many as the kernel allows (up to 200)."""
    result = _run(sb, """
        import os, time
        n = 0
        for _ in range(200):
            try:
                if os.fork() == 0:
                    time.sleep(5)
                    os._exit(0)
            except OSError:
                break
            n += 1
        print(n)
    """)
    try:
        forks = int(result.stdout.split()[-1])
    except (ValueError, IndexError):
        return Outcome("tasks_whole_job", False, f"no count: {result.status}")
    return Outcome("tasks_whole_job", forks + 1 <= sb.nproc,
                   f"{forks} processes forked beside the program (limit {sb.nproc} tasks)")


def syscalls_filtered(sb: Sandbox) -> Outcome:
    """The calls of `syscalls.PROBES`, each with arguments that work where no filter
    refuses them, judged from inside (EPERM) and outside (the job's seccomp state)."""
    holds, detail, _ = syscall_attack.attack(lambda program: _run(sb, program).stdout,
                                             _processes_with)
    return Outcome("syscalls_filtered", holds, detail)


GUARANTEES: dict[str, Callable[[Sandbox], Outcome]] = {
    f.__name__: f for f in (host_unreadable, writes_vanish, no_network, no_privilege,
                            env_clean, leftovers_killed, syscalls_filtered, memory_whole_job,
                            tasks_whole_job)}


def check(sb: Sandbox) -> list[Outcome]:
    """Every guarantee, attacked on this host through `sb` (its isolation set up first)."""
    sb.isolation  # noqa: B018  (raises SandboxError if the level is not available)
    return [attack(sb) for attack in GUARANTEES.values()]


def levels_available() -> dict[str, str]:
    """Level -> "available" or why not, each jailed level probed with its own sandbox ("none",
    a plain child, needs nothing)."""
    out = {}
    for level in LEVELS:
        if level == "none":
            out[level] = "available"
            continue
        box = Sandbox(1, isolation=level)
        try:
            box.isolation  # noqa: B018
            out[level] = "available"
        except SandboxError as exc:
            out[level] = str(exc)
        finally:
            box.close()
    return out


def format_report(sb: Sandbox, outcomes: list[Outcome]) -> tuple[str, bool]:
    """(the report, whether every guarantee of the sandbox's level holds)."""
    iso = sb.isolation
    expected = EXPECTED[iso.level]
    cgroup = f"cgroup v{iso.cgroup}: {', '.join(iso.controllers)}" if iso.cgroup else "no cgroup"
    lines = [f"sandbox isolation: {iso.level} (bwrap: {iso.bwrap or 'not used'}; {cgroup})",
             f"{'guarantee':<18} {'promised':<9} {'holds':<6} what the attack saw"]
    ok = True
    for o in outcomes:
        promised = o.name in expected
        ok &= o.holds or not promised
        lines.append(f"{o.name:<18} {'yes' if promised else 'no':<9} "
                     f"{'yes' if o.holds else 'NO':<6} {o.detail}")
    return "\n".join(lines), ok


# ------------------------------------------------------------------------------ host side
@contextlib.contextmanager
def _world_readable_file(text: str) -> Iterator[Path]:
    """A file anyone on the host may read (in a world-enterable directory)."""
    d = Path(tempfile.mkdtemp(prefix="rw-check-"))
    try:
        d.chmod(0o755)
        path = d / "expected.txt"
        path.write_text(text)
        path.chmod(0o644)
        yield path
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
        with contextlib.suppress(OSError):
            d.rmdir()


@contextlib.contextmanager
def _listeners() -> Iterator[tuple[int, int, str, str, set[str]]]:
    """TCP and UDP on 127.0.0.1, a unix socket under /tmp (world-writable, mode 0777) and an
    abstract one. On exit, `heard` gets the names of those that received anything (a
    connection waits in the accept queue, a datagram in the receive buffer)."""
    heard: set[str] = set()
    socks: dict[str, socket.socket] = {}
    unix_path = f"/tmp/rw-check-{secrets.token_hex(4)}.sock"
    try:
        socks["tcp"] = socket.socket()
        socks["tcp"].bind(("127.0.0.1", 0))
        socks["udp"] = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        socks["udp"].bind(("127.0.0.1", 0))
        socks["unix"] = socket.socket(socket.AF_UNIX)
        socks["unix"].bind(unix_path)
        os.chmod(unix_path, 0o777)
        abstract_name = f"\0rw-check-{secrets.token_hex(4)}"
        socks["abstract"] = socket.socket(socket.AF_UNIX)
        socks["abstract"].bind(abstract_name)
        for name, s in socks.items():
            if name != "udp":
                s.listen()
            s.setblocking(False)
        yield (socks["tcp"].getsockname()[1], socks["udp"].getsockname()[1], unix_path,
               abstract_name, heard)
        for name, s in socks.items():
            with contextlib.suppress(OSError):
                if name == "udp":
                    s.recv(16)
                else:
                    s.accept()[0].close()
                heard.add(name)
    finally:
        for s in socks.values():
            s.close()
        with contextlib.suppress(OSError):
            os.unlink(unix_path)


def _processes_with(marker: str) -> list[int]:
    """Live host processes named `marker`."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if Path(f"/proc/{entry}/comm").read_text().strip() == marker:
                    pids.append(int(entry))
    return pids


def _last_json_list(result: RunResult) -> list:
    value = _last_json(result) if result.stdout.strip() else []
    return value if isinstance(value, list) else []
