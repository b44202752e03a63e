"""The README's commands as an ordinary user (not root) with the distribution's Python: the
sandbox check, a run refused in its first seconds, and a 2-step quickstart at the strongest
isolation the host gives; with a cgroup subtree delegated to the user, the full level.

Run as root (as CI does), the tests create the user `rwtest` and a venv of the distribution's
`/usr/bin/python3.11` that sees this checkout's installed packages, and run every command as
that user (skipped, with the reason, where `useradd` or that Python is missing, or where the
checkout cannot be read by another user). Run as an ordinary user, they run the commands
directly. The quickstart starts from random weights (``model.init=random``): the stand-in's
build is the same code as root's and would add minutes."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from jax_routeweaver.rewards.sandbox import cgroup as cg
from jax_routeweaver.rewards.sandbox import check

pytestmark = pytest.mark.integration

USER = "rwtest"
DISTRO_PYTHON = "/usr/bin/python3.11"
ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
Run = Callable[..., subprocess.CompletedProcess]


def _site_packages() -> str:
    return next(p for p in sys.path if p.endswith("site-packages") and
                p.startswith(sys.prefix))


@pytest.fixture(scope="module")
def workspace() -> Iterator[Path]:
    """A directory the user owns, under the world-readable /tmp."""
    ws = Path(tempfile.mkdtemp(prefix="rwtest-", dir="/tmp"))
    ws.chmod(0o755)
    yield ws
    shutil.rmtree(ws, ignore_errors=True)


@pytest.fixture(scope="module")
def as_user(workspace: Path) -> Run:
    """Runs `routeweaver <args>` as an ordinary user: (args, env=..., prefix=...) ->
    CompletedProcess. `prefix`: a root shell line run first (its `exec` starts the user's)."""
    if os.geteuid() != 0:
        def run_here(args: list[str], env: dict | None = None, prefix: str = ""
                     ) -> subprocess.CompletedProcess:
            assert not prefix, "a root prefix needs root"
            return subprocess.run([sys.executable, "-m", "jax_routeweaver.cli", *args],
                                  capture_output=True, text=True, timeout=900, cwd=workspace,
                                  env={**os.environ, **(env or {})})
        return run_here
    if shutil.which("useradd") is None or shutil.which("runuser") is None:
        pytest.skip("useradd or runuser is missing: cannot make an ordinary user here")
    if not os.access(DISTRO_PYTHON, os.X_OK):
        pytest.skip(f"{DISTRO_PYTHON} (the distribution's Python 3.11) is missing")
    if subprocess.run(["id", USER], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "--no-create-home", "--home-dir", "/nonexistent",
                        "--shell", "/usr/sbin/nologin", USER], check=True)
    shutil.chown(workspace, USER, USER)
    venv = workspace / "venv"
    user = ["runuser", "-u", USER, "--"]
    subprocess.run([*user, DISTRO_PYTHON, "-m", "venv", "--without-pip", str(venv)],
                   check=True, timeout=120)
    # The distribution's interpreter over this checkout's installed packages (cp311 ABI).
    (next(venv.glob("lib/python3*/site-packages")) / "routeweaver_suite.pth").write_text(
        f"import site; site.addsitedir({_site_packages()!r})\n")
    tmp = workspace / "tmp"  # what the libraries leave in $TMPDIR goes with the workspace
    tmp.mkdir()
    shutil.chown(tmp, USER, USER)
    base = {"HOME": str(workspace), "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8",
            "TMPDIR": str(tmp), "ROUTEWEAVER_CACHE": str(workspace / "cache"),
            "JAX_PLATFORMS": "cpu"}
    probe = subprocess.run([*user, "env", "-i", *[f"{k}={v}" for k, v in base.items()],
                            str(venv / "bin" / "python"), "-c", "import jax_routeweaver.cli"],
                           capture_output=True, text=True, timeout=120, cwd=workspace)
    if probe.returncode != 0:
        pytest.skip(f"this checkout or its venv is not readable by user {USER}: "
                    f"{probe.stderr.strip().splitlines()[-1:]}")

    def run(args: list[str], env: dict | None = None, prefix: str = ""
            ) -> subprocess.CompletedProcess:
        command = [*user, "env", "-i", *[f"{k}={v}" for k, v in {**base, **(env or {})}.items()],
                   str(venv / "bin" / "python"), "-m", "jax_routeweaver.cli", *args]
        if prefix:
            command = ["sh", "-c", f'{prefix}; exec "$@"', "sh", *command]
        return subprocess.run(command, capture_output=True, text=True, timeout=900,
                              cwd=workspace)
    return run


