"""`routeweaver sandbox check` and selfcheck's sandbox row: the real attacks on this host, and
one line with exit code 2 where the isolation asked for is not available. The full report of
`sandbox check` is tested as an ordinary user (tests/test_unprivileged.py: at the strongest
level, and at full in a delegated cgroup); every guarantee at full as root, in
tests/test_sandbox_security.py."""

import pytest

from jax_routeweaver.cli import app, sandbox_cmd
from jax_routeweaver.rewards.sandbox import jail

pytestmark = pytest.mark.integration


def test_sandbox_check_without_bubblewrap_is_one_line_and_exit_2(capsys, monkeypatch):
    monkeypatch.setattr(jail, "find_bwrap", lambda: None)
    assert app.main(["sandbox", "check"]) == 2
    captured = capsys.readouterr()
    assert "full        sandbox: isolation 'full' is not available" in captured.out
    errors = captured.err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("routeweaver: error: sandbox: isolation "
                                                     "'full' is not available")
    assert "bubblewrap (bwrap) is not installed" in errors[0]


def test_selfcheck_row(monkeypatch):
    line, ok = sandbox_cmd.sandbox_row()
    assert ok and line.startswith("isolation full: 9/9 promised guarantees hold")
    monkeypatch.setenv("ROUTEWEAVER_SANDBOX", "namespaces")
    monkeypatch.setattr(jail, "find_bwrap", lambda: None)
    line, ok = sandbox_cmd.sandbox_row()
    assert not ok and "'namespaces' is not available" in line
