"""Benchmark records -> the data files of a paper run (docs/usage.md, "Data"): RouteWeaver's
training, cold-start and evaluation files as the original's, and Router-R1's files as its
upstream data.

Every file draws its rows from `SourcePool`s: the usable records of one source file (see
`sources.py`) in a seeded draw order, handed out front to back, so files drawn from one pool
never share a row. The files take from the pools in the fixed order of `OUTPUTS` (training file,
cold-start pool, evaluation sets, OOD sets, Router-R1 files); `prepare` skips over the rows of
files it is not asked to write, so a file's rows depend on the seed, the counts and the source
files only, never on which other files are written in the same run. Evaluation-type files draw
from a separate held-out copy of a source when one is given (`apps.eval=...`), else from the
same pool after the training rows.

Files (in `out_dir`):
  parquet/routeweaver_train.parquet     `train_batches` batches (100 = 3,200 queries) of
                                        `batch_size` in the domain-quota order, `batch_index`
                                        0.., balanced forced modes per batch (11/11/10 of 32)
  parquet/routeweaver_cold_pool.parquet the cold arm's own `cold_batches` (25) batches, same mix
                                        scaled, disjoint from the training file
  eval/eval_600_free, eval_700_free, eval_triviaqa120_free   the in-distribution sets
  eval/ood_aime149_free, ood_gpqa_diamond198_free, ood_bbh1080_free   out of distribution
  router_r1/train_nh, test_nh           Router-R1's 7,000 + 7,000 NQ/HotpotQA training rows
                                        and 100 + 100 validation rows
Evaluation rows are "free": no batch index, no forced mode.

The training mix: the paper summary gives per-source counts (Omni-MATH 700, SATBench 700,
SuperGPQA 600, APPS 400, PopQA 300, LiveCodeBench 300, TriviaQA 200) with a batch quota of
7/7/6/7/5, while the original launcher asserts 7/7/7/6/5. Where the two disagree the
original code's behaviour is the default, so `REFERENCE_MIX` is the summary's counts with
SuperGPQA (KNOWLEDGE) and SATBench (REASON) sized to that census — 700 and 600; `PAPER_MIX`
with `PAPER_QUOTAS` is the summary as written.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from jax_routeweaver.data.benchmarks import SOURCES
from jax_routeweaver.data.pipeline import (
    DEFAULT_QUOTAS,
    PipelineConfig,
    balanced_forced_modes,
    check_census,
    plan_batches,
)
from jax_routeweaver.data.record_files import BadRows, write_jsonl, write_parquet
from jax_routeweaver.data.records import Domain, Record
from jax_routeweaver.data.sources import SourceStats, load_source

__all__ = [
    "EVAL_SETS",
    "MIXES",
    "OOD_SETS",
    "OUTPUTS",
    "PAPER_MIX",
    "PAPER_QUOTAS",
    "REFERENCE_MIX",
    "ROUTER_R1_FILES",
    "PrepareResult",
    "PreparedFile",
    "SourcePool",
    "SourceSpec",
    "balanced_forced_modes",
    "batch_mix",
    "build_eval_sets",
    "build_ood_sets",
    "build_router_r1_files",
    "build_training_file",
    "order_batches",
    "prepare",
]

REFERENCE_MIX: Mapping[str, int] = types.MappingProxyType({
    "omni_math": 700, "supergpqa": 700, "satbench": 600, "apps": 400, "popqa": 300,
    "livecodebench": 300, "triviaqa": 200})
PAPER_MIX: Mapping[str, int] = types.MappingProxyType({
    "omni_math": 700, "satbench": 700, "supergpqa": 600, "apps": 400, "popqa": 300,
    "livecodebench": 300, "triviaqa": 200})
PAPER_QUOTAS: Mapping[Domain, int] = types.MappingProxyType({
    Domain.MATH: 7, Domain.CODE: 7, Domain.KNOWLEDGE: 6, Domain.REASON: 7, Domain.RECALL: 5})
MIXES: Mapping[str, tuple[Mapping[str, int], Mapping[Domain, int]]] = types.MappingProxyType({
    "reference": (REFERENCE_MIX, DEFAULT_QUOTAS), "paper": (PAPER_MIX, PAPER_QUOTAS)})
TRAIN_BATCHES, COLD_BATCHES = 100, 25

# The original's evaluation sets: set600 = MATH L2-5 + APPS (scored) + SuperGPQA/SATBench/PopQA
# (not scored); set700 = Omni-MATH, LiveCodeBench, TACO (100), SuperGPQA, SATBench,
# SimpleQA-Verified.
EVAL_SETS: Mapping[str, tuple[str, ...]] = types.MappingProxyType({
    "eval_600_free": ("math", "apps", "supergpqa", "satbench", "popqa"),
    "eval_700_free": ("omni_math", "livecodebench", "taco", "supergpqa", "satbench",
                      "simpleqa_verified"),
    "eval_triviaqa120_free": ("triviaqa",),
})
EVAL_COUNT = 120
EVAL_DEFAULT_COUNTS: Mapping[str, int] = types.MappingProxyType({"taco": 100})
OOD_SETS: Mapping[str, tuple[str, int]] = types.MappingProxyType({
    "ood_aime149_free": ("aime", 149), "ood_gpqa_diamond198_free": ("gpqa_diamond", 198),
    "ood_bbh1080_free": ("bbh", 1080)})
ROUTER_R1_FILES: Mapping[str, str] = types.MappingProxyType({
    "train_nh": "train", "test_nh": "test"})
ROUTER_R1_SOURCES = ("nq", "hotpotqa")
OUTPUTS = ("train", "cold_start", "eval", "ood", "router_r1")
TRAIN_FILE, COLD_FILE = "routeweaver_train", "routeweaver_cold_pool"


# ============================================================================ mix and modes
def batch_mix(mix: Mapping[str, int], quotas: Mapping[Domain | str, int],
              batches: int) -> dict[str, int]:
    """Rows per source for `batches` batches: domain d gets `quotas[d] * batches` rows, split
    over the mix's sources of that domain in proportion to their mix counts (largest
    remainder, ties to the source listed first). Exact for the mix's own size: with
    `REFERENCE_MIX` and 100 batches every source gets its count.

    ValueError if a source is unknown, its domain has no quota, or a domain with a quota has
    no source.
    """
    quotas = PipelineConfig(quotas=quotas, batch_size=sum(quotas.values())).quotas
    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
        raise ValueError(f"batches must be a positive integer, got {batches!r}")
    by_domain: dict[Domain, list[str]] = collections.defaultdict(list)
    for name, count in mix.items():
        if name not in SOURCES:
            raise ValueError(f"mix: unknown source {name!r}; known: {sorted(SOURCES)}")
        if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
            raise ValueError(f"mix[{name!r}] must be a positive integer, got {count!r}")
        domain = SOURCES[name].domain
        if not quotas.get(domain):
            raise ValueError(f"mix: source {name!r} is {domain.value}, which has no quota")
        by_domain[domain].append(name)
    out: dict[str, int] = {}
    for domain, quota in quotas.items():
        if quota and not by_domain[domain]:
            raise ValueError(f"mix: domain {domain.value} has quota {quota} but no source")
        names = by_domain[domain]
        total, weight = quota * batches, sum(mix[n] for n in names)
        shares = {n: divmod(mix[n] * total, weight) for n in names}
        counts = {n: q for n, (q, _) in shares.items()}
        by_remainder = sorted(names, key=lambda n: (-shares[n][1], names.index(n)))
        for n in by_remainder[:total - sum(counts.values())]:
            counts[n] += 1
        out.update(counts)
    return {name: out[name] for name in mix}


def order_batches(records: Sequence[Record], *, quotas: Mapping[Domain | str, int],
                  batch_size: int = 32, seed: int = 0, first_index: int = 0,
                  pool: str = "train") -> list[Record]:
    """Records in training-file order: batch b holds the next `quotas[d]` rows of each domain
    (grouped by domain in quota order; each domain in a seeded order, `pipeline.plan_batches`),
    with `batch_index = first_index + b`, balanced forced modes and `pool`. Read back with
    `shuffle=False` and the same quotas, the pipeline serves exactly these batches.
    ValueError unless the records fill whole batches with nothing left over."""
    config = PipelineConfig(batch_size=batch_size, group_size=1, quotas=quotas, shuffle=True,
                            seed=seed, first_index=first_index)
    plan = plan_batches(records, config)
    used = sum(len(batch) for batch in plan)
    if used != len(records):
        found = collections.Counter(r.domain.value for r in records)
        raise ValueError(f"{len(records)} records do not fill whole batches of {batch_size} "
                         f"with quotas {dict((d.value, q) for d, q in config.quotas.items())}: "
                         f"{used} used; rows per domain {dict(found)}")
    out: list[Record] = []
    for b, positions in enumerate(plan):
        batch = [records[i] for i in positions]
        modes = balanced_forced_modes([r.sample_id for r in batch])
        batch = [r.replace(batch_index=first_index + b, forced_mode=m, pool=pool)
                 for r, m in zip(batch, modes, strict=True)]
        check_census(batch, config.quotas)
        out.extend(batch)
    return out


# ============================================================================ pools
class SourcePool:
    """The usable records of one source file in draw order; `take` hands out the next rows
    (never the same row twice), `skip` passes over rows another file would take."""

    def __init__(self, name: str, records: Iterable[Record], *, label: str | None = None,
                 usable: int | None = None) -> None:
        self.name = name
        self.label = label or name
        self._left = list(records)
        self.usable = len(self._left) if usable is None else usable
        self.drawn = 0

    @classmethod
    def load(cls, name: str, path: str | os.PathLike[str], *, split: str | None = None,
             seed: int = 0, limit: int | None = None, bad_rows: BadRows = "error",
             stats: SourceStats | None = None) -> SourcePool:
        """`sources.load_source` in draw order; `limit`: the most rows that will be drawn."""
        stats = SourceStats() if stats is None else stats
        before = stats.kept
        records = load_source(name, path, split=split, bad_rows=bad_rows, stats=stats,
                              seed=seed, limit=limit)
        where = f"{path}#{split}" if split else str(path)
        return cls(name, records, label=f"{name} ({where})", usable=stats.kept - before)

    def take(self, count: int, purpose: str, *,
             group: Callable[[Record], str] | None = None) -> list[Record]:
        """The next `count` records, in draw order. With `group`, as even a share of each
        group (e.g. BBH task) as `count` allows: `count // G` each, one more for the first
        `count % G` groups in name order. ValueError naming the source, the purpose, the
        count asked and the rows found, if the pool (or a group) is short."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"{purpose}: count for source {self.name!r} must be a "
                             f"non-negative integer, got {count!r}")
        if count > len(self._left):
            before = f" after {self.drawn} drawn for earlier files" if self.drawn else ""
            raise ValueError(f"source {self.label}: {purpose} needs {count} rows but only "
                             f"{len(self._left)} of its {self.usable} usable rows are "
                             f"left{before}")
        picked = self._left[:count] if group is None else self._stratified(count, purpose, group)
        chosen = {r.sample_id for r in picked}
        self._left = [r for r in self._left if r.sample_id not in chosen]
        self.drawn += count
        return picked

    def _stratified(self, count: int, purpose: str,
                    group: Callable[[Record], str]) -> list[Record]:
        members: dict[str, list[Record]] = collections.defaultdict(list)
        for record in self._left:
            members[group(record)].append(record)
        names = sorted(members)
        share, extra = divmod(count, len(names)) if names else (0, 0)
        chosen: set[str] = set()
        for k, name in enumerate(names):
            need = share + (k < extra)
            if need > len(members[name]):
                raise ValueError(f"source {self.label}: {purpose} needs {need} rows of group "
                                 f"{name!r} ({count} over {len(names)} groups) but it has "
                                 f"{len(members[name])}")
            chosen.update(r.sample_id for r in members[name][:need])
        return [r for r in self._left if r.sample_id in chosen]

    def skip(self, count: int, purpose: str) -> None:
        """Pass over the rows a file not being written would take (same checks as `take`)."""
        self.take(count, purpose)


