"""RouteWeaver observations: exact framing strings, the token budget and head+tail truncation."""

from __future__ import annotations

import pytest

from jax_routeweaver.models.tokenizer import build_qwen3_tokenizer
from jax_routeweaver.routing.protocol.grammar import (
    OBS_TRUNCATION_MARKER,
    PAPER_OBSERVATION_CAP,
    Mode,
    ProtocolConfig,
    Role,
    chat_delta,
    forced_declaration_text,
    inline_env_text,
)
from jax_routeweaver.routing.protocol.observations import (
    ObservationBlock,
    agentic_observation,
    frame_observation,
    observation_ids,
    observation_share,
    single_multi_observation,
    truncate_block_ids,
    turn_observation_budget,
)
from jax_routeweaver.routing.protocol.turns import Node

CFG = ProtocolConfig()


def chars(text: str) -> list[int]:
    """A one-token-per-character codec: token counts are string lengths."""
    return [ord(c) for c in text]


def text_of(ids: list[int]) -> str:
    return "".join(map(chr, ids))


@pytest.fixture(scope="session")
def qwen3(tmp_path_factory):
    return build_qwen3_tokenizer(cache_dir=tmp_path_factory.getbasetemp() / "qwen3_cache")


# ----------------------------------------------------------------------------------- framing
def test_single_multi_observation_framing_is_exact() -> None:
    obs = single_multi_observation("  Iron melts at 1538 °C.\n")
    assert obs.text == "\n\n<observation>Iron melts at 1538 °C.</observation>\n\n"
    assert single_multi_observation("").text == "\n\n<observation></observation>\n\n"


def test_agentic_observation_framing_is_exact() -> None:
    nodes = [Node("n3", 2, "worker_3", "a", Role.EXECUTOR, output=" 42 \n"),
             Node("n4", 2, "worker_6", "b", Role.VERIFIER, output=""),
             Node("n5", 2, "worker_1", "c", Role.PLANNER, output="plan")]
    assert agentic_observation(nodes).text == (
        '\n<observation id="n3" role="executor">42</observation>\n\n'
        '<observation id="n4" role="verifier"></observation>\n\n'
        '<observation id="n5" role="planner">plan</observation>\n')
    assert agentic_observation(nodes[:1]).text == (
        '\n<observation id="n3" role="executor">42</observation>\n')


def test_frame_observation_by_mode() -> None:
    node = Node("n1", 1, "worker_1", "t", output=" x ")
    assert frame_observation(Mode.SINGLE, [node]).text == "\n\n<observation>x</observation>\n\n"
    agentic = Node("n1", 1, "worker_1", "t", Role.EXECUTOR, output="y")
    assert frame_observation(Mode.AGENTIC, [agentic]).text == (
        '\n<observation id="n1" role="executor">y</observation>\n')
    with pytest.raises(ValueError):
        frame_observation(Mode.MULTI, [node, node])


def test_chat_delta_and_forced_declaration_are_exact() -> None:
    assert chat_delta("Routing state:") == (
        "<|im_end|>\n<|im_start|>user\nRouting state:<|im_end|>\n<|im_start|>assistant\n")
    assert forced_declaration_text(Mode.MULTI, CFG) == (
        "<|im_end|>\n<|im_start|>user\n<mode>multi</mode><|im_end|>\n<|im_start|>assistant\n")
    assistant = ProtocolConfig(forced_declaration="assistant_text")
    assert forced_declaration_text(Mode.AGENTIC, assistant) == "<mode>agentic</mode>"
    assert inline_env_text("cue") == "\n\ncue\n\n"


@pytest.mark.slow
def test_chat_delta_tokenizes_to_special_tokens(qwen3) -> None:
    ids = qwen3.encode(chat_delta("hi"), add_special_tokens=False)
    im_start, im_end = qwen3.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids[0] == im_end and ids.count(im_start) == 2 and ids.count(im_end) == 2
    assert qwen3.decode(ids) == chat_delta("hi")


# ------------------------------------------------------------------------------------ budgets
def test_dynamic_turn_budget() -> None:
    assert turn_observation_budget(0, CFG) == 4096  # capped
    assert turn_observation_budget(16384 - 1024 - 4096, CFG) == 4096
    assert turn_observation_budget(16384 - 1024 - 300, CFG) == 300
    assert turn_observation_budget(16384 - 1024, CFG) == 0  # obs_budget_exhausted
    assert turn_observation_budget(20000, CFG) == 0


def test_fixed_observation_cap_option() -> None:
    paper = ProtocolConfig(observation_cap=PAPER_OBSERVATION_CAP)
    assert PAPER_OBSERVATION_CAP == 2048
    assert turn_observation_budget(0, paper) == 2048
    assert turn_observation_budget(16000, paper) == 2048


