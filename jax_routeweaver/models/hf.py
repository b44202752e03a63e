"""Hugging Face safetensors <-> `Qwen3` parameters, both directions from one table.

`TENSOR_MAP` names every HF tensor, the parameter it becomes, and how its layout changes.
HF Linear weights are `[out, in]`; ours are `[*in_dims, *out_dims]` (e.g. q_proj `[D, N, H]`,
o_proj `[N, H, D]`), so the transform is "transpose then reshape" one way and its exact inverse
the other; HF Linear biases are `[out]`, ours `[*out_dims]` (Qwen2's q_proj bias `[N, H]`), a
reshape. A round trip is bit-identical. Each rule applies to the configs its `when` names
(Qwen3's q/k-norm, Qwen2's q/k/v biases, an untied head).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jax_routeweaver.models.config import ModelConfig
from jax_routeweaver.models.qwen3 import Qwen3
from jax_routeweaver.models.sharding import TRAIN_RULES, Rules, param_specs, to_host

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "chat_template.jinja", "added_tokens.json")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: its tensors do not match the config (missing, extra,
    wrong shape), or its files are missing, truncated or corrupt. The message is one line
    naming the checkpoint path (the CLI prints it as is)."""


@dataclasses.dataclass(frozen=True)
class TensorRule:
    """HF tensor `hf` (with `{i}` for the layer) <-> parameter `path`.

    `in_dims`: 0 copies the array as is; k > 0 means an HF Linear `[out, in]` whose `in` is the
    product of our first k dims (ours = hf.T reshaped). `flat`: HF stores our array as one
    vector (a Linear bias `[out]`; ours = hf reshaped).
    """

    hf: str
    path: tuple[str, ...]
    in_dims: int = 0
    when: str = "always"  # "always" | "qk_norm" | "qkv_bias" | "untied"
    flat: bool = False

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf

    def hf_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
        if self.flat:
            return (math.prod(ours),)
        if not self.in_dims:
            return ours
        return (math.prod(ours[self.in_dims:]), math.prod(ours[:self.in_dims]))

    def to_ours(self, a: np.ndarray, ours: tuple[int, ...]) -> np.ndarray:
        if self.flat:
            return a.reshape(ours)
        return a.T.reshape(ours) if self.in_dims else a

    def to_hf(self, a: np.ndarray) -> np.ndarray:
        if self.flat:
            return np.ascontiguousarray(a).reshape(-1)
        if not self.in_dims:
            return a
        return np.ascontiguousarray(a.reshape(math.prod(a.shape[:self.in_dims]), -1).T)


_ATTN = "model.layers.{i}.self_attn."
_MLP = "model.layers.{i}.mlp."
TENSOR_MAP: tuple[TensorRule, ...] = (
    TensorRule("model.embed_tokens.weight", ("embed",)),
    TensorRule("model.layers.{i}.input_layernorm.weight", ("layers", "attn_norm")),
    TensorRule(_ATTN + "q_proj.weight", ("layers", "q_proj"), in_dims=1),
    TensorRule(_ATTN + "q_proj.bias", ("layers", "q_bias"), when="qkv_bias", flat=True),
    TensorRule(_ATTN + "k_proj.weight", ("layers", "k_proj"), in_dims=1),
    TensorRule(_ATTN + "k_proj.bias", ("layers", "k_bias"), when="qkv_bias", flat=True),
    TensorRule(_ATTN + "v_proj.weight", ("layers", "v_proj"), in_dims=1),
    TensorRule(_ATTN + "v_proj.bias", ("layers", "v_bias"), when="qkv_bias", flat=True),
    TensorRule(_ATTN + "o_proj.weight", ("layers", "o_proj"), in_dims=2),
    TensorRule(_ATTN + "q_norm.weight", ("layers", "q_norm"), when="qk_norm"),
    TensorRule(_ATTN + "k_norm.weight", ("layers", "k_norm"), when="qk_norm"),
    TensorRule("model.layers.{i}.post_attention_layernorm.weight", ("layers", "mlp_norm")),
    TensorRule(_MLP + "gate_proj.weight", ("layers", "gate_proj"), in_dims=1),
    TensorRule(_MLP + "up_proj.weight", ("layers", "up_proj"), in_dims=1),
    TensorRule(_MLP + "down_proj.weight", ("layers", "down_proj"), in_dims=1),
    TensorRule("model.norm.weight", ("final_norm",)),
    TensorRule("lm_head.weight", ("lm_head",), in_dims=1, when="untied"),
)
_TIED_HEAD = "lm_head.weight"


