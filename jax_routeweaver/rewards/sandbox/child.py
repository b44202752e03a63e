"""The harness: the first code that runs in a sandbox child, before the program.

Run as `python -B -s -P child.py CONFIG_JSON` (inside the jail at `/.sandbox/child.py`). It
imports the standard library only: the package is not visible in the jail. Order:

1. resource limits (address space, CPU seconds, file size, open files, no core dumps);
2. the ready token on stderr: from here on the clock runs, and since the program cannot
   un-write it, it cannot fake a set-up failure;
3. the payload (program, inputs) read from an inherited descriptor, never a file in the jail;
4. the program, in one of three modes:
   `script`      run as `__main__` with stdin as given; exit code and output are the result
   `functional`  load the program, then call one function per input, each under an interval
                 timer; one JSON line per call on the result descriptor (the program's own
                 stdout goes to /dev/null)
   `probe`       report what the child sees (uid, network interfaces, imports, cwd writes)
"""

import json
import linecache
import os
import resource
import signal
import sys
import time
import traceback

READY = b"\x00routeweaver-sandbox-ready\x00\n"
SETUP_FAILED = 97


def write_all(fd, data):
    while data:
        data = data[os.write(fd, data):]


def set_limits(limits):
    """`limits`: {RLIMIT_NAME: [soft, hard]}; a hard limit above ours is lowered to ours."""
    for name, (soft, hard) in limits.items():
        which = getattr(resource, name)
        current = resource.getrlimit(which)[1]
        if current != resource.RLIM_INFINITY:
            hard = min(hard, current)  # raising a hard limit needs a privilege we dropped
        resource.setrlimit(which, (min(soft, hard), hard))


def run_script(payload):
    """The program as `__main__`; the exit code says how it ended."""
    import builtins
    program = payload["program"]
    linecache.cache["<program>"] = (len(program), None, program.splitlines(True), "<program>")
    if payload.get("recursion_limit"):
        sys.setrecursionlimit(payload["recursion_limit"])
    try:
        exec(compile(program, "<program>", "exec"),
             {"__name__": "__main__", "__builtins__": builtins})
    except SystemExit:
        if not payload.get("swallow_exit"):
            raise
        code = 0
    except BaseException as e:
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        code = 1
    else:
        code = 0
    raise SystemExit(code)


class CallTimeout(BaseException):
    """One call ran past its interval timer (a BaseException: `except Exception` in the
    program does not swallow it)."""


def on_alarm(signum, frame):
    raise CallTimeout()


def encode(value):
    """A call's result as JSON: the value itself, else `list(value)`, else nothing."""
    def default(obj):
        if hasattr(obj, "tolist"):  # numpy arrays and scalars
            return obj.tolist()
        raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
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


def describe(error, limit):
    """(status, message) of a failed call."""
    if isinstance(error, CallTimeout):
        return "timeout", f"timed out after {limit:g} s"
    if isinstance(error, MemoryError):
        return "memory", "MemoryError"
    return "error", traceback.format_exception_only(type(error), error)[-1].strip()


def run_functional(payload, out):
    """Load the program once, then one timed call per input; a JSON line per call on `out`."""
    import builtins
    limit = payload["per_test_timeout"]
    signal.signal(signal.SIGALRM, on_alarm)
    if payload.get("recursion_limit"):
        sys.setrecursionlimit(payload["recursion_limit"])

    def emit(record):
        write_all(out, (json.dumps(record) + "\n").encode())

    def timed(fn):
        signal.setitimer(signal.ITIMER_REAL, limit)
        try:
            return fn()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)

    namespace = {"__name__": "solution", "__builtins__": builtins}
    name, style = payload["func_name"], payload["style"]

    def load():
        if payload.get("prelude"):
            exec(compile(payload["prelude"], "<prelude>", "exec"), namespace)
        exec(compile(payload["program"], "<program>", "exec"), namespace)

    try:
        timed(load)
    except BaseException as e:
        status, error = describe(e, limit)
        emit({"i": -1, "status": status, "error": error})
        return

    def resolve():
        cls = namespace.get("Solution")
        if style == "lcb":
            if cls is None:
                raise NameError("class Solution is not defined")
            return getattr(cls(), name)
        if isinstance(cls, type) and hasattr(cls, name):
            return getattr(cls(), name)
        if callable(namespace.get(name)):
            return namespace[name]
        raise NameError(f"function {name!r} is not defined")

    for i, args in enumerate(payload["inputs"]):
        t0 = time.perf_counter()
        try:
            record = timed(lambda: dict(encode(resolve()(*args)), status="ok"))  # noqa: B023
        except BaseException as e:
            status, error = describe(e, limit)
            record = {"status": status, "error": error}
        record["i"], record["t"] = i, time.perf_counter() - t0
        emit(record)
        if record["status"] != "ok" and payload.get("stop_on_error"):
            return


def probe(payload):
    """What the child sees: its uid, network interfaces, its seccomp mode (2: a filter),
    whether the stdlib imports and the working directory takes a file."""
    import socket
    report = {"uid": os.getuid(), "ifaces": sorted(n for _, n in socket.if_nameindex())}
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    report["seccomp"] = status.get("Seccomp", "").strip()
    try:
        import decimal  # noqa: F401  (not imported yet: read from the stdlib now)
        import fractions  # noqa: F401
        import statistics  # noqa: F401
        report["imports"] = True
    except Exception as e:
        report["imports"], report["error"] = False, repr(e)
    try:
        with open("probe.txt", "w") as f:
            f.write("x")
        report["cwd_write"] = True
    except OSError:
        report["cwd_write"] = False
    print(json.dumps(report))


def main():
    config = json.loads(sys.argv[1])
    try:
        set_limits(config["rlimits"])
    except BaseException as e:
        write_all(2, f"routeweaver sandbox setup failed: {e!r}\n".encode())
        os._exit(SETUP_FAILED)
    write_all(2, READY)
    with os.fdopen(config["payload_fd"], "rb") as f:
        payload = json.loads(f.read())
    if config["mode"] == "probe":
        return probe(payload)
    if config["mode"] == "functional":
        out = os.dup(1)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)  # the program's prints go nowhere; results go to `out`
        os.close(devnull)
        return run_functional(payload, out)
    run_script(payload)


if __name__ == "__main__":
    main()
