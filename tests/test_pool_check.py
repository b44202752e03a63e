"""The run's price table and the worker-pool check before step 1 (`rl.run.pool_check`), over real
HTTP (`openai_stub.SimServer`): a channel file's prices are billed; an unpriced offered worker,
an unreachable endpoint or a model name the endpoint does not serve stops `train` and `eval`
with one line naming the worker, before anything is written; a key never shows."""

import json
import logging
import socket
from pathlib import Path

import pytest
import yaml
from openai_stub import KEY_ENV, PROXY_VARS, SECRET, SimServer, channel_file

from jax_routeweaver.cli.app import main
from jax_routeweaver.rl.run.builders import build_pool
from jax_routeweaver.rl.run.pool_check import (
    PoolCheckError,
    check_run_pool,
    run_price_table_version,
    run_prices,
)
from jax_routeweaver.rl.run.train_config import load_train_config
from jax_routeweaver.routing.pools.pricing import (
    PRICE_TABLE_VERSION,
    REFERENCE_PRICES,
    WorkerPrice,
    pool_prices,
)
from jax_routeweaver.routing.pools.replay import ReplayPool
from jax_routeweaver.routing.pools.workers import HttpWorkerPool
from jax_routeweaver.routing.simulated.pool import SimulatedWorkerPool
from jax_routeweaver.routing.simulated.tasks import synthetic_tasks

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
R1_QUICKSTART = ROOT / "configs" / "router_r1_quickstart.yaml"
CUSTOM = (3.0, 4.0)  # worker_7's price: USD per 1M input / output tokens


@pytest.fixture
def loopback(monkeypatch):
    for name in PROXY_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(KEY_ENV, SECRET)


@pytest.fixture(scope="module")
def sim() -> SimulatedWorkerPool:
    return SimulatedWorkerPool(synthetic_tasks(5, seed=0), seed=0)


@pytest.fixture
def server(sim):
    stub = SimServer(sim)
    yield stub
    stub.close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def channels(tmp_path: Path, sim, url: str, *, prices: dict | None = None,
             custom: bool = True) -> Path:
    """The stub's six workers (reference prices unless `prices`) plus, with `custom`, a
    custom worker_7 serving sim-1 at CUSTOM."""
    path = channel_file(tmp_path / "channels.yaml", sim, url, prices=prices)
    if custom:
        data = yaml.safe_load(path.read_text())
        data["workers"]["worker_7"] = {
            "description": "a custom worker", "base_url": url, "model": "sim-1",
            "timeout_s": 30, "price": {"input": CUSTOM[0], "output": CUSTOM[1]}}
        path.write_text(yaml.safe_dump(data))
    return path


def cfg_for(pool: Path | str, *overrides: str, config: Path = QUICKSTART):
    return load_train_config(config, [f"workers.pool={pool}", *overrides])


def unpriced_worker_2() -> dict:
    return {f"worker_{i}": (0.1, 0.2) for i in (1, 3, 4, 5, 6)}


# ------------------------------------------------------------------------------ prices
def test_the_run_bills_at_the_channel_files_prices(tmp_path, sim, server, loopback):
    assert run_prices(load_train_config(QUICKSTART)) is REFERENCE_PRICES  # simulated pool
    path = channels(tmp_path, sim, server.url, prices=unpriced_worker_2())
    cfg = cfg_for(path, "workers.offered=[worker_1,worker_7]")
    prices = run_prices(cfg)
    assert prices["worker_7"] == WorkerPrice(*CUSTOM)
    assert prices["worker_1"] == WorkerPrice(0.1, 0.2)
    assert "worker_2" not in prices  # an entry without a price is unpriced, never free
    # What training's steps bill at: the pool build_pool gives (checked over HTTP first).
    pool = build_pool(cfg, [])
    assert isinstance(pool, HttpWorkerPool) and pool_prices(pool) == prices
    assert pool_prices(ReplayPool(pool, mode="off")) == prices  # through eval's cache
    assert pool_prices(SimulatedWorkerPool([], seed=0)) is REFERENCE_PRICES
    # Each distinct endpoint (URL and key) asked once: worker_1's with its key, worker_7's
    # without; nothing asked to generate.
    assert server.models_auth == [f"Bearer {SECRET}", None] and server.bodies == []