def active_rules(cfg: ModelConfig) -> list[TensorRule]:
    """The rules that apply to this config (q/k-norm only for Qwen3, q/k/v biases only for
    Qwen2, lm_head only untied)."""
    keep = {"always": True, "qk_norm": cfg.qk_norm, "qkv_bias": cfg.qkv_bias,
            "untied": not cfg.tie_word_embeddings}
    return [r for r in TENSOR_MAP if keep[r.when]]


def hf_names(rule: TensorRule, cfg: ModelConfig) -> list[str]:
    if rule.per_layer:
        return [rule.hf.format(i=i) for i in range(cfg.num_layers)]
    return [rule.hf]


# --------------------------------------------------------------------------------- reading
class SafetensorsReader:
    """Tensor name -> file for a single-file or index-sharded HF checkpoint directory."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self._handles: dict[Path, Any] = {}
        index = self.dir / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
            self.files = {name: self.dir / f for name, f in weight_map.items()}
        elif (self.dir / SINGLE_FILE).is_file():
            f = self.dir / SINGLE_FILE
            self.files = {name: f for name in self._open(f).keys()}  # noqa: SIM118
        else:
            raise FileNotFoundError(f"{self.dir}: neither {SINGLE_FILE} nor {INDEX_FILE}")

    def _open(self, f: Path):
        if f not in self._handles:
            if not f.is_file():
                raise FileNotFoundError(f"{f}: listed in {INDEX_FILE} but missing")
            try:
                self._handles[f] = safe_open(str(f), framework="numpy")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{f}: corrupt or unreadable safetensors file ({e})") from e
        return self._handles[f]

    def names(self) -> set[str]:
        return set(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self.files[name]).get_slice(name).get_shape())

    def get(self, name: str) -> np.ndarray:
        f = self.files[name]
        try:
            return self._open(f).get_tensor(name)
        except SafetensorError as e:
            raise CheckpointError(f"{f}: cannot read tensor {name!r} ({e})") from e


def load_hf(path: str | Path, *, mesh: Mesh | None = None, rules: Rules = TRAIN_RULES,
            dtype: str | None = None, **runtime: Any) -> Qwen3:
    """Load an HF Qwen3/Qwen2/Llama checkpoint directory into a `Qwen3`.

    With `mesh`, each parameter is placed straight into its sharded layout by `rules` (each
    device receives only its shard). `dtype` sets the parameter dtype (default float32);
    `runtime` passes `ModelConfig` runtime options (scan_layers, remat, dtype of compute as
    `compute_dtype`). Raises CheckpointError naming the tensor for a missing tensor, an
    unmapped extra tensor, or a shape mismatch.
    """
    path = Path(path)
    compute = runtime.pop("compute_dtype", None)
    cfg = ModelConfig.from_hf(path, param_dtype=dtype or "float32",
                              dtype=compute or dtype or "float32", **runtime)
    reader = SafetensorsReader(path)
    abstract = nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0)))
    specs = param_specs(abstract, rules, mesh) if mesh is not None else {}
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    target = jnp.dtype(cfg.param_dtype)

    expected = {n for r in active_rules(cfg) for n in hf_names(r, cfg)}
    missing = sorted(expected - reader.names())
    if missing:
        raise CheckpointError(f"{path}: missing tensor(s) {missing[:8]}"
                              f"{' ...' if len(missing) > 8 else ''} for {cfg.architecture}")
    extra = sorted(reader.names() - expected)
    if extra == [_TIED_HEAD] and cfg.tie_word_embeddings:
        # Some tied checkpoints still store the head; accept it only if it is the embedding.
        if not np.array_equal(reader.get(_TIED_HEAD), reader.get("model.embed_tokens.weight")):
            raise CheckpointError(f"{path}: tie_word_embeddings=true but {_TIED_HEAD} differs "
                                  "from model.embed_tokens.weight")
        extra = []
    if extra:
        raise CheckpointError(f"{path}: unmapped tensor(s) {extra[:8]}"
                              f"{' ...' if len(extra) > 8 else ''}")

    for rule in active_rules(cfg):
        var = flat[rule.path]
        shape = tuple(var.shape)
        one = shape[1:] if rule.per_layer else shape
        parts = []
        for name in hf_names(rule, cfg):
            got = reader.shape(name)
            want = rule.hf_shape(one)
            if got != want:
                raise CheckpointError(f"{path}: tensor {name!r} has shape {list(got)}, "
                                      f"expected {list(want)}")
            parts.append(rule.to_ours(reader.get(name), one).astype(target))
        host = np.stack(parts) if rule.per_layer else parts[0]
        if mesh is None:
            var.set_value(jnp.asarray(host))
        else:
            sharding = NamedSharding(mesh, specs[rule.path])
            var.set_value(jax.make_array_from_callback(shape, sharding, lambda i, a=host: a[i]))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


# --------------------------------------------------------------------------------- writing
def hf_tensors(model: Qwen3, *, untie: bool = False,
               dtype: str | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, host array) for every tensor of `model`, in TENSOR_MAP order."""
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    return hf_arrays(lambda path: to_host(flat[path][...]), model.config, untie=untie,
                     dtype=dtype)


