"""Run untrusted Python (generated programs) isolated from the host, limited as a whole job.

    runner.py      `Sandbox`: the job API (run, run_tests, run_function; sync and async),
                   the memory budget, the results
    isolation.py   the isolation levels, the one asked for, the probe that checks the host
    supervisor.py  one child from the host: its pipes against the clock, its status, its end
    jail.py        the bubblewrap command line: namespaces and a mount tree of the interpreter
    launch.py      starts the jail: joins the job's cgroups, gives it a fresh session
                   keyring, drops to a fresh uid (as root)
    syscalls.py    the seccomp policy: the system calls a job may make (others: EPERM),
                   and the compiled filters in seccomp/
    seccomp_build.py  builds seccomp/<machine>.bpf from the policy with libseccomp
    cgroup.py      one control group per job: memory, tasks and CPU over the whole process tree
    child.py       the harness that runs first inside the jail (standard library only)
    check.py       `routeweaver sandbox check`: attacks that test each guarantee on this host
    syscall_attack.py  the attack on the kernel's side doors (`syscalls_filtered`)

What each isolation level guarantees, and on which host set-up: docs/sandbox.md.
"""

from jax_routeweaver.rewards.sandbox.isolation import (
    ISOLATION_ENV,
    STRONGEST,
    Isolation,
    IsolationUnavailable,
    SandboxError,
)
from jax_routeweaver.rewards.sandbox.runner import (
    CallResult,
    FunctionRunResult,
    RunResult,
    Sandbox,
    configure_default_sandbox,
    default_sandbox,
    run_function,
    run_python,
)

__all__ = [
    "ISOLATION_ENV",
    "STRONGEST",
    "CallResult",
    "FunctionRunResult",
    "Isolation",
    "IsolationUnavailable",
    "RunResult",
    "Sandbox",
    "SandboxError",
    "configure_default_sandbox",
    "default_sandbox",
    "run_function",
    "run_python",
]