def _pool(pools: Mapping[str, SourcePool], name: str, purpose: str) -> SourcePool:
    if name not in pools:
        raise ValueError(f"{purpose} needs source {name!r} (--source {name}=PATH)")
    return pools[name]


# ============================================================================ builders
def build_training_file(pools: Mapping[str, SourcePool], *, batches: int = TRAIN_BATCHES,
                        mix: Mapping[str, int] = REFERENCE_MIX,
                        quotas: Mapping[Domain | str, int] = DEFAULT_QUOTAS,
                        batch_size: int = 32, seed: int = 0, first_index: int = 0,
                        pool: str = "train") -> list[Record]:
    """The training file: `batch_mix(mix, quotas, batches)` rows drawn from each source's
    pool, in `order_batches` order (batch indices from `first_index`, forced modes, `pool`)."""
    PipelineConfig(quotas=quotas, batch_size=batch_size)  # quotas must sum to batch_size
    purpose = TRAIN_FILE if pool == "train" else COLD_FILE if pool == "cold_pool" else pool
    drawn = [record for name, count in batch_mix(mix, quotas, batches).items()
             for record in _pool(pools, name, purpose).take(count, purpose)]
    return order_batches(drawn, quotas=quotas, batch_size=batch_size, seed=seed,
                         first_index=first_index, pool=pool)