def hf_arrays(param: Callable[[tuple[str, ...]], np.ndarray], cfg: ModelConfig, *,
              untie: bool = False, dtype: str | None = None
              ) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, array) for every tensor, in TENSOR_MAP order, from `param(path)`: the host
    array of our parameter at `path` (e.g. read from an orbax policy step)."""
    cast = np.dtype(jnp.dtype(dtype)) if dtype else None
    for rule in active_rules(cfg):
        host = param(rule.path)
        if cast is not None:
            host = host.astype(cast)
        if rule.per_layer:
            for i, name in enumerate(hf_names(rule, cfg)):
                yield name, rule.to_hf(host[i])
        else:
            yield rule.hf, rule.to_hf(host)
    if untie and cfg.tie_word_embeddings:
        embed = param(("embed",))
        yield _TIED_HEAD, (embed.astype(cast) if cast is not None else embed).copy()


def save_hf(model: Qwen3, path: str | Path, *, tokenizer: Any = None,
            max_shard_bytes: int = 2 * 1024**3, untie: bool = False,
            dtype: str | None = None) -> Path:
    """Write an HF checkpoint directory that `AutoModelForCausalLM.from_pretrained` loads.

    Writes config.json, generation_config.json, safetensors (one `model.safetensors`, or
    `model-0000k-of-0000n.safetensors` plus `model.safetensors.index.json` when the tensors
    exceed `max_shard_bytes`), and the tokenizer (an HF tokenizer object, or a directory whose
    tokenizer files are copied). Tied embeddings are written as tied (no lm_head.weight) unless
    `untie=True`. On multi-host only process 0 writes.
    """
    path = Path(path)
    cfg = model.config
    tensors = list(hf_tensors(model, untie=untie, dtype=dtype))
    if jax.process_index() != 0:
        return path
    path.mkdir(parents=True, exist_ok=True)
    for stale in [*path.glob("model*.safetensors"), path / INDEX_FILE]:
        stale.unlink(missing_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, a in tensors:
        if shards[-1] and size + a.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = a
        size += a.nbytes
    if len(shards) == 1:
        save_file(shards[0], str(path / SINGLE_FILE), metadata={"format": "pt"})
    else:
        weight_map = {}
        for k, shard in enumerate(shards, 1):
            fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(path / fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, fname))
        index = {"metadata": {"total_size": sum(a.nbytes for _, a in tensors)},
                 "weight_map": dict(sorted(weight_map.items()))}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    hf_config = cfg.to_hf()
    hf_config["dtype"] = dtype or cfg.param_dtype
    if untie:
        hf_config["tie_word_embeddings"] = False
    (path / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    generation = {k: getattr(cfg, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                  if getattr(cfg, k) is not None}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if tokenizer is not None:
        _write_tokenizer(tokenizer, path)
    return path


def tokenizer_files(src: str | Path) -> list[Path]:
    """The HF tokenizer files in `src`; FileNotFoundError unless it has tokenizer.json or
    tokenizer_config.json."""
    src = Path(src)
    files = [src / f for f in TOKENIZER_FILES if (src / f).is_file()]
    if not any(f.name in ("tokenizer.json", "tokenizer_config.json") for f in files):
        raise FileNotFoundError(f"{src}: no tokenizer files (tokenizer.json or "
                                "tokenizer_config.json)")
    return files


def _write_tokenizer(tokenizer: Any, path: Path) -> None:
    if isinstance(tokenizer, str | os.PathLike):
        for f in tokenizer_files(tokenizer):
            if f.resolve() != (path / f.name).resolve():
                shutil.copyfile(f, path / f.name)
    else:
        tokenizer.save_pretrained(str(path))