def guarantee_rows(out: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split()[1:3] for line in out.splitlines()
            if line.split()[:1] and line.split()[0] in check.GUARANTEES}


def test_sandbox_check_as_an_ordinary_user(as_user: Run):
    strongest = as_user(["sandbox", "check", "--isolation", "strongest"])
    assert strongest.returncode == 0, strongest.stdout + strongest.stderr
    level = strongest.stdout.split("sandbox isolation: ")[1].split()[0]
    rows = guarantee_rows(strongest.stdout)
    assert list(rows) == list(check.GUARANTEES)
    assert all(rows[g] == ["yes", "yes"] for g in check.EXPECTED[level]), strongest.stdout
    if os.geteuid() == 0:  # the user made here has no delegated cgroup
        assert level == "namespaces"
        full = as_user(["sandbox", "check"])
        assert full.returncode == 2
        errors = full.stderr.strip().splitlines()
        assert len(errors) == 1 and "isolation 'full' is not available" in errors[0]
        assert "not writable by uid" in errors[0]


@pytest.fixture
def delegated_v1() -> Iterator[list[Path]]:
    """A cgroup v1 subtree per controller handed to the user, as an administrator delegates
    one (the directory and its files chowned to the user, like `cgcreate -a -t`)."""
    if os.geteuid() != 0:
        pytest.skip("delegating a cgroup subtree needs root")
    mounts, own = cg._mounts(), cg._own_cgroups()
    dirs = {}
    for point, fstype, opts, root in mounts:
        for controller in ("memory", "pids", "cpu"):
            if fstype == "cgroup" and controller in opts and controller in own:
                dirs.setdefault(controller, cg._under(point, root, own[controller]))
    if not {"memory", "pids"} <= set(dirs):
        pytest.skip("this host's memory and pids controllers are not on cgroup v1")
    made = []
    for d in dict.fromkeys(dirs.values()):
        sub = d / f"{USER}-delegated-{os.getpid()}"
        sub.mkdir()
        made.append(sub)
        for path in (sub, *sub.iterdir()):
            shutil.chown(path, USER, USER)
    yield made
    for sub in made:  # the innermost first: a cgroup directory goes only when empty
        for d in sorted((p for p in sub.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            cg.JobCgroup(1, (d,)).destroy()
        cg.JobCgroup(1, (sub,)).destroy()


def test_full_in_a_delegated_cgroup(as_user: Run, delegated_v1: list[Path]):
    join = "; ".join(f"echo $$ > {d / 'cgroup.procs'}" for d in delegated_v1)
    full = as_user(["sandbox", "check"], prefix=join)
    assert full.returncode == 0, full.stdout + full.stderr
    assert "sandbox isolation: full" in full.stdout
    rows = guarantee_rows(full.stdout)
    assert all(rows[g] == ["yes", "yes"] for g in check.EXPECTED["full"]), full.stdout
    # The job groups were made inside the delegated subtree, and removed.
    assert all(not list(d.glob(cg._PREFIX + "*/job-*")) for d in delegated_v1)


def test_quickstart_as_an_ordinary_user(as_user: Run, workspace: Path):
    common = ["train", "--config", str(QUICKSTART), "logging.plots=false",
              "logging.tensorboard=false"]
    if os.geteuid() == 0:
        # Asked for "full" where it cannot be had: refused in the first seconds, one line,
        # before the stand-in's minutes of work and without writing anything.
        start = time.monotonic()
        refused = as_user([*common, f"out_dir={workspace / 'refused'}"],
                          env={"ROUTEWEAVER_SANDBOX": "full"})
        seconds = time.monotonic() - start
        assert refused.returncode == 2, refused.stdout + refused.stderr
        errors = refused.stderr.strip().splitlines()
        assert len(errors) == 1 and "the run cannot start (1 problem): sandbox: isolation " \
            "'full' is not available" in errors[0]
        assert not (workspace / "refused").exists()
        assert not (workspace / "cache" / "stand_in").exists()
        print(f"refused after {seconds:.1f} s")
        assert seconds < 60, seconds  # the stand-in's build alone takes minutes
    out = workspace / "run"
    run = as_user([*common, "steps=2", "model.init=random", f"out_dir={out}"])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    said = [ln for ln in run.stdout.splitlines() if ln.startswith("sandbox: isolation")]
    assert len(said) == 1 and "(the strongest this host gives" in said[0], run.stdout[-3000:]
    if os.geteuid() == 0:
        assert said[0].startswith("sandbox: isolation 'namespaces'")
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
