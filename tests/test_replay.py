"""`routing.pools.replay`: the record/replay worker cache (keys, modes, coalescing, crash safety,
secrets)."""

import asyncio
import json

import pytest

from jax_routeweaver.routing.pools.channels import parse_channels
from jax_routeweaver.routing.pools.pricing import REFERENCE_PRICES, trajectory_cost
from jax_routeweaver.routing.pools.replay import (
    CacheFileError,
    CallIdentity,
    ReplayMissError,
    ReplayPool,
    cache_key,
    http_identity,
    pool_identity,
)
from jax_routeweaver.routing.protocol.calls import Usage, WorkerCall
from jax_routeweaver.routing.simulated.pool import SimulatedWorkerPool
from jax_routeweaver.routing.simulated.tasks import synthetic_tasks

SECRET = "sk-test-0123456789abcdef"


class CountingPool:
    """A fake backend: deterministic replies with usage, a call counter, optional delay and
    failures, and (to test scrubbing) the secret echoed in its reply when asked."""

    def __init__(self, delay: float = 0.0, fail: bool = False):
        self.calls: list[tuple[str, str, int | None]] = []
        self.delay = delay
        self.fail = fail

    def worker_ids(self):
        return ["worker_1", "worker_2"]

    def description(self, worker):
        return f"desc {worker}"

    async def call(self, worker, prompt, *, max_tokens=None):
        self.calls.append((worker, prompt, max_tokens))
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.fail:
            return WorkerCall(worker=worker, prompt=prompt, text="", success=False,
                              latency_s=0.5, attempts=3, error="provider_error: http_503")
        text = f"{worker} says <answer>{len(prompt)}</answer>"
        if "echo" in prompt:
            text += f" (key {SECRET})"
        return WorkerCall(worker=worker, prompt=prompt, text=text, success=True,
                          usage=Usage(len(prompt), 7, 2), latency_s=1.25, attempts=1)


class RaisingPool(CountingPool):
    async def call(self, worker, prompt, *, max_tokens=None):
        raise AssertionError(f"replay called the backend for {worker}")


def same_identity(_pool):
    """The identity of `CountingPool` under any stand-in (a replay swaps the backend)."""
    identity = CallIdentity(backend={"kind": "counting", "model": "fake-1"},
                            sampling={"temperature": 0.2, "seed": 42}, default_max_tokens=64)
    return lambda worker: identity


def run(coro):
    return asyncio.run(coro)


def channels(temperature_note: str = ""):
    return parse_channels({"workers": {
        "worker_1": {"description": "small dense model", "base_url": "http://127.0.0.1:9/v1",
                     "model": "m-small", "timeout_s": 10, "api_key_env": "RW_TEST_KEY",
                     "extra_body": {"top_p": 0.9}},
        "worker_2": {"description": "large dense model", "base_url": "http://127.0.0.1:9/v1",
                     "model": "m-large", "timeout_s": 10}}})


# ------------------------------------------------------------------------------ keys
def test_cache_key_changes_with_payload_worker_sampling_and_backend():
    ident = CallIdentity(backend={"kind": "http", "model": "a"}, sampling={"temperature": 0.2},
                         default_max_tokens=4096)
    base = cache_key("worker_1", "payload", ident)
    assert base == cache_key("worker_1", "payload", ident)
    assert len(base) == 64 and int(base, 16) >= 0  # a sha256 hex digest
    # None means the backend's default: the same request as the default spelled out.
    assert base == cache_key("worker_1", "payload", ident, max_tokens=4096)
    assert base != cache_key("worker_1", "payload", ident, max_tokens=512)
    assert base != cache_key("worker_1", "payload ", ident)
    assert base != cache_key("worker_2", "payload", ident)
    hotter = CallIdentity(backend=ident.backend, sampling={"temperature": 0.7},
                          default_max_tokens=4096)
    assert base != cache_key("worker_1", "payload", hotter)
    other = CallIdentity(backend={"kind": "http", "model": "b"}, sampling=ident.sampling,
                         default_max_tokens=4096)
    assert base != cache_key("worker_1", "payload", other)