def _eval_counts(count: int, counts: Mapping[str, int] | None) -> dict[str, int]:
    return {**dict.fromkeys(SOURCES, count), **EVAL_DEFAULT_COUNTS, **(counts or {})}


def build_eval_sets(pools: Mapping[str, SourcePool], *, count: int = EVAL_COUNT,
                    counts: Mapping[str, int] | None = None) -> dict[str, list[Record]]:
    """`EVAL_SETS` -> records (pool "eval", free): `count` rows of each member source, TACO
    100, `counts` overriding per source name."""
    per = _eval_counts(count, counts)
    return {name: [r.replace(pool="eval") for source in members
                   for r in _pool(pools, source, name).take(per[source], name)]
            for name, members in EVAL_SETS.items()}


def _ood_counts(counts: Mapping[str, int] | None) -> dict[str, int]:
    return {**{source: n for source, n in OOD_SETS.values()}, **(counts or {})}


def build_ood_sets(pools: Mapping[str, SourcePool], *,
                   counts: Mapping[str, int] | None = None) -> dict[str, list[Record]]:
    """`OOD_SETS` -> records (pool "ood", free): AIME 149, GPQA-Diamond 198, BBH 1080 (spread
    evenly over its tasks: 40 of each of 27), `counts` overriding per source name."""
    per = _ood_counts(counts)
    return {name: [r.replace(pool="ood") for r in _pool(pools, source, name).take(
                per[source], name, group=SOURCES[source].group)]
            for name, (source, _) in OOD_SETS.items()}


