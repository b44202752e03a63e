"""The documentation site stays whole: every page is in the site's navigation and every module
has its generated API section. (`make docs` builds the site strictly; these checks name what
is missing without building it.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PACKAGE = ROOT / "jax_routeweaver"


def nav_pages(entries: list) -> set[str]:
    pages: set[str] = set()
    for entry in entries:
        for value in entry.values():
            pages |= nav_pages(value) if isinstance(value, list) else {value}
    return pages


def test_every_page_is_in_the_navigation():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages == nav_pages(config["nav"])


def test_every_module_has_its_api_section():
    documented = set()
    for page in (DOCS / "api").glob("*.md"):
        documented |= set(re.findall(r"^::: (\S+)$", page.read_text(), flags=re.M))
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts)
               for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    assert modules - documented == set(), "add them to docs/api/<package>.md"
    assert documented - modules == set(), "modules that no longer exist"


OUTSIDE = re.compile(r"§|\.\./shared|DESIGN\.md|reference/(routeweaver|router-r1)\.md|"
                     r"(reference|spec) (routeweaver|router-r1)(\.md)? ?§?\d")


@pytest.mark.slow
def test_no_citation_points_outside_the_repository():
    """Code, configs and docs cite the repository's own docs, never the spec files it was
    built from (they are not in the repository). bench/RESULTS.md is a dated log: it keeps
    what each entry said when it was written."""
    files = [p for p in ROOT.rglob("*") if p.is_file() and p.suffix in (
        ".py", ".md", ".yaml", ".yml", ".cfg", ".toml", ".sh")
        and not {".venv", "site", ".git", "runs"} & set(p.relative_to(ROOT).parts)
        and p != ROOT / "bench" / "RESULTS.md"]
    found = [f"{p.relative_to(ROOT)}:{i}" for p in files
             for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
             if OUTSIDE.search(line) and p != Path(__file__)]
    assert found == []
