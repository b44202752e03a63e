"""The isolation levels, which one is asked for, and the probe that tells whether a host gives it.

The isolation level (`Isolation.level`) is what the host gives and the caller accepts:

    full        the jail + the job cgroup (memory, pids and CPU bounded for the whole job)
    namespaces  the jail only: limits are per process (address space, CPU seconds)
    none        a plain child in a private temporary directory: NO isolation from the host
                (trusted code only)

The requested level comes from `Sandbox(isolation=...)`, else `ROUTEWEAVER_SANDBOX`, else
"full" (`requested_level`). It is checked once, by running a probe job (`probe`), and a level
the host cannot give is an error (`SandboxError`, saying what is missing: `unavailable`): the
sandbox never falls back to less on its own. Only the request "strongest" does: it takes the
first of full, namespaces, none that the host gives. A run asks for it for code the project
generates itself (the simulated pool's answers), never for a real worker's code unless the user
sets it (`rl.run.preflight`). `docs/sandbox.md` lists what each level
guarantees; `routeweaver sandbox check` tests those guarantees on the machine it runs on.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from jax_routeweaver.rewards.sandbox.cgroup import CgroupUnavailable

if TYPE_CHECKING:
    from jax_routeweaver.rewards.sandbox.supervisor import RawResult

__all__ = [
    "ISOLATION_ENV",
    "LEVELS",
    "REQUESTS",
    "STRONGEST",
    "Isolation",
    "IsolationUnavailable",
    "Level",
    "Request",
    "SandboxError",
    "probe",
    "requested_level",
    "unavailable",
]

Level = Literal["full", "namespaces", "none"]
LEVELS: tuple[Level, ...] = ("full", "namespaces", "none")
ISOLATION_ENV = "ROUTEWEAVER_SANDBOX"
STRONGEST = "strongest"  # the first level of LEVELS this host gives
Request = Literal["full", "namespaces", "none", "strongest"]
REQUESTS: tuple[Request, ...] = (*LEVELS, STRONGEST)


class SandboxError(RuntimeError):
    """The sandbox itself failed (the isolation asked for is not available here, or a child
    could not be set up or started): an infra error, never a verdict on the program."""


class IsolationUnavailable(SandboxError):
    """The isolation level asked for cannot be had on this host: a set-up problem to fix (or
    to accept less), never a per-row infra failure. Callers let it end the run. `why`: what
    is missing, without the ways out the message adds; `level`: the level asked for."""

    def __init__(self, message: str, why: str = "", level: str = "") -> None:
        super().__init__(message)
        self.why, self.level = why or message, level


@dataclasses.dataclass(frozen=True)
class Isolation:
    """The isolation jobs run under: `level`, the `bwrap` used, the cgroup layout (`cgroup`
    1 or 2, None without) and its `controllers`."""

    level: Level
    bwrap: str | None = None
    cgroup: int | None = None
    controllers: tuple[str, ...] = ()

    @property
    def jailed(self) -> bool:
        return self.level != "none"

    @property
    def whole_job_limits(self) -> bool:
        return self.level == "full"


def requested_level(isolation: str | None = None) -> Request:
    """`isolation`, else `$ROUTEWEAVER_SANDBOX`, else "full": a level or "strongest"; anything
    else is an error naming where the value came from."""
    value = isolation if isolation is not None else os.environ.get(ISOLATION_ENV) or "full"
    if value not in REQUESTS:
        source = "isolation" if isolation is not None else f"${ISOLATION_ENV}"
        raise SandboxError(f"sandbox: {source}={value!r} is not one of {', '.join(REQUESTS)}")
    return value  # type: ignore[return-value]


def probe(iso: Isolation, spawn: Callable[..., RawResult]) -> list[str]:
    """What keeps `iso` from working here (empty: it works), from one probe job (`spawn`:
    `Sandbox._spawn`, which runs one child)."""
    try:
        raw = spawn(iso, "probe", {}, b"", 10.0, 256)
        report = json.loads(raw.stdout.decode().strip().splitlines()[-1])
    except (SandboxError, CgroupUnavailable, ValueError, IndexError, OSError) as exc:
        return [str(exc)[:500]]
    problems = []
    if raw.returncode != 0:
        problems.append(f"the probe exited with {raw.returncode}")
    if iso.jailed and report.get("seccomp") != "2":
        problems.append(f"the jail's seccomp filter is not in force (Seccomp: "
                        f"{report.get('seccomp')!r})")
    if report.get("ifaces") != ["lo"]:
        problems.append(f"network interfaces in the jail: {report.get('ifaces')}")
    if not report.get("imports"):
        problems.append(f"the standard library does not import: {report.get('error')}")
    if not report.get("cwd_write"):
        problems.append("the working directory is not writable")
    return problems


def unavailable(level: str, why: str) -> IsolationUnavailable:
    """The error for a `level` this host cannot give (`why`), with the ways out."""
    return IsolationUnavailable(
        f"sandbox: isolation {level!r} is not available on this host: {why}. Install "
        f"bubblewrap and run as root or in a delegated cgroup subtree (docs/sandbox.md, "
        f"\"Where full is had\"), or accept less "
        f"with {ISOLATION_ENV}=namespaces (no whole-job limits) or {ISOLATION_ENV}=none (no "
        f"isolation: trusted code only); `routeweaver sandbox check` tells what this host "
        f"gives (docs/sandbox.md)", why, level)
