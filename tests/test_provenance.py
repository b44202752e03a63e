"""`rl.run.provenance`: what run.json records so a run can be traced (code, config, input files)."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

from jax_routeweaver.rl.run import provenance as prov
from jax_routeweaver.rl.run.train_config import load_train_config

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"


def test_file_hash_is_the_sha256_of_its_bytes(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"x" * (3 << 20) + b"tail")  # more than one read chunk
    assert prov.file_sha256(path) == {"path": str(path), "bytes": (3 << 20) + 4,
                                      "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def test_config_hash_follows_the_resolved_config_only():
    a = load_train_config(QUICKSTART)
    assert prov.config_sha256(a) == prov.config_sha256(load_train_config(QUICKSTART))
    assert prov.config_sha256(a) != prov.config_sha256(load_train_config(QUICKSTART,
                                                                         ["optim.lr=0.001"]))


def test_provenance_names_the_commit_and_hashes_every_input_file(tmp_path):
    cfg = load_train_config(QUICKSTART)
    record = prov.provenance(cfg)
    assert record["files"] == []  # synthetic questions, simulated workers: nothing to hash
    assert record["config_sha256"] == prov.config_sha256(cfg)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True)
    if head.returncode == 0:  # the tests run from a checkout (CI: a fresh clone)
        assert record["project"]["commit"] == head.stdout.strip()
        assert isinstance(record["project"]["dirty"], bool)
    assert prov.git_state(tmp_path) == (None, None)  # not a checkout

    data = tmp_path / "train.jsonl"
    data.write_text('{"x": 1}\n')
    channels = tmp_path / "channels.yaml"
    channels.write_text("workers: []\n")
    cost = tmp_path / "cost_ref.json"
    cost.write_text('{"c_ref": 0.001}\n')
    cfg = load_train_config(QUICKSTART, [f"data.source={data}", f"workers.pool={channels}",
                                         f"reward.c_ref={cost}"])
    files = prov.provenance(cfg)["files"]
    assert [f["path"] for f in files] == [str(data), str(channels), str(cost)]
    assert files[0]["sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()
