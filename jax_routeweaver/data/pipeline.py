"""Query batches for training: a deterministic, resumable grain pipeline over `Record`s.

The original code reads its training parquet in order, 32 rows per step, every step holding the
domain census {MATH 7, CODE 7, KNOWLEDGE 7, REASON 6, RECALL 5}, and a row's `batch_index` is
training step − 1. Here that composition is made from any record set:
`plan_batches` gives each domain a (seeded) order and fills batch b with the next quota of
rows from each domain; `QueryPipeline` serves those batches as a `grain.MapDataset`, and its
iterator's state is a small JSON dict that resumes a run at exactly the next batch.

Batch i (0-based position) depends only on the records (their order, sample ids and domains)
and on `batch_size`, `group_size`, `quotas`, `shuffle`, `seed` and `first_index` — not on
`num_batches` or `repeat` — so a run resumed with a larger `num_batches` continues the same
sequence of batches.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import operator
import random
import sys
import types
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import grain

from jax_routeweaver.config import bounded, fields_of
from jax_routeweaver.data.records import FORCED_MODES, Domain, Record

__all__ = [
    "DEFAULT_QUOTAS",
    "BatchSettings",
    "PipelineConfig",
    "QueryBatch",
    "QueryIterator",
    "QueryPipeline",
    "balanced_forced_modes",
    "check_census",
    "plan_batches",
]

# The original's batch census (its launcher's pre-flight check); its order is the order rows take in
# a batch.
DEFAULT_QUOTAS: Mapping[Domain, int] = types.MappingProxyType({
    Domain.MATH: 7, Domain.CODE: 7, Domain.KNOWLEDGE: 7, Domain.REASON: 6, Domain.RECALL: 5,
})

# Bump when the plan for the same inputs changes, so old iterator states are refused.
_PLAN_VERSION = 1


def balanced_forced_modes(sample_ids: Sequence[str], *, salt: str = "forced_mode") -> list[str]:
    """Forced modes for one batch, as counts that differ by at most one (11/11/10 of 32):
    round-robin over the queries ordered by `sha256(salt:sample_id)`, so a query's mode does
    not depend on row order (the original code bakes `forced_mode` into its parquet)."""
    if len(set(sample_ids)) != len(sample_ids):
        raise ValueError("sample_ids of a batch must be unique")
    order = sorted(range(len(sample_ids)), key=lambda i: hashlib.sha256(
        f"{salt}:{sample_ids[i]}".encode()).digest())
    modes = [""] * len(sample_ids)
    for rank, i in enumerate(order):
        modes[i] = FORCED_MODES[rank % len(FORCED_MODES)]
    return modes


def _int(name: str, value: Any, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _domain(key: Any) -> Domain:
    if isinstance(key, Domain):
        return key
    if isinstance(key, str):
        try:
            return Domain(key.strip().upper())
        except ValueError:
            pass
    raise ValueError(f"quotas: unknown domain {key!r}; known: {[d.value for d in Domain]}")


def _normalise_quotas(quotas: Any, batch_size: int | None) -> Mapping[Domain, int]:
    """Quotas keyed by `Domain`, in the given order, checked (sum == batch_size if given)."""
    if not isinstance(quotas, Mapping):
        raise ValueError(f"quotas must be a mapping of domain -> count, got {quotas!r}")
    out: dict[Domain, int] = {}
    for key, count in quotas.items():
        domain = _domain(key)
        if domain in out:
            raise ValueError(f"quotas: domain {domain.value} is given twice")
        out[domain] = _int(f"quotas[{domain.value}]", count, minimum=0)
    total = sum(out.values())
    if batch_size is not None and total != batch_size:
        raise ValueError(f"quotas sum to {total} but batch_size is {batch_size}: "
                         f"{_census_text(out)}")
    return types.MappingProxyType(out)


def _census_text(counts: Mapping[Domain, int]) -> str:
    return "{" + ", ".join(f"{d.value} {n}" for d, n in counts.items()) + "}"


SEED_RANGE = "[0, 4294967295]"  # seeds: uint32


@dataclasses.dataclass(frozen=True)
class BatchSettings:
    """The settings that make query batches, declared once: the training config's ``data``
    section (`rl.run.train_config.DataConfig`) extends them, and `PipelineConfig` adds what
    one pipeline needs besides (`PipelineConfig.of` builds it from them). The defaults are
    the training run's: the paper's batches, in the record file's order."""

    batch_size: int = bounded(32, "[1, inf)")  # queries per batch (one training step)
    group_size: int = bounded(8, "[1, inf)")  # K rollouts per query (the GRPO group)
    # Queries per domain in every batch, in the order they appear in a batch: `Domain` names
    # (any case) -> counts >= 0 summing to `batch_size`; domains left out get 0 and their
    # rows are not used. Empty (or None in `PipelineConfig`): no domain composition, batches
    # are consecutive runs of the (shuffled) record order. Default: the paper's 7/7/7/6/5.
    quotas: dict[str, int] = bounded(  # noqa: RUF009 (a field)
        {d.value: n for d, n in DEFAULT_QUOTAS.items()}, "[0, inf)")
    # Draw rows in a seeded random order (per domain with quotas), each epoch anew, instead
    # of the file order; ``quotas`` empty and ``shuffle`` off reproduce an original parquet.
    shuffle: bool = False
    seed: int = bounded(42, SEED_RANGE)  # shuffle seed: epoch e is shuffled with (seed, e)
    # When an epoch's full batches are used up, start the next epoch, reshuffled (else the
    # records must fill every batch asked for).
    repeat: bool = False


