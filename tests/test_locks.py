"""The pip lock files keep the README's promise ("nothing pre-installed but Python 3.11"): every
pin installs on setup.cfg's Python floor, and a pin that PyPI does not serve (a local version
such as torch's `+cpu`) names its index in its own file."""

from __future__ import annotations

import configparser
import importlib.metadata as md
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PIP_LOCKS = sorted(p for p in (ROOT / "requirements").glob("*.lock") if p.name != "apt.lock")
# The locks this venv is built from (`make install`): every pin is installed at its version.
INSTALLED_LOCKS = ("cpu.lock", "cpu-torch.lock")


def python_floor() -> Version:
    """The lowest Python setup.cfg accepts (`python_requires = >=3.11` -> 3.11.0)."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    spec = cfg["options"]["python_requires"].strip()
    assert spec.startswith(">="), spec
    return Version(spec[2:])


def pins(lock: Path) -> list[tuple[str, str]]:
    """(name, version) of each `name==version` line."""
    out = []
    for line in lock.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            name, version = line.split("==")
            out.append((name.split("[")[0], version))
    return out


def test_every_installed_pin_installs_on_the_python_floor():
    floor, too_new, checked = python_floor(), [], {}
    for lock in PIP_LOCKS:
        for name, version in pins(lock):
            try:
                dist = md.distribution(name)
            except md.PackageNotFoundError:
                continue
            if canonicalize_name(dist.metadata["Name"]) != canonicalize_name(name) or \
                    Version(dist.version) != Version(version):
                continue  # another lock's version: this venv cannot tell
            checked.setdefault(lock.name, []).append(name)
            needs = dist.metadata.get("Requires-Python")
            if needs and not SpecifierSet(needs).contains(floor):
                too_new.append(f"{lock.name}: {name}=={version} needs Python {needs}")
    assert not too_new, f"pins that do not install on Python {floor}: {too_new}"
    for name in INSTALLED_LOCKS:  # not vacuous: this venv's own locks were all read
        assert len(checked.get(name, [])) == len(pins(ROOT / "requirements" / name)), name


def test_a_pin_pypi_does_not_serve_names_its_index_in_its_own_file():
    for lock in PIP_LOCKS:
        local = [f"{n}=={v}" for n, v in pins(lock) if "+" in v]
        indexes = [line for line in lock.read_text().splitlines()
                   if line.startswith(("--index-url", "--extra-index-url"))]
        assert not local or indexes, f"{lock.name}: {local} need their index named there"


def test_the_main_locks_wait_on_no_other_index():
    """cpu.lock's and tpu.lock's pins are all on PyPI, so their installs never query an index
    that may be down; torch's CPU build is installed on its own (cpu-torch.lock)."""
    for name in ("cpu.lock", "tpu.lock"):
        lock = ROOT / "requirements" / name
        assert "index-url" not in lock.read_text(), name
        assert "torch" not in dict(pins(lock)), name
    assert dict(pins(ROOT / "requirements" / "cpu-torch.lock")) == {"torch": "2.13.0+cpu"}