def build_router_r1_files(pools: Mapping[str, SourcePool],
                          test_pools: Mapping[str, SourcePool] | None = None, *,
                          train_count: int = 7000,
                          test_count: int = 100) -> dict[str, list[Record]]:
    """Router-R1's files (its upstream data): `train_nh` = `train_count` NQ + `train_count`
    HotpotQA rows, `test_nh` = `test_count` of each from `test_pools` (NQ test, HotpotQA dev;
    default: the same pools, after the training rows). Rows keep Router-R1's shape: the
    question verbatim (the prompt is rendered at run time), gold = golden_answers,
    data_source = the dataset, `ability` / `extra_info.index` / `extra_info.split`."""
    test_pools = pools if test_pools is None else test_pools
    out = {}
    for name, split in ROUTER_R1_FILES.items():
        chosen, n = (pools, train_count) if split == "train" else (test_pools, test_count)
        out[name] = [r.replace(pool=f"router_r1_{split}") for source in ROUTER_R1_SOURCES
                     for r in _pool(chosen, source, name).take(n, name)]
    return out


# ============================================================================ prepare
@dataclasses.dataclass(frozen=True)
class SourceSpec:
    """`NAME[.eval]=PATH[#SPLIT]`: where a source's local copy is. `held_out` (`.eval`): the
    copy evaluation-type files (eval, OOD, Router-R1 test) draw from instead of NAME's."""

    name: str
    path: Path
    split: str | None = None
    held_out: bool = False

    @classmethod
    def parse(cls, text: str) -> SourceSpec:
        name, sep, location = text.partition("=")
        name, held_out = (name[:-len(".eval")], True) if name.endswith(".eval") \
            else (name, False)
        if not sep or not location or name not in SOURCES:
            raise ValueError(f"source {text!r}: expected NAME[.eval]=PATH[#SPLIT] with NAME "
                             f"one of {sorted(SOURCES)}")
        path, _, split = location.partition("#")
        return cls(name, Path(path), split or None, held_out)

    @property
    def key(self) -> str:
        return f"{self.name}.eval" if self.held_out else self.name

    def __str__(self) -> str:
        return f"{self.key}={self.path}" + (f"#{self.split}" if self.split else "")