def test_http_identity_carries_model_temperature_and_no_secret(monkeypatch):
    monkeypatch.setenv("RW_TEST_KEY", SECRET)
    cold = http_identity(channels(), temperature=0.2)("worker_1")
    hot = http_identity(channels(), temperature=0.7)("worker_1")
    assert cold.backend["model"] == "m-small" and cold.sampling["temperature"] == 0.2
    assert cold.sampling["seed"] == 42 and cold.default_max_tokens == 4096  # pool defaults
    assert cache_key("worker_1", "p", cold) != cache_key("worker_1", "p", hot)
    text = json.dumps(cold.backend) + json.dumps(cold.sampling)
    assert SECRET not in text and "top_p" not in text  # extra_body only as a digest
    with pytest.raises(KeyError, match="worker_9"):
        http_identity(channels())("worker_9")


def test_simulated_identity_depends_on_the_seed():
    tasks = synthetic_tasks(5, seed=0)
    a = pool_identity(SimulatedWorkerPool(tasks, seed=0))("worker_1")
    b = pool_identity(SimulatedWorkerPool(tasks, seed=1))("worker_1")
    assert a.backend["kind"] == "simulated" and a != b
    assert cache_key("worker_1", "p", a) != cache_key("worker_1", "p", b)


# ------------------------------------------------------------------------------ modes
def test_record_then_replay_offline_returns_identical_calls(tmp_path):
    cache = tmp_path / "cache.jsonl"
    backend = CountingPool()
    pool = ReplayPool(backend, mode="record", cache=cache, identify=same_identity(backend))
    first = run(pool.call("worker_1", "question one", max_tokens=32))
    again = run(pool.call("worker_1", "question one", max_tokens=32))
    other = run(pool.call("worker_2", "question one"))
    assert len(backend.calls) == 2  # the repeat was not paid twice
    assert pool.stats.hits == 1 and pool.stats.recorded == 2
    assert first == again and first.latency_s == 1.25 and first.usage == Usage(12, 7, 2)

    offline = ReplayPool(RaisingPool(), mode="replay", cache=cache,
                         identify=same_identity(None))
    assert run(offline.call("worker_1", "question one", max_tokens=32)) == first
    assert run(offline.call("worker_2", "question one")) == other
    # Cost is recomputed from the stored usage exactly as for the live call.
    assert trajectory_cost([first], REFERENCE_PRICES) == trajectory_cost(
        [run(offline.call("worker_1", "question one", max_tokens=32))], REFERENCE_PRICES)
    with pytest.raises(ReplayMissError, match=r"worker_1.*'question two'"):
        run(offline.call("worker_1", "question two", max_tokens=32))
    with pytest.raises(ReplayMissError, match="max_tokens': 16"):  # sampling is in the key
        run(offline.call("worker_1", "question one", max_tokens=16))


def test_replay_with_another_temperature_misses(tmp_path, monkeypatch):
    monkeypatch.setenv("RW_TEST_KEY", SECRET)
    cache = tmp_path / "cache.jsonl"
    pool = ReplayPool(CountingPool(), mode="record", cache=cache,
                      identify=http_identity(channels(), temperature=0.2))
    run(pool.call("worker_1", "q"))
    cold = ReplayPool(RaisingPool(), mode="replay", cache=cache,
                      identify=http_identity(channels(), temperature=0.2))
    assert run(cold.call("worker_1", "q")).success
    hot = ReplayPool(RaisingPool(), mode="replay", cache=cache,
                     identify=http_identity(channels(), temperature=0.7))
    with pytest.raises(ReplayMissError, match="temperature': 0.7"):
        run(hot.call("worker_1", "q"))


def test_off_mode_passes_through_without_a_file(tmp_path):
    backend = CountingPool()
    pool = ReplayPool(backend, mode="off")
    run(pool.call("worker_1", "q"))
    run(pool.call("worker_1", "q"))
    assert len(backend.calls) == 2 and pool.stats.passthrough == 2
    assert not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="needs a cache file"):
        ReplayPool(backend, mode="record")
    with pytest.raises(FileNotFoundError, match="no worker cache"):
        ReplayPool(backend, mode="replay", cache=tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="mode='later'"):
        ReplayPool(backend, mode="later", cache=tmp_path / "c.jsonl")


def test_failures_are_replayed_but_retried_when_recording(tmp_path):
    cache = tmp_path / "cache.jsonl"
    failing = CountingPool(fail=True)
    run(ReplayPool(failing, mode="record", cache=cache, identify=same_identity(None))
        .call("worker_1", "q"))
    replayed = run(ReplayPool(RaisingPool(), mode="replay", cache=cache,
                              identify=same_identity(None)).call("worker_1", "q"))
    assert not replayed.success and replayed.error == "provider_error: http_503"
    assert replayed.attempts == 3
    healthy = CountingPool()
    pool = ReplayPool(healthy, mode="record", cache=cache, identify=same_identity(None))
    assert run(pool.call("worker_1", "q")).success  # the failure was no work worth keeping
    assert len(healthy.calls) == 1 and pool.stats.retried_failures == 1
    later = ReplayPool(RaisingPool(), mode="replay", cache=cache, identify=same_identity(None))
    assert run(later.call("worker_1", "q")).success  # the later line wins


