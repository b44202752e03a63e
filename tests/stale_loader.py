"""A vLLM worker extension for tests: a weight reload that silently does not take effect.

While the file named by `$ROUTEWEAVER_TEST_STALE_FLAG` exists, `StaleableLoader` reports the
checksums of exactly what it was handed, as the real loader does, but leaves the served
weights as they were: the failure the sync's probe exists for (vLLM's stock reload once left a
tied head on its old weights this way). Loaded by a real vLLM server through
`--worker-extension-cls stale_loader.StaleableLoader` with `tests/` on its PYTHONPATH.
"""

from __future__ import annotations

import os
from typing import Any

from jax_routeweaver.models.config import ModelConfig
from jax_routeweaver.sampling.vllm_worker_ext import PolicyWeightLoader, checksums

FLAG = "ROUTEWEAVER_TEST_STALE_FLAG"


class StaleableLoader(PolicyWeightLoader):
    def _reload(self, cfg: ModelConfig, arrays: list, read_s: float) -> dict[str, Any]:
        flag = os.environ.get(FLAG)
        if not (flag and os.path.exists(flag)):
            return super()._reload(cfg, arrays, read_s)
        copied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
        sums = checksums((name, a) for name, a in arrays if name not in copied)
        return {"tensors": len(sums), "checksums": sums, "read_s": read_s, "load_s": 0.0}