@dataclasses.dataclass(frozen=True)
class PreparedFile:
    """A written file: its path and rows per domain / per benchmark (`Record.dataset`)."""

    path: Path
    rows: int
    domains: dict[str, int]
    datasets: dict[str, int]


@dataclasses.dataclass
class PrepareResult:
    files: list[PreparedFile]
    sources: dict[str, SourceStats]  # SourceSpec.key -> what reading that copy saw


def _demands(output: str, *, mix: Mapping[str, int], quotas: Mapping[Domain, int],
             train_batches: int, cold_batches: int, eval_count: int,
             counts: Mapping[str, int] | None, router_r1_train: int,
             router_r1_test: int) -> list[tuple[str, bool, int]]:
    """(source, held-out?, rows) an output takes, in its take order."""
    if output == "train":
        return [(s, False, n) for s, n in batch_mix(mix, quotas, train_batches).items()]
    if output == "cold_start":
        return [(s, False, n) for s, n in batch_mix(mix, quotas, cold_batches).items()]
    if output == "eval":
        per = _eval_counts(eval_count, counts)
        return [(s, True, per[s]) for members in EVAL_SETS.values() for s in members]
    if output == "ood":
        per = _ood_counts(counts)
        return [(s, True, per[s]) for s, _ in OOD_SETS.values()]
    return [(s, split == "test", router_r1_train if split == "train" else router_r1_test)
            for split in ROUTER_R1_FILES.values() for s in ROUTER_R1_SOURCES]