# ------------------------------------------------------------------------------ concurrency
def test_concurrent_identical_calls_reach_the_backend_once(tmp_path):
    backend = CountingPool(delay=0.05)
    pool = ReplayPool(backend, mode="record", cache=tmp_path / "c.jsonl",
                      identify=same_identity(None))

    async def main():
        return await asyncio.gather(pool.call("worker_1", "same"), pool.call("worker_1", "same"),
                                    pool.call("worker_1", "different"))

    a, b, c = run(main())
    assert a == b and c.prompt == "different"
    assert [p for _, p, _ in backend.calls] == ["same", "different"]
    assert pool.stats.coalesced == 1 and pool.stats.recorded == 2
    lines = (tmp_path / "c.jsonl").read_text().splitlines()
    assert len(lines) == 3  # header + one entry per distinct call


# ------------------------------------------------------------------------------ the file
def test_cache_file_is_readable_jsonl_and_survives_a_torn_append(tmp_path):
    cache = tmp_path / "cache.jsonl"
    pool = ReplayPool(CountingPool(), mode="record", cache=cache, identify=same_identity(None))
    kept = run(pool.call("worker_1", "kept"))
    header, entry = (json.loads(line) for line in cache.read_text().splitlines())
    assert header == {"format": "routeweaver-worker-cache", "version": 1}
    assert entry["worker"] == "worker_1" and entry["payload"] == "kept"
    assert entry["reply"]["text"] == kept.text and entry["reply"]["usage"]["prompt_tokens"] == 4
    assert entry["sampling"] == {"temperature": 0.2, "seed": 42, "max_tokens": 64}

    with open(cache, "a") as f:  # a crash in the middle of an append
        f.write('{"key": "abc", "worker": "worker_1", "rep')
    reopened = ReplayPool(CountingPool(), mode="record", cache=cache,
                          identify=same_identity(None))
    assert run(reopened.call("worker_1", "kept")) == kept and reopened.stats.hits == 1
    run(reopened.call("worker_1", "new"))
    assert [json.loads(line)["payload"] for line in cache.read_text().splitlines()[1:]] == \
        ["kept", "new"]

    lines = cache.read_text().splitlines()
    cache.write_text("\n".join([lines[0], "{not json", *lines[1:]]) + "\n")
    with pytest.raises(CacheFileError, match=r"cache.jsonl:2"):
        ReplayPool(CountingPool(), mode="replay", cache=cache)


def test_secrets_are_never_written(tmp_path, monkeypatch):
    monkeypatch.setenv("RW_TEST_KEY", SECRET)
    cache = tmp_path / "cache.jsonl"
    pool = ReplayPool(CountingPool(), mode="record", cache=cache,
                      identify=http_identity(channels()), secrets=[SECRET])
    call = run(pool.call("worker_1", "please echo"))
    text = cache.read_text()
    assert SECRET not in text and "***" in text
    assert SECRET not in call.text  # the run sees what the cache holds


@pytest.mark.parametrize("usage", [{"prompt_tokens": 1e308, "completion_tokens": 5},
                                   {"prompt_tokens": 10, "completion_tokens": -1},
                                   {"prompt_tokens": 10, "completion_tokens": 10 ** 400},
                                   {"prompt_tokens": "10", "completion_tokens": 5},
                                   {"prompt_tokens": 10}, "garbage"])
def test_a_tampered_cached_usage_is_unknown_cost_not_a_crash(usage):
    from jax_routeweaver.routing.pools.replay import call_from_reply

    reply = {"text": "ok", "success": True, "error": None, "usage": usage,
             "failed_usage": usage, "latency_s": 0.1, "attempts": 1, "reasoning_chars": 0}
    call = call_from_reply("worker_1", "p", reply)
    assert call.usage is None and call.failed_usage is None
    assert call_from_reply("worker_1", "p", dict(reply, usage={
        "prompt_tokens": 10, "completion_tokens": 5, "cached_tokens": 2})).usage.prompt_tokens \
        == 10