@dataclasses.dataclass(frozen=True)
class PipelineConfig(BatchSettings):
    """How records become query batches: `BatchSettings` (whose fields it takes), with a
    library's defaults for ``shuffle`` (True) and ``seed`` (0), and

    first_index  `batch_index` of the first batch (training step − 1 of the first step);
                 int >= 0 (default 0).
    num_batches  batches to serve; None: every full batch of one epoch (endless with
                 `repeat`). Without `repeat` the records must fill them, else `QueryPipeline`
                 raises naming the domain that runs out. int >= 0 or None (default None).
    """

    shuffle: bool = True
    seed: int = 0
    first_index: int = 0
    num_batches: int | None = None

    @classmethod
    def of(cls, settings: BatchSettings, **extra: Any) -> PipelineConfig:
        """The pipeline of `settings` (empty quotas: none), with `extra` fields set."""
        given = fields_of(settings, BatchSettings)
        return cls(**{**given, "quotas": settings.quotas or None, **extra})

    def __post_init__(self) -> None:
        _int("batch_size", self.batch_size, minimum=1)
        _int("group_size", self.group_size, minimum=1)
        _int("seed", self.seed)
        _int("first_index", self.first_index, minimum=0)
        if self.num_batches is not None:
            _int("num_batches", self.num_batches, minimum=0)
        for name in ("shuffle", "repeat"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.quotas is not None:
            object.__setattr__(self, "quotas", _normalise_quotas(self.quotas, self.batch_size))


@dataclasses.dataclass(frozen=True)
class QueryBatch:
    """The queries of one training step; every record's `batch_index` equals `index`."""

    index: int
    records: tuple[Record, ...]
    group_size: int

    def __post_init__(self) -> None:
        _int("QueryBatch.index", self.index, minimum=0)
        _int("QueryBatch.group_size", self.group_size, minimum=1)
        object.__setattr__(self, "records", tuple(self.records))
        for record in self.records:
            if not isinstance(record, Record) or record.batch_index != self.index:
                raise ValueError(f"QueryBatch {self.index}: every item must be a Record with "
                                 f"batch_index {self.index}, got {record!r:.80}")

    def rollouts(self) -> list[tuple[Record, int]]:
        """(record, k) for k in 0..K-1, query-major: K consecutive entries per query."""
        return [(record, k) for record in self.records for k in range(self.group_size)]

    def domain_counts(self) -> dict[Domain, int]:
        """Queries per domain, every `Domain` present (0 if none), in `Domain` order."""
        counts = collections.Counter(record.domain for record in self.records)
        return {domain: counts[domain] for domain in Domain}


def check_census(batch: QueryBatch | Iterable[Record],
                 quotas: Mapping[Domain | str, int] = DEFAULT_QUOTAS) -> None:
    """Raise ValueError unless the batch (or rows) has exactly `quotas[d]` rows of each domain
    (0 for domains not named) — the original launcher's pre-flight check on the first 32
    rows. The message gives the expected and the found census."""
    expected = dict(_normalise_quotas(quotas, batch_size=None))
    records = batch.records if isinstance(batch, QueryBatch) else tuple(batch)
    found = collections.Counter(record.domain for record in records)
    order = [*expected, *(d for d in Domain if d not in expected)]
    if any(found[d] != expected.get(d, 0) for d in order):
        where = f"batch {batch.index}" if isinstance(batch, QueryBatch) else "rows"
        raise ValueError(f"domain census of {where}: expected "
                         f"{_census_text({d: expected.get(d, 0) for d in order})}, found "
                         f"{_census_text({d: found[d] for d in order})}")


# ------------------------------------------------------------------------------- planning
def _check_records(records: Sequence[Record]) -> None:
    first: dict[str, int] = {}
    for position, record in enumerate(records):
        if not isinstance(record, Record):
            raise ValueError(f"records[{position}] is a {type(record).__name__}, not a Record")
        earlier = first.setdefault(record.sample_id, position)
        if earlier != position:
            # A repeated id would put one query twice in an epoch (and in one GRPO group key).
            raise ValueError(f"records[{earlier}] and records[{position}] share sample_id "
                             f"{record.sample_id!r}")


def _draw_order(positions: list[int], config: PipelineConfig, epoch: int,
                stream: str) -> list[int]:
    if not config.shuffle:
        return positions
    # A string seed goes through SHA-512, so the order is the same in every process
    # (independent of PYTHONHASHSEED).
    rng = random.Random(f"jax_routeweaver.pipeline:{config.seed}:{epoch}:{stream}")
    shuffled = list(positions)
    rng.shuffle(shuffled)
    return shuffled


def plan_batches(records: Sequence[Record], config: PipelineConfig, *,
                 epoch: int = 0) -> list[list[int]]:
    """Every full batch of one epoch, as positions into `records`.

    With quotas: each domain's rows are taken in a (seeded by (seed, epoch), if shuffle)
    order; batch b holds the next `quotas[d]` rows of each domain d, grouped by domain in the
    quotas' order, each group in draw order. The epoch has as many batches as the scarcest
    domain allows; leftover rows wait for a later (reshuffled) epoch. Without quotas: batch b
    is rows b*batch_size .. of the (shuffled) record order. Ignores `num_batches`/`repeat`:
    the pipeline serves batch i from epoch i // len(plan), position i % len(plan). Records'
    own `batch_index` plays no part. ValueError on non-Records or repeated sample ids.
    """
    _int("epoch", epoch, minimum=0)
    _check_records(records)
    if config.quotas is None:
        order = _draw_order(list(range(len(records))), config, epoch, "all")
        size = config.batch_size
        return [order[b * size:(b + 1) * size] for b in range(len(order) // size)]
    quotas = {d: q for d, q in config.quotas.items() if q > 0}
    orders = {d: _draw_order([i for i, r in enumerate(records) if r.domain is d], config,
                             epoch, d.value)
              for d in quotas}
    full = min(len(orders[d]) // q for d, q in quotas.items())
    return [[i for d, q in quotas.items() for i in orders[d][b * q:(b + 1) * q]]
            for b in range(full)]


def _shortfall(records: Sequence[Record], config: PipelineConfig, batches: int) -> str:
    """Which domains (or the whole set) lack rows for `batches` batches of one epoch."""
    if config.quotas is None:
        return f"{len(records)} records, {batches * config.batch_size} needed"
    counts = collections.Counter(record.domain for record in records)
    short = [f"domain {d.value} has {counts[d]} rows, needs {batches * q} ({batches} × {q})"
             for d, q in config.quotas.items() if counts[d] < batches * q]
    return "; ".join(short)


# ------------------------------------------------------------------------------- pipeline
class QueryIterator(grain.DatasetIterator):
    """Yields `QueryBatch`es. State: `{"fingerprint": str, "grain": <grain iterator state>}`,
    plain JSON; `set_state` refuses a state from a pipeline whose batches differ.

    A `grain.DatasetIterator`, so grain's orbax `CheckpointHandler` can save it too.
    """

    def __init__(self, parent: grain.DatasetIterator, fingerprint: str) -> None:
        super().__init__(parent)
        self._fingerprint = fingerprint

    def __next__(self) -> QueryBatch:
        return next(self._parent)

    def get_state(self) -> dict[str, Any]:
        return {"fingerprint": self._fingerprint, "grain": self._parent.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        if not isinstance(state, Mapping) or set(state) != {"fingerprint", "grain"}:
            raise ValueError(f"not a QueryIterator state: {state!r:.200}")
        if state["fingerprint"] != self._fingerprint:
            raise ValueError(
                f"iterator state is from a different pipeline (fingerprint "
                f"{state['fingerprint']!r}, this one {self._fingerprint!r}): the records or "
                "batch_size/group_size/quotas/shuffle/seed/first_index changed")
        self._parent.set_state(state["grain"])

    def __str__(self) -> str:
        return f"QueryIterator(fingerprint={self._fingerprint})"


class QueryPipeline:
    """The query batches of a run: a `grain.MapDataset` of `QueryBatch`es (see module doc).

    `iter(pipeline)` gives a `QueryIterator` from the first batch; `it.get_state()` is a
    JSON-serialisable dict, and a fresh iterator given it by `set_state` yields exactly the
    batches the saved one would have yielded next. `batch(i)` is the i-th batch (0-based
    position; its `index` is `first_index + i`). Raises ValueError if the records cannot fill
    the requested batches (naming the domain that runs out), or a batch at all.
    """

    def __init__(self, records: Iterable[Record], config: PipelineConfig | None = None) -> None:
        self.config = PipelineConfig() if config is None else config
        self._records = tuple(records)
        cfg = self.config
        first = plan_batches(self._records, cfg, epoch=0)
        self._per_epoch = len(first)
        self._cached_plan = (0, first)  # (epoch, plan): batches are read in order
        if cfg.num_batches is not None:
            self._length: int | None = cfg.num_batches
        else:
            self._length = None if cfg.repeat else self._per_epoch
        if cfg.num_batches is not None and not cfg.repeat and cfg.num_batches > self._per_epoch:
            raise ValueError(f"the records fill {self._per_epoch} batches, {cfg.num_batches} "
                             f"requested: {_shortfall(self._records, cfg, cfg.num_batches)} "
                             "(ask for fewer batches or set repeat=True)")
        if self._per_epoch == 0 and cfg.num_batches != 0:
            raise ValueError(f"the records cannot fill a single batch: "
                             f"{_shortfall(self._records, cfg, 1)}")
        self.fingerprint = self._fingerprint()
        # An endless pipeline is a range as long as grain allows; it is never materialised.
        size = sys.maxsize if self._length is None else self._length
        self.dataset: grain.MapDataset = grain.MapDataset.range(size).map(self.batch)

    def _fingerprint(self) -> str:
        cfg = self.config
        content = {
            "version": _PLAN_VERSION,
            "records": [[r.sample_id, r.domain.value] for r in self._records],
            "quotas": None if cfg.quotas is None else [[d.value, q] for d, q in
                                                       cfg.quotas.items()],
            **{name: getattr(cfg, name) for name in
               ("batch_size", "group_size", "shuffle", "seed", "first_index")},
        }
        blob = json.dumps(content, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @property
    def batches_per_epoch(self) -> int:
        return self._per_epoch

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError("an endless pipeline (repeat=True, num_batches=None) has no length")
        return self._length

    def _plan(self, epoch: int) -> list[list[int]]:
        cached_epoch, plan = self._cached_plan
        if cached_epoch != epoch:
            plan = plan_batches(self._records, self.config, epoch=epoch)
            self._cached_plan = (epoch, plan)
        return plan

    def batch(self, i: int) -> QueryBatch:
        """The batch at 0-based position `i` (IndexError outside the pipeline)."""
        i = operator.index(i)  # grain may hand out numpy integers
        if i < 0 or (self._length is not None and i >= self._length):
            raise IndexError(f"batch {i} is outside the pipeline (length {self._length})")
        epoch, position = divmod(i, self._per_epoch)
        index = self.config.first_index + i
        return QueryBatch(
            index=index,
            records=tuple(self._records[row].replace(batch_index=index)
                          for row in self._plan(epoch)[position]),
            group_size=self.config.group_size)

    def __iter__(self) -> QueryIterator:
        # Batches are built from records in memory: prefetch threads would only add GIL
        # contention (grain's own advice for in-memory data), so read in the calling thread.
        options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
        return QueryIterator(self.dataset.to_iter_dataset(options).__iter__(), self.fingerprint)