def test_reference_channel_file_bills_the_reference_table(tmp_path, sim):
    cfg = cfg_for(ROOT / "configs" / "channels" / "reference.yaml")
    assert dict(run_prices(cfg)) == dict(REFERENCE_PRICES)
    assert run_price_table_version(cfg) == PRICE_TABLE_VERSION
    assert run_price_table_version(load_train_config(QUICKSTART)) == PRICE_TABLE_VERSION
    assert run_price_table_version(cfg_for(channels(tmp_path, sim, "http://x/v1"))) is None
    check_run_pool(cfg, network=False)  # pinned backends match


# ------------------------------------------------------------------------------ priced
def test_an_offered_worker_without_a_price_fails_naming_it(tmp_path, sim):
    path = channels(tmp_path, sim, "http://127.0.0.1:9/v1", prices=unpriced_worker_2())
    with pytest.raises(PoolCheckError, match=r"worker_2 \(.*channels.yaml\): has no price"):
        check_run_pool(cfg_for(path), network=False)
    check_run_pool(cfg_for(path, "workers.offered=[worker_1,worker_7]"), network=False)
    with pytest.raises(PoolCheckError, match="worker_9.*not a worker of the pool"):
        check_run_pool(cfg_for(path, "workers.offered=[worker_9]"), network=False)
    # The simulated pool's workers are the reference table's.
    check_run_pool(load_train_config(QUICKSTART))


def test_router_r1_is_priced_by_its_own_table(tmp_path, sim, server, loopback):
    path = channels(tmp_path, sim, server.url, prices={}, custom=False)  # no price entries
    cfg = cfg_for(path, config=R1_QUICKSTART)
    check_run_pool(cfg)  # Router-R1 prices its six models itself
    with pytest.raises(PoolCheckError, match="has no price"):
        check_run_pool(cfg_for(path))  # a RouteWeaver run bills the file's (absent) prices


