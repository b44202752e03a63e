"""Observation turns: the `<observation>` blocks that frame what the workers returned, and the
token budget they are cut to, per block, head + tail around a fixed marker (docs/protocol.md,
"Observations").

Pure: the caller passes the tokenizer's `encode`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from jax_routeweaver.routing.protocol.grammar import (
    OBS_TRUNCATION_MARKER,
    OBSERVATION_CLOSE,
    Mode,
    ProtocolConfig,
)
from jax_routeweaver.routing.protocol.turns import Node

Encode = Callable[[str], Sequence[int]]


# ------------------------------------------------------------------------ observation framing
@dataclasses.dataclass(frozen=True)
class ObservationBlock:
    """One `<observation …>BODY</observation>`; `node_id`/`role` only in agentic mode."""

    body: str
    node_id: str | None = None
    role: str | None = None

    @property
    def open_tag(self) -> str:
        if self.node_id is None:
            return "<observation>"
        return f'<observation id="{self.node_id}" role="{self.role}">'

    @property
    def text(self) -> str:
        return self.open_tag + self.body + OBSERVATION_CLOSE


@dataclasses.dataclass(frozen=True)
class ObservationText:
    """The env text of one observation turn: separators (`str`) and blocks, in order."""

    parts: tuple[str | ObservationBlock, ...]

    @property
    def text(self) -> str:
        return "".join(p if isinstance(p, str) else p.text for p in self.parts)

    @property
    def blocks(self) -> tuple[ObservationBlock, ...]:
        return tuple(p for p in self.parts if isinstance(p, ObservationBlock))


def single_multi_observation(body: str) -> ObservationText:
    """`"\\n\\n<observation>" + BODY + "</observation>\\n\\n"`, BODY stripped ("" on failure)."""
    return ObservationText(("\n\n", ObservationBlock(body.strip()), "\n\n"))


def agentic_observation(nodes: Sequence[Node]) -> ObservationText:
    """One `<observation id="nK" role="ROLE">` block per node of the layer, joined by a blank
    line, the whole wrapped in a leading and a trailing `\\n`."""
    parts: list[str | ObservationBlock] = ["\n"]
    for i, node in enumerate(nodes):
        if i:
            parts.append("\n\n")
        parts.append(ObservationBlock(node.output.strip(), node.id, str(node.role)))
    parts.append("\n")
    return ObservationText(tuple(parts))


def frame_observation(mode: Mode, nodes: Sequence[Node]) -> ObservationText:
    """The observation turn for the nodes one dispatched turn produced, framed for `mode`."""
    if mode == Mode.AGENTIC:
        return agentic_observation(nodes)
    (node,) = nodes
    return single_multi_observation(node.output)

# ------------------------------------------------------------------------ observation budget
def turn_observation_budget(used_tokens: int, config: ProtocolConfig) -> int:
    """Tokens the next observation turn may take: `clamp(response_length - used - reserve,
    0, cap)` (dynamic, as the original), or the fixed `observation_cap`. 0 means
    `obs_budget_exhausted`."""
    if config.observation_cap is not None:
        return config.observation_cap
    free = config.response_length - used_tokens - config.obs_reserve
    return max(0, min(config.obs_budget_cap, free))


def observation_share(turn_budget: int, n_blocks: int, mode: Mode,
                      config: ProtocolConfig) -> int:
    """Per-block budget: single/multi get the whole turn budget; an agentic layer splits it,
    `max(obs_min_per_obs, turn_budget // n_blocks)` (so a wide layer may exceed the turn
    budget)."""
    if mode != Mode.AGENTIC:
        return turn_budget
    return max(config.obs_min_per_obs, turn_budget // max(1, n_blocks))


@dataclasses.dataclass(frozen=True)
class ObservationIds:
    """Token ids of an observation turn and its truncation stats (per-row stats;
    docs/protocol.md, "Observations")."""

    ids: list[int]
    blocks: int
    truncated: int
    dropped_tokens: int


def truncate_block_ids(block: ObservationBlock, budget: int, encode: Encode,
                       tail_fraction: float = 0.5) -> tuple[list[int], bool, int]:
    """`(ids, truncated, dropped_body_tokens)` of one block within `budget` tokens.

    A block that fits is encoded whole. Otherwise the tags are kept and the body becomes
    head + `OBS_TRUNCATION_MARKER` + tail, the tail taking `tail_fraction` of
    `budget - tags - marker`; when that leaves no room, the tags are emitted balanced around
    an empty body (even if they alone exceed `budget`).
    """
    whole = list(encode(block.text))
    if len(whole) <= budget:
        return whole, False, 0
    open_ids, close_ids = list(encode(block.open_tag)), list(encode(OBSERVATION_CLOSE))
    body_ids = list(encode(block.body))
    if len(open_ids) + len(body_ids) + len(close_ids) <= budget:
        return open_ids + body_ids + close_ids, False, 0  # fits once encoded piecewise
    marker_ids = list(encode(OBS_TRUNCATION_MARKER))
    room = budget - len(open_ids) - len(close_ids) - len(marker_ids)
    if room <= 0:
        return open_ids + close_ids, bool(body_ids), len(body_ids)
    tail = int(room * tail_fraction)
    head = room - tail
    tail_ids = body_ids[len(body_ids) - tail:] if tail else []
    return open_ids + body_ids[:head] + marker_ids + tail_ids + close_ids, True, \
        len(body_ids) - room


def observation_ids(observation: ObservationText, share: int, encode: Encode,
                    config: ProtocolConfig) -> ObservationIds:
    """Token ids of an observation turn: each block cut to `share` tokens on its own,
    separators encoded whole."""
    ids: list[int] = []
    truncated = dropped = 0
    for part in observation.parts:
        if isinstance(part, str):
            ids += encode(part)
            continue
        block_ids, was_cut, block_dropped = truncate_block_ids(part, share, encode,
                                                               config.obs_tail_fraction)
        ids += block_ids
        truncated += was_cut
        dropped += block_dropped
    return ObservationIds(ids, len(observation.blocks), truncated, dropped)
