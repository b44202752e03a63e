"""The README's plan table: the whole-step search's results (``StepPlan.as_dict()`` records)
as Markdown, the search that makes them from a target's trainer figures, and the marked block
of a page that holds it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from jax_routeweaver.models.config import ModelConfig
from jax_routeweaver.planning import step as sp
from jax_routeweaver.planning.memory import TARGETS
from jax_routeweaver.planning.rollout import RolloutSettings, RolloutShape, replica_dtype

BLOCK_BEGIN = "<!-- plan-table:begin -->"
BLOCK_END = "<!-- plan-table:end -->"
ENGINE_NAMES = {"dense": "jax, dense KV", "paged": "jax, paged KV", "vllm": "vLLM co-located"}


def engine_name(choice: Mapping[str, Any]) -> str:
    """A table's name for a ``StepPlan.as_dict()``'s engine."""
    if choice["engine"] != "vllm":
        return ENGINE_NAMES[choice["engine"]]
    return "vLLM co-located, " + ("sleeps in the update" if choice["time_shared"] else "awake")


def markdown_table(choices: Sequence[Mapping[str, Any]]) -> str:
    """The README's table of ``search`` results (``StepPlan.as_dict()`` records)."""
    lines = ["| target | rollout engine | trainer | rollout settings | update / reference / "
             "rollout phase (GiB per device) | need / limit | fits | full rows in flight |",
             "|---|---|---|---|---|---|---|---|"]
    for c in choices:
        p = c["phases_gib"]
        fits, rows = ("**yes**", str(c["full_rows"])) if c["fits"] else ("no", "—")
        lines.append(
            f"| {c['target']} | {engine_name(c)} | {c['trainer']} | "
            f"{c['rollout_settings']} | {p['update']:.1f} / {p['reference']:.1f} / "
            f"{p['rollout']:.1f} | {c['need_gib']:.1f} / {c['limit_gib']:.1f} | {fits} | "
            f"{rows} |")
    return "\n".join(lines) + "\n"


def search_choices(name: str, cfg: Any, arch: ModelConfig,
                   trainers: Sequence[sp.TrainFigures]) -> list[dict[str, Any]]:
    """The whole-step search's choices (``StepPlan.as_dict()``) for target ``name`` of
    :data:`TARGETS` from its trainer figures, the train config ``cfg`` and the router's
    ``arch``: the rollout engines' formulas, no compiles (milliseconds)."""
    target = TARGETS[name]
    plans = sp.search(target, trainers, arch.replace(dtype=cfg.model.dtype),
                      RolloutShape.of_config(cfg, target.hosts), replica_dtype(cfg),
                      RolloutSettings.of_config(cfg), min_rows=cfg.data.group_size)
    return [p.as_dict() for p in plans]


def record_table(record: Mapping[str, Any]) -> str:
    """:func:`markdown_table` of a ``bench/plan_targets.py`` record (``{"targets": {name:
    {"choices": [...]}}}``), targets in :data:`TARGETS` order."""
    targets = record.get("targets", {})
    return markdown_table([c for name in TARGETS if name in targets
                           for c in targets[name].get("choices", [])])


def replace_block(text: str, table: str) -> str:
    """``text`` with what lies between :data:`BLOCK_BEGIN` and :data:`BLOCK_END` replaced by
    ``table`` (ValueError when the markers are missing or out of order)."""
    found = re.search(re.escape(BLOCK_BEGIN) + r"\n(.*?)" + re.escape(BLOCK_END), text, re.S)
    if found is None:
        raise ValueError(f"no {BLOCK_BEGIN} ... {BLOCK_END} block")
    return text[:found.start(1)] + table + text[found.end(1):]


def read_block(text: str) -> str:
    """What lies between the markers (ValueError when missing)."""
    found = re.search(re.escape(BLOCK_BEGIN) + r"\n(.*?)" + re.escape(BLOCK_END), text, re.S)
    if found is None:
        raise ValueError(f"no {BLOCK_BEGIN} ... {BLOCK_END} block")
    return found.group(1)

