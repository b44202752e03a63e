"""`ModelConfig`: the architecture of a Qwen3-, Qwen2- or Llama-family decoder, read from HF
`config.json`.

Every architecture field comes from the checkpoint's own `config.json`; a field we do not
implement (sliding windows, Llama's `attention_bias`, dynamic RoPE, ...) is an error naming it,
never ignored. The three architectures share one decoder and differ only in the attention:
Qwen3 RMS-normalises each query and key head before RoPE (`qk_norm`), Qwen2 adds biases to the
q, k and v projections (`qkv_bias`; o_proj has none), Llama has neither. Runtime choices that
are not part of the checkpoint (dtypes, layer scan, remat, logprob chunking) are separate keyword
arguments with defaults.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "Qwen2ForCausalLM": "qwen2",
                 "LlamaForCausalLM": "llama"}
# (qk_norm, qkv_bias) of each architecture: the only ways their decoders differ.
ATTENTION_FLAGS = {"Qwen3ForCausalLM": (True, False), "Qwen2ForCausalLM": (False, True),
                   "LlamaForCausalLM": (False, False)}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
DTYPES = ("float32", "bfloat16", "float16")

# Keys that describe the file, the tokenizer or generation defaults: they do not change the math.
_METADATA_KEYS = frozenset({
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
    "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "initializer_range",
    "_name_or_path", "name_or_path", "output_attentions", "output_hidden_states", "return_dict",
    "is_encoder_decoder", "tie_encoder_decoder", "chunk_size_feed_forward", "id2label",
    "label2id", "problem_type", "tokenizer_class", "max_window_layers", "_attn_implementation",
    "attn_implementation", "keys_to_ignore_at_inference", "quantization_config_applied",
})
# Keys we read (value checked below).
_ARCH_KEYS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
    "rope_theta", "rope_scaling", "rope_parameters", "tie_word_embeddings", "attention_bias",
    "attention_dropout", "mlp_bias", "pretraining_tp", "use_sliding_window", "sliding_window",
    "layer_types",
})
# Keys whose value must equal the one we implement, else the checkpoint is unsupported.
_REQUIRED_VALUES: dict[str, tuple[Any, ...]] = {
    "hidden_act": ("silu",),
    "attention_bias": (False,),
    "mlp_bias": (False,),
    "attention_dropout": (0, 0.0),
    "pretraining_tp": (1,),
    "use_sliding_window": (False,),
}
_ROPE_KEYS = {
    "default": {"rope_type", "type", "rope_theta"},
    "linear": {"rope_type", "type", "rope_theta", "factor"},
    "llama3": {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"},
    "yarn": {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings",
             "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"},
}


class ConfigError(ValueError):
    """An HF config that is malformed or asks for something we do not implement."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture (from HF) plus runtime options (ours).

    `architecture` is the HF class name (a key of ARCHITECTURES); `qk_norm` and `qkv_bias` must
    be the pair ATTENTION_FLAGS gives it (`from_hf` sets them), else ConfigError naming both:
    they decide which tensors the model has, and the HF export must match its class.

    Each field's comment gives its meaning and valid range; `__post_init__` enforces the
    ranges it can check on its own (a ConfigError naming the field and its value), `from_hf`
    the positivity of the sizes it reads.
    """

    vocab_size: int  # tokens in the embedding and the LM head; >= 1
    hidden_size: int  # model width D; >= 1
    intermediate_size: int  # MLP width; >= 1
    num_layers: int  # decoder layers L; >= 1
    num_heads: int  # query heads; >= 1, a multiple of num_kv_heads
    num_kv_heads: int  # key/value heads (grouped-query attention); divides num_heads
    head_dim: int  # features per head; even (RoPE rotates pairs)
    rope_theta: float = 1_000_000.0  # RoPE base; > 0
    # the RoPE scaling's (key, value) pairs: rope_type (one of ROPE_TYPES) and its parameters
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    rms_norm_eps: float = 1e-6  # RMSNorm's epsilon, added to the mean square
    tie_word_embeddings: bool = False  # the LM head reuses the embedding matrix
    max_position_embeddings: int = 40960  # positions the checkpoint was trained for
    qk_norm: bool = True  # RMS-normalise query and key heads (Qwen3); must match architecture
    qkv_bias: bool = False  # biases on q, k, v projections (Qwen2); must match architecture
    architecture: str = "Qwen3ForCausalLM"  # HF class name, a key of ARCHITECTURES
    bos_token_id: int | None = None  # from config.json; None = not set
    eos_token_id: int | tuple[int, ...] | None = None  # one id or several; None = not set
    pad_token_id: int | None = None  # from config.json; None = not set
    # runtime
    param_dtype: str = "float32"  # master weights; one of DTYPES
    dtype: str = "float32"  # compute; one of DTYPES
    # `lax.scan` over the stacked layers instead of an unrolled loop (same params either way)
    scan_layers: bool = True
    remat: str = "none"  # rematerialisation applied per layer; one of REMAT_POLICIES
    # G >= 1 dividing num_layers; G > 1: the layers run as G checkpointed groups of L/G, so the
    # backward pass keeps G + L/G layer inputs instead of L, for one more forward pass (G near
    # sqrt(L) keeps the fewest)
    remat_groups: int = 1
    # tokens per chunk (>= 1) when computing per-token logprobs without materialising
    # `[B, T, V]`
    logprob_chunk: int = 512
    # queries per block (>= 1) when attention runs block by block: the `[B, N, block, S]`
    # fp32 scores of one block are what long sequences hold at a time
    attention_block: int = 512
    # P >= 1; P > 1: self-attention splits the query blocks into P parts that each read only
    # the keys up to the part's end, (P + 1) / 2P of the attention work for about (P + 1) / 2
    # times the score memory: fast for short rows, 1 for memory-bound long ones
    causal_parts: int = 1

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads={self.num_heads} is not a multiple of "
                              f"num_key_value_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.attention_block < 1 or self.logprob_chunk < 1 or self.causal_parts < 1:
            raise ConfigError(f"attention_block={self.attention_block}, logprob_chunk="
                              f"{self.logprob_chunk} and causal_parts={self.causal_parts} "
                              "must be >= 1")
        if self.remat not in REMAT_POLICIES:
            raise ConfigError(f"remat={self.remat!r}: expected one of {REMAT_POLICIES}")
        if self.remat_groups < 1 or self.num_layers % self.remat_groups:
            raise ConfigError(f"remat_groups={self.remat_groups} must be >= 1 and divide "
                              f"num_layers={self.num_layers}")
        rope_type = self.rope_type
        if rope_type not in ROPE_TYPES:
            raise ConfigError(f"rope_scaling type {rope_type!r} is not supported "
                              f"(supported: {ROPE_TYPES})")
        for name in ("param_dtype", "dtype"):
            if getattr(self, name) not in DTYPES:
                raise ConfigError(f"{name}={getattr(self, name)!r}: expected one of {DTYPES}")
        self._check_attention_flags()

    def _check_attention_flags(self) -> None:
        """The architecture is known and `qk_norm`, `qkv_bias` are its own."""
        if self.architecture not in ATTENTION_FLAGS:
            raise ConfigError(f"architecture={self.architecture!r}: expected one of "
                              f"{sorted(ATTENTION_FLAGS)}")
        qk_norm, qkv_bias = ATTENTION_FLAGS[self.architecture]
        if (self.qk_norm, self.qkv_bias) != (qk_norm, qkv_bias):
            raise ConfigError(f"qk_norm={self.qk_norm}, qkv_bias={self.qkv_bias} do not match "
                              f"architecture {self.architecture} (qk_norm={qk_norm}, "
                              f"qkv_bias={qkv_bias})")

    @property
    def model_type(self) -> str:
        return ARCHITECTURES[self.architecture]

    @property
    def rope_type(self) -> str:
        scaling = dict(self.rope_scaling)
        return scaling.get("rope_type", scaling.get("type", "default"))

    @property
    def param_count(self) -> int:
        """Parameters of a `Qwen3` of this config: the embedding V x D, the LM head V x D
        unless tied, the final norm D, and per layer the attention (q, k, v, o: D x H x
        (2 N + 2 K); q and k norms 2 H; biases H x (N + 2 K)), the MLP 3 D x F and two norms."""
        D, F, H = self.hidden_size, self.intermediate_size, self.head_dim
        N, K = self.num_heads, self.num_kv_heads
        layer = D * H * (2 * N + 2 * K) + 3 * D * F + 2 * D
        layer += 2 * H if self.qk_norm else 0
        layer += H * (N + 2 * K) if self.qkv_bias else 0
        embed = self.vocab_size * D * (1 if self.tie_word_embeddings else 2)
        return embed + D + self.num_layers * layer

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ----------------------------------------------------------------------------- reading
    @classmethod
    def from_hf(cls, source: str | Path | dict[str, Any], **runtime: Any) -> ModelConfig:
        """Build from a checkpoint dir, a `config.json` path, or its parsed dict.

        Raises ConfigError naming the field for unknown or unsupported fields.
        """
        where = "config dict"
        if not isinstance(source, dict):
            path = Path(source)
            path = path / "config.json" if path.is_dir() else path
            where = str(path)
            if not path.is_file():
                raise FileNotFoundError(f"{where}: no config.json")
            try:
                source = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where}: not valid JSON ({e})") from e
        hf = dict(source)
        archs = hf.get("architectures") or []
        if len(archs) != 1 or archs[0] not in ARCHITECTURES:
            raise ConfigError(f"{where}: architectures={archs!r}; supported: "
                              f"{sorted(ARCHITECTURES)}")
        arch = archs[0]
        if hf.get("model_type", ARCHITECTURES[arch]) != ARCHITECTURES[arch]:
            raise ConfigError(f"{where}: model_type={hf['model_type']!r} does not match "
                              f"architecture {arch}")
        unknown = sorted(set(hf) - _METADATA_KEYS - _ARCH_KEYS)
        if unknown:
            raise ConfigError(f"{where}: unsupported config field(s) {unknown}")
        for key, allowed in _REQUIRED_VALUES.items():
            if key in hf and hf[key] not in allowed:
                raise ConfigError(f"{where}: {key}={hf[key]!r} is not supported "
                                  f"(supported: {list(allowed)})")
        layer_types = hf.get("layer_types")
        if layer_types and any(t != "full_attention" for t in layer_types):
            raise ConfigError(f"{where}: layer_types={sorted(set(layer_types))} is not supported "
                              "(only full_attention)")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            if not isinstance(hf.get(key), int) or hf[key] <= 0:
                raise ConfigError(f"{where}: {key}={hf.get(key)!r} must be a positive integer")
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        rope = _read_rope(hf, where)
        qk_norm, qkv_bias = ATTENTION_FLAGS[arch]
        try:
            return cls(
                vocab_size=hf["vocab_size"],
                hidden_size=hf["hidden_size"],
                intermediate_size=hf["intermediate_size"],
                num_layers=hf["num_hidden_layers"],
                num_heads=heads,
                num_kv_heads=hf.get("num_key_value_heads") or heads,
                head_dim=head_dim,
                rope_theta=float(rope.pop("rope_theta")),
                rope_scaling=tuple(sorted(rope.items())),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", arch == "Qwen3ForCausalLM")),
                max_position_embeddings=int(hf.get("max_position_embeddings", 40960)),
                qk_norm=qk_norm,
                qkv_bias=qkv_bias,
                architecture=arch,
                bos_token_id=hf.get("bos_token_id"),
                eos_token_id=_hashable(hf.get("eos_token_id")),
                pad_token_id=hf.get("pad_token_id"),
                **runtime,
            )
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None

    def to_hf(self) -> dict[str, Any]:
        """The `config.json` dict (transformers-5 style `rope_parameters`, plus `rope_theta`).

        Qwen2 has no `attention_bias` field (its q/k/v biases are fixed by the class) and gets
        `use_sliding_window: false` instead."""
        rope = {"rope_type": "default", **dict(self.rope_scaling), "rope_theta": self.rope_theta}
        rope.pop("type", None)
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_cache": True,
            "dtype": self.param_dtype,
        }
        if self.model_type == "qwen2":
            del out["attention_bias"]
            out["use_sliding_window"] = False
        if self.model_type == "llama":
            out["mlp_bias"] = False
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, key)
            if value is not None:
                out[key] = list(value) if isinstance(value, tuple) else value
        return out

    # ----------------------------------------------------------------------------- rope
    def rope_inv_freq(self) -> tuple[np.ndarray, float]:
        """Inverse frequencies `[head_dim // 2]` (float32) and the cos/sin scale, per rope type.

        Matches transformers' `ROPE_INIT_FUNCTIONS` for default, linear, llama3 and yarn.
        """
        dim = self.head_dim
        base = self.rope_theta
        p = dict(self.rope_scaling)
        exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
        inv_freq = 1.0 / (base ** exponents)
        scale = 1.0
        kind = self.rope_type
        if kind == "linear":
            inv_freq = inv_freq / p["factor"]
        elif kind == "llama3":
            factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
            old_len = p["original_max_position_embeddings"]
            wavelen = 2 * math.pi / inv_freq
            scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
            smooth = (old_len / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
            inv_freq = np.where(medium, smoothed, scaled)
        elif kind == "yarn":
            inv_freq, scale = _yarn(p, dim, base)
        return inv_freq.astype(np.float32), float(scale)


def _hashable(value: Any) -> Any:
    """Lists become tuples: the config is a static (hashed) attribute under jit."""
    return tuple(value) if isinstance(value, list) else value


def _read_rope(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """Normalise `rope_parameters` (transformers 5) / `rope_scaling` + `rope_theta` (older)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{where}: rope_parameters/rope_scaling must be an object, got "
                          f"{params!r}")
    rope = dict(params)
    kind = rope.pop("type", None) or rope.get("rope_type") or "default"
    rope["rope_type"] = kind
    if kind not in ROPE_TYPES:
        raise ConfigError(f"{where}: rope type {kind!r} is not supported (supported: "
                          f"{list(ROPE_TYPES)})")
    extra = sorted(set(rope) - _ROPE_KEYS[kind])
    if extra:
        raise ConfigError(f"{where}: rope field(s) {extra} not supported for rope type {kind!r}")
    if kind != "default" and "factor" not in rope:
        raise ConfigError(f"{where}: rope type {kind!r} needs 'factor'")
    if kind == "llama3":
        missing = sorted(_ROPE_KEYS["llama3"] - {"type", "rope_theta"} - set(rope))
        if missing:
            raise ConfigError(f"{where}: rope type 'llama3' needs {missing}")
    if kind == "yarn":
        rope.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    theta = rope.get("rope_theta", hf.get("rope_theta", 10_000.0))
    if not isinstance(theta, int | float) or theta <= 0:
        raise ConfigError(f"{where}: rope_theta={theta!r} must be a positive number")
    rope["rope_theta"] = theta
    if kind == "default":
        rope = {"rope_theta": theta}
    return rope


def _yarn(p: dict[str, Any], dim: int, base: float) -> tuple[np.ndarray, float]:
    factor = p["factor"]
    original = p["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    extrapolation = 1.0 - ramp  # 1: keep the original frequency, 0: interpolate by `factor`
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor
