"""`routeweaver train --dry-run`: devices, mesh, compiled memory and endpoint reachability over
real HTTP, without training or writing anything."""

import http.server
import io
import socket
import threading
from pathlib import Path
from typing import ClassVar

import pytest
import yaml
from rich.console import Console

from jax_routeweaver.cli.app import main
from jax_routeweaver.planning.dry_run import dry_run, endpoint_checks
from jax_routeweaver.rl.run.train_config import load_train_config

# 5 queries x 8 rollouts = 40 rows: micro-batches of 8 split over the 8 test devices.
EIGHT_DEVICES = ["data.group_size=8", "algo.loss.micro_batch_size=8"]


class _Models(http.server.BaseHTTPRequestHandler):
    seen_auth: ClassVar[list] = []

    def do_GET(self):
        _Models.seen_auth.append(self.headers.get("Authorization"))
        ok = self.path.endswith("/models") or self.path == "/health"
        self.send_response(200 if ok else 404)
        self.end_headers()
        self.wfile.write(b'{"data": [{"id": "m"}]}')

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = http.server.HTTPServer(("127.0.0.1", 0), _Models)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def channel_file(tmp_path, base_up: str) -> str:
    entry = lambda url, **kw: {"description": "a worker", "base_url": url, "model": "m",
                               "timeout_s": 5, "price": {"input": 0.1, "output": 0.2}, **kw}
    path = tmp_path / "channels.yaml"
    path.write_text(yaml.safe_dump({"workers": {
        "worker_1": entry(f"{base_up}/v1"),
        "worker_2": entry(f"http://127.0.0.1:{closed_port()}/v1"),
        "worker_3": entry(f"{base_up}/v1", api_key_env="RW_TEST_KEY")}}))
    return str(path)


@pytest.mark.slow
def test_dry_run_of_the_quickstart_on_the_test_mesh(devices, tmp_path):
    cfg = load_train_config("configs/quickstart.yaml",
                            [*EIGHT_DEVICES, f"out_dir={tmp_path / 'run'}"])
    out = io.StringIO()
    assert dry_run(cfg, Console(file=out, width=200)) is True
    text = out.getvalue()
    assert "devices: 8 x cpu" in text and "mesh (data, fsdp, tensor): (1, 8, 1)" in text
    assert "2 layers, hidden 64" in text and "GiB per device (update" in text
    assert "endpoints: none" in text and "all checks passed" in text
    assert not (tmp_path / "run").exists()  # nothing written


def test_endpoints_are_checked_over_http_with_keys_from_the_environment(server, tmp_path):
    cfg = load_train_config("configs/quickstart.yaml",
                            [f"workers.pool={channel_file(tmp_path, server)}",
                             "rollout.sampler=vllm", f"rollout.vllm.url={server}"])
    _Models.seen_auth.clear()
    checks = {c.what: c for c in endpoint_checks(cfg, env={"RW_TEST_KEY": "sk-test"})}
    assert checks["worker_1"].ok and checks["worker_1"].detail == \
        "priced at 0.1 in / 0.2 out USD per 1M tokens; serves 'm'"
    assert not checks["worker_2"].ok and "unreachable" in checks["worker_2"].detail
    assert checks["worker_3"].ok and "Bearer sk-test" in _Models.seen_auth
    assert checks["vllm sidecar"].ok and checks["vllm sidecar"].target == f"{server}/health"
    missing = {c.what: c for c in endpoint_checks(cfg, env={})}
    assert not missing["worker_3"].ok
    assert missing["worker_3"].detail == "environment variable RW_TEST_KEY is not set"
    assert missing["worker_3"].target == f"{server}/v1/models"


def test_dry_run_command_fails_on_an_unreachable_worker(server, tmp_path, capsys, devices):
    pool = channel_file(tmp_path, server)
    code = main(["train", "--config", "configs/quickstart.yaml", *EIGHT_DEVICES,
                 f"workers.pool={pool}", "--dry-run", "--no-memory"])
    assert code == 1
    out = capsys.readouterr().out
    assert "some checks FAILED" in out and "sk-" not in out


def test_dry_run_names_an_unpriced_worker_and_a_model_not_served(server, tmp_path, capsys,
                                                                 devices, monkeypatch):
    """The pool check the run makes before step 1, in the dry run: a line per failing worker
    naming it, what is wrong and where; the key never printed."""
    monkeypatch.setenv("RW_TEST_KEY", "sk-test")
    data = yaml.safe_load(Path(channel_file(tmp_path, server)).read_text())
    del data["workers"]["worker_1"]["price"]
    data["workers"]["worker_3"]["model"] = "other"
    data["workers"]["worker_2"]["base_url"] = f"{server}/v1"
    (tmp_path / "channels.yaml").write_text(yaml.safe_dump(data))
    code = main(["train", "--config", "configs/quickstart.yaml", *EIGHT_DEVICES,
                 f"workers.pool={tmp_path / 'channels.yaml'}", f"out_dir={tmp_path / 'run'}",
                 "--dry-run", "--no-memory"])
    out = capsys.readouterr().out
    assert code == 1 and "some checks FAILED" in out
    assert f"FAILED worker_1 ({server}/v1/models): has no price in " \
        f"{tmp_path / 'channels.yaml'}" in out
    assert f"FAILED worker_3 ({server}/v1/models): does not serve the configured model " \
        "'other' (it serves 'm')" in out
    assert "FAILED worker_2" not in out and "sk-test" not in out
    assert not (tmp_path / "run").exists()


def test_inputs_the_run_reads_are_checked(tmp_path):
    from jax_routeweaver.planning.dry_run import input_checks

    cfg = load_train_config("configs/paper/main_alpha0.yaml",
                            [f"model.path={tmp_path / 'model'}",
                             f"checkpoint.init_from={tmp_path / 'cold' / 'state'}"])
    checks = {c.what: c for c in input_checks(cfg)}
    assert not checks["data.source"].ok and checks["data.source"].detail == "no such file"
    assert not checks["model.path"].ok
    assert not checks["checkpoint.init_from"].ok
    assert not (tmp_path / "cold").exists()  # checking created nothing
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    data = tmp_path / "train.jsonl"
    data.write_text("")
    cfg = load_train_config("configs/paper/main_alpha0.yaml",
                            [f"model.path={tmp_path / 'model'}", f"data.source={data}"])
    checks = {c.what: c for c in input_checks(cfg)}
    assert checks["data.source"].ok and checks["model.path"].ok