def test_train_stops_before_writing_anything(tmp_path, sim, server, loopback, capsys):
    path = channels(tmp_path, sim, server.url, prices=unpriced_worker_2())
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("old record\n")
    code = main(["train", "--config", str(QUICKSTART), f"workers.pool={path}",
                 f"out_dir={out}", "logging.progress=false"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("routeweaver: error: ")
    assert "worker_2" in err and "has no price" in err and str(path) in err
    assert [p.name for p in out.iterdir()] == ["config.yaml"]  # nothing written or rewritten
    assert (out / "config.yaml").read_text() == "old record\n"
    assert server.bodies == []  # no worker asked to generate
    # A new run directory is not even created.
    fresh = tmp_path / "fresh"
    assert main(["train", "--config", str(QUICKSTART), f"workers.pool={path}",
                 f"out_dir={fresh}", "logging.progress=false"]) == 2
    assert not fresh.exists()


def test_eval_stops_before_writing_anything(tmp_path, sim, server, loopback, capsys):
    path = channels(tmp_path, sim, server.url, prices=unpriced_worker_2())
    config = tmp_path / "train.yaml"
    config.write_text(QUICKSTART.read_text())
    out = tmp_path / "eval"
    code = main(["eval", "run", f"workers.pool={path}", "--checkpoint", str(tmp_path),
                 "--config", str(config), "--sets", "synthetic:2", "--out", str(out),
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "worker_2" in err and "has no price" in err
    assert not out.exists()
    # An offline replay calls no endpoint and needs no key, but bills: prices still checked.
    code = main(["eval", "run", f"workers.pool={path}", "--checkpoint", str(tmp_path),
                 "--config", str(config), "--sets", "synthetic:2", "--out", str(out),
                 "--replay", "replay", "--cache", str(tmp_path / "cache.jsonl"),
                 "--no-progress"])
    assert code == 2 and "worker_2" in capsys.readouterr().err and not out.exists()


# ------------------------------------------------------------------------------ endpoints
def test_an_unreachable_endpoint_fails_naming_worker_and_url(tmp_path, sim, server, loopback):
    path = channels(tmp_path, sim, server.url, custom=False)
    data = yaml.safe_load(path.read_text())
    dead = f"http://127.0.0.1:{closed_port()}/v1"
    data["workers"]["worker_3"]["base_url"] = dead
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(PoolCheckError) as info:
        check_run_pool(cfg_for(path))
    message = str(info.value)
    assert f"worker_3 ({dead}/models): unreachable" in message
    assert "worker_1" not in message and "\n" not in message
    # Not offered: not called, so not checked.
    check_run_pool(cfg_for(path, "workers.offered=[worker_1,worker_2]"))


def test_a_model_name_the_endpoint_does_not_serve_fails(tmp_path, sim, loopback):
    stub = SimServer(sim, models=["sim-1", "other-a", "other-b"])
    try:
        path = channels(tmp_path, sim, stub.url)
        with pytest.raises(PoolCheckError) as info:
            check_run_pool(cfg_for(path, "workers.offered=[worker_1,worker_2,worker_7]"))
    finally:
        stub.close()
    message = str(info.value)
    assert f"worker_2 ({stub.url}/models): does not serve the configured model 'sim-2'" \
        in message
    assert "it serves 'sim-1', 'other-a', 'other-b'" in message
    assert "worker_1 (" not in message and "worker_7 (" not in message  # sim-1 is served


@pytest.mark.parametrize("status, expected", [
    (404, "HTTP 404: no OpenAI model list there"),
    (401, "HTTP 401: the key was rejected"),
    (503, "HTTP 503"),
])
def test_an_endpoint_without_a_model_list_fails_closed(tmp_path, sim, server, loopback,
                                                       status, expected):
    server.models_status = status
    path = channels(tmp_path, sim, server.url)
    with pytest.raises(PoolCheckError, match=f"worker_1 \\(.*\\): {expected}"):
        check_run_pool(cfg_for(path))
    # An endpoint without a model list can still be used: its names are then not checked,
    # its prices still are.
    check_run_pool(cfg_for(path, "workers.check_endpoints=false"))
    with pytest.raises(PoolCheckError, match="worker_2 .*has no price"):
        check_run_pool(cfg_for(channels(tmp_path, sim, server.url, prices=unpriced_worker_2()),
                               "workers.check_endpoints=false"))


def test_the_key_never_shows_in_errors_or_logs(tmp_path, sim, loopback, caplog, monkeypatch):
    caplog.set_level(logging.DEBUG)
    # A hostile endpoint echoing the key in its model list: the failure quotes what it
    # serves, with the key removed.
    stub = SimServer(sim, models=[f"echo-{SECRET}"])
    try:
        path = channels(tmp_path, sim, stub.url)
        with pytest.raises(PoolCheckError) as info:
            check_run_pool(cfg_for(path))
    finally:
        stub.close()
    # Sent in the header only, to worker_1's endpoint (the keyless workers' asked apart).
    assert stub.models_auth == [f"Bearer {SECRET}", None]
    assert "worker_1" in str(info.value) and "echo-" in str(info.value)
    assert SECRET not in str(info.value) and SECRET not in caplog.text
    # An unset key names the variable (for every channel the pool needs), never a value.
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(PoolCheckError, match=f"worker_1 .*environment variable {KEY_ENV} is "
                                             "not set"):
        check_run_pool(cfg_for(path, "workers.offered=[worker_2]"))


# ------------------------------------------------------------------------------ C_ref
def test_calibrate_cost_records_the_channel_files_table(tmp_path, sim, capsys):
    path = channels(tmp_path, sim, "http://127.0.0.1:9/v1")
    dump = tmp_path / "dump.jsonl"
    rows = [{"cost_usd": c, "infra_failed": 0, "cost_complete": 1} for c in (0.1, 0.2)]
    dump.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # A C_ref is only meaningful under a named table: a file without a version is refused.
    assert main(["calibrate-cost", str(dump), "--channels", str(path)]) == 2
    assert "no price_table_version" in capsys.readouterr().err
    data = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({"price_table_version": "custom-1", **data}))
    out = tmp_path / "cost_ref.json"
    assert main(["calibrate-cost", str(dump), "--channels", str(path), "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["price_table_version"] == "custom-1"
    assert record["prices"]["worker_7"] == {"model": None, "in": CUSTOM[0], "out": CUSTOM[1]}
    # Rows billed at another table are refused.
    dump.write_text(json.dumps({**rows[0], "price_table_version": "fixed-reference-2026-09-20"})
                    + "\n")
    assert main(["calibrate-cost", str(dump), "--channels", str(path)]) == 2
    assert "is not the billing table's 'custom-1'" in capsys.readouterr().err