def prepare(sources: Sequence[SourceSpec], out_dir: str | os.PathLike[str], *,
            what: Sequence[str] = OUTPUTS, seed: int = 42, mix: str = "reference",
            train_batches: int = TRAIN_BATCHES, cold_batches: int = COLD_BATCHES,
            eval_count: int = EVAL_COUNT, counts: Mapping[str, int] | None = None,
            router_r1_train: int = 7000, router_r1_test: int = 100,
            fmt: str = "parquet", bad_rows: BadRows = "error") -> PrepareResult:
    """Read the sources, build the files of `what` (a subset of `OUTPUTS`) and write them
    under `out_dir` (module doc) as parquet or JSON lines; returns what was written and read.

    `seed` fixes the draw order of every source and the batch order; `mix` names a `MIXES`
    entry; `counts` overrides eval/OOD rows per source name. Raises ValueError naming every
    missing source, or a source that is short (with the count asked and found), before
    anything is written.
    """
    unknown = [w for w in what if w not in OUTPUTS]
    if unknown or not what:
        raise ValueError(f"what: expected some of {list(OUTPUTS)}, got {list(what)}")
    if mix not in MIXES:
        raise ValueError(f"mix: expected one of {sorted(MIXES)}, got {mix!r}")
    if fmt not in ("parquet", "jsonl"):
        raise ValueError(f"fmt: expected 'parquet' or 'jsonl', got {fmt!r}")
    countable = {s for members in EVAL_SETS.values() for s in members} | {
        s for s, _ in OOD_SETS.values()}
    if set(counts or {}) - countable:
        raise ValueError(f"counts: {sorted(set(counts or {}) - countable)} are not in an eval "
                         f"or OOD set; known: {sorted(countable)}")
    specs: dict[str, SourceSpec] = {}
    for spec in sources:
        if spec.key in specs:
            raise ValueError(f"source {spec.key!r} is given twice")
        specs[spec.key] = spec
    for spec in specs.values():
        train = specs.get(spec.name)
        if spec.held_out and train and (train.path.resolve(), train.split) == (
                spec.path.resolve(), spec.split):
            # Its draws would start over and repeat training rows in the eval files.
            raise ValueError(f"source {spec}: the held-out copy is the training copy; leave "
                             f"{spec.key} out (eval files then draw after the training rows)")
    mix_counts, quotas = MIXES[mix]
    options = dict(mix=mix_counts, quotas=quotas, train_batches=train_batches,
                   cold_batches=cold_batches, eval_count=eval_count, counts=counts,
                   router_r1_train=router_r1_train, router_r1_test=router_r1_test)
    demands = {output: _demands(output, **options) for output in OUTPUTS}

    def key(source: str, held_out: bool) -> str:
        return f"{source}.eval" if held_out and f"{source}.eval" in specs else source

    missing = sorted({f"{output}: {s}" for output in what for s, h, _ in demands[output]
                      if key(s, h) not in specs})
    if missing:
        raise ValueError(f"missing sources ({'; '.join(missing)}): give each as --source "
                         "NAME=PATH, or leave its files out of --what")
    needed = {key(s, h) for output in what for s, h, _ in demands[output]}
    # Outputs after the last one asked for draw nothing: their rows need not exist.
    upto = OUTPUTS[:max(OUTPUTS.index(w) for w in what) + 1]
    totals: collections.Counter = collections.Counter()
    for output in upto:
        for s, h, n in demands[output]:
            totals[key(s, h)] += n
    stats = {k: SourceStats() for k in sorted(needed)}
    pools = {k: SourcePool.load(specs[k].name, specs[k].path, split=specs[k].split, seed=seed,
                                limit=None if SOURCES[specs[k].name].group else totals[k],
                                bad_rows=bad_rows, stats=stats[k])
             for k in sorted(needed)}
    train_pools = {s: pools[k] for s in SOURCES if (k := key(s, False)) in pools}
    held_pools = {s: pools[k] for s in SOURCES if (k := key(s, True)) in pools}
    built: dict[str, list[Record]] = {}
    for output in upto:
        if output not in what:
            for s, h, n in demands[output]:
                if key(s, h) in pools:
                    # Keeps the rows of the files asked for where a full run puts them.
                    pools[key(s, h)].skip(n, f"{output} (not written, but drawn first; a "
                                             f"held-out {s}.eval copy avoids this)")
            continue
        if output in ("train", "cold_start"):
            train = output == "train"
            built[f"parquet/{TRAIN_FILE if train else COLD_FILE}"] = build_training_file(
                train_pools, batches=train_batches if train else cold_batches,
                mix=mix_counts, quotas=quotas, seed=seed,
                pool="train" if train else "cold_pool")
        elif output == "eval":
            built.update({f"eval/{name}": records for name, records in build_eval_sets(
                held_pools, count=eval_count, counts=counts).items()})
        elif output == "ood":
            built.update({f"eval/{name}": records for name, records in build_ood_sets(
                held_pools, counts=counts).items()})
        else:
            built.update({f"router_r1/{name}": records for name, records in
                          build_router_r1_files(train_pools, held_pools,
                                                train_count=router_r1_train,
                                                test_count=router_r1_test).items()})
    return PrepareResult(_write(built, Path(out_dir), fmt), stats)


def _write(built: Mapping[str, list[Record]], out_dir: Path, fmt: str) -> list[PreparedFile]:
    files = []
    for stem, records in built.items():
        path = out_dir / f"{stem}.{fmt}"
        path.parent.mkdir(parents=True, exist_ok=True)
        (write_parquet if fmt == "parquet" else write_jsonl)(path, records)
        files.append(PreparedFile(
            path, len(records),
            dict(collections.Counter(r.domain.value for r in records)),
            dict(collections.Counter(r.dataset for r in records))))
    return files


def summary_rows(result: PrepareResult) -> list[dict[str, Any]]:
    """One JSON-able dict per written file (for logs and `prepare.json`)."""
    return [{"path": str(f.path), "rows": f.rows, "domains": f.domains, "datasets": f.datasets}
            for f in result.files]


def write_manifest(result: PrepareResult, out_dir: str | os.PathLike[str],
                   settings: Mapping[str, Any]) -> Path:
    """`prepare.json` in `out_dir`: the settings, the files and what each source read gave."""
    path = Path(out_dir) / "prepare.json"
    sources = {k: {"rows": s.rows, "kept": s.kept, "unusable": s.unusable,
                   "unusable_reasons": dict(s.reasons), "skipped": s.skipped,
                   "errors": s.errors} for k, s in result.sources.items()}
    path.write_text(json.dumps({"settings": dict(settings), "files": summary_rows(result),
                                "sources": sources}, indent=1, default=str) + "\n")
    return path