def test_observation_share_split_and_floor() -> None:
    assert observation_share(4096, 1, Mode.SINGLE, CFG) == 4096
    assert observation_share(100, 1, Mode.MULTI, CFG) == 100  # whole turn budget, no floor
    assert observation_share(4096, 3, Mode.AGENTIC, CFG) == 1365
    assert observation_share(4096, 16, Mode.AGENTIC, CFG) == 256
    assert observation_share(4096, 17, Mode.AGENTIC, CFG) == 256  # floor: may exceed the turn
    assert observation_share(300, 1, Mode.AGENTIC, CFG) == 300
    assert observation_share(100, 1, Mode.AGENTIC, CFG) == 256


# --------------------------------------------------------------------------------- truncation
def test_block_that_fits_is_untouched() -> None:
    block = ObservationBlock("short body")
    ids, truncated, dropped = truncate_block_ids(block, len(block.text), chars)
    assert (text_of(ids), truncated, dropped) == (block.text, False, 0)


def test_head_tail_truncation_exact() -> None:
    body = "".join(chr(ord("a") + i % 26) for i in range(1000))
    block = ObservationBlock(body, "n1", "executor")
    budget = 200
    ids, truncated, dropped = truncate_block_ids(block, budget, chars)
    out = text_of(ids)
    room = budget - len(block.open_tag) - len("</observation>") - len(OBS_TRUNCATION_MARKER)
    tail, head = room // 2, room - room // 2
    assert out == (block.open_tag + body[:head] + OBS_TRUNCATION_MARKER + body[-tail:]
                   + "</observation>")
    assert len(ids) == budget and truncated and dropped == 1000 - room
    assert OBS_TRUNCATION_MARKER == "\n\n... [observation truncated] ...\n\n"


def test_tail_fraction_moves_the_split() -> None:
    block = ObservationBlock("x" * 50 + "y" * 50)
    ids, _, _ = truncate_block_ids(block, 90, chars, tail_fraction=0.0)
    assert text_of(ids).endswith(OBS_TRUNCATION_MARKER + "</observation>")
    ids, _, _ = truncate_block_ids(block, 90, chars, tail_fraction=1.0)
    assert text_of(ids).startswith("<observation>" + OBS_TRUNCATION_MARKER)


def test_budget_too_small_for_tags_gives_balanced_empty_tags() -> None:
    block = ObservationBlock("body " * 20, "n2", "summarizer")
    for budget in (0, 5, len(block.open_tag) + 14 + len(OBS_TRUNCATION_MARKER)):
        ids, truncated, dropped = truncate_block_ids(block, budget, chars)
        assert text_of(ids) == block.open_tag + "</observation>"
        assert truncated and dropped == len(block.body)


def test_observation_ids_cut_each_block_and_keep_separators() -> None:
    nodes = [Node(f"n{k}", 1, "worker_1", "t", Role.EXECUTOR, output=str(k) * 600)
             for k in (1, 2)] + [Node("n3", 1, "worker_2", "t", Role.EXECUTOR, output="ok")]
    obs = agentic_observation(nodes)
    share = observation_share(600, 3, Mode.AGENTIC, CFG)
    assert share == 256
    result = observation_ids(obs, share, chars, CFG)
    text = text_of(result.ids)
    assert (result.blocks, result.truncated) == (3, 2)
    assert text.startswith('\n<observation id="n1" role="executor">111')
    assert text.endswith('\n\n<observation id="n3" role="executor">ok</observation>\n')
    assert text.count(OBS_TRUNCATION_MARKER) == 2
    per_block_room = (256 - len('<observation id="n1" role="executor">') - 14
                      - len(OBS_TRUNCATION_MARKER))
    assert result.dropped_tokens == 2 * (600 - per_block_room)
    assert len(result.ids) == 1 + 256 + 2 + 256 + 2 + len(obs.blocks[2].text) + 1


def test_truncation_in_qwen3_token_space(qwen3) -> None:
    encode = lambda s: qwen3.encode(s, add_special_tokens=False)
    body = " ".join(f"step {i}: the value is {i * i}." for i in range(400))
    block = ObservationBlock(body, "n1", "executor")
    budget = 300
    ids, truncated, dropped = truncate_block_ids(block, budget, encode)
    assert truncated and len(ids) == budget
    text = qwen3.decode(ids)
    assert text.startswith('<observation id="n1" role="executor">step 0: the value is 0.')
    assert text.endswith("step 399: the value is 159201.</observation>")
    assert text.count(OBS_TRUNCATION_MARKER) == 1
    head, tail = text[len(block.open_tag):-len("</observation>")].split(OBS_TRUNCATION_MARKER)
    assert body.startswith(head) and body.endswith(tail)
    assert dropped == len(encode(body)) - (budget - len(encode(block.open_tag))
                                           - len(encode("</observation>"))
                                           - len(encode(OBS_TRUNCATION_MARKER)))
    # single/multi turn: separators whole, the block within the turn budget
    obs = single_multi_observation(body)
    result = observation_ids(obs, budget, encode, CFG)
    assert qwen3.decode(result.ids).startswith("\n\n<observation>step 0")
    assert qwen3.decode(result.ids).endswith("</observation>\n\n")
    assert len(result.ids) == budget + 2 * len(encode("\n\n"))
