"""Query-batch pipeline: domain quotas, determinism, batch indices, resume, repeat, errors."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import grain
import orbax.checkpoint as ocp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_routeweaver.data.pipeline import (
    DEFAULT_QUOTAS,
    PipelineConfig,
    QueryBatch,
    QueryIterator,
    QueryPipeline,
    check_census,
    plan_batches,
)
from jax_routeweaver.data.records import Domain, Record
from jax_routeweaver.routing.simulated.tasks import synthetic_tasks

DOMAINS = list(Domain)


def rec(i: int, domain: Domain | str, **changes) -> Record:
    return Record(sample_id=f"q{i}", domain=domain, dataset="d", scorer_dataset="qa_subem",
                  question=f"Question {i}?", gold=["a"], **changes)


def mixed(counts: dict[Domain, int]) -> list[Record]:
    """Records with the given domain counts, domains interleaved round-robin."""
    pending = {d: n for d, n in counts.items() if n}
    out: list[Record] = []
    while pending:
        for domain in list(pending):
            out.append(rec(len(out), domain))
            pending[domain] -= 1
            if not pending[domain]:
                del pending[domain]
    return out


def ids(batch: QueryBatch) -> list[str]:
    return [r.sample_id for r in batch.records]


TASKS = synthetic_tasks(200, seed=7)  # 40 per domain -> 5 full reference batches


# ---------------------------------------------------------------------------- quotas
def test_default_quotas_are_the_reference_census():
    assert list(DEFAULT_QUOTAS.items()) == [(Domain.MATH, 7), (Domain.CODE, 7),
                                            (Domain.KNOWLEDGE, 7), (Domain.REASON, 6),
                                            (Domain.RECALL, 5)]
    assert sum(DEFAULT_QUOTAS.values()) == PipelineConfig().batch_size == 32
    assert PipelineConfig().group_size == 8


def test_default_batches_hold_census_in_quota_order():
    pipeline = QueryPipeline(TASKS, PipelineConfig(seed=1))
    assert len(pipeline) == pipeline.batches_per_epoch == 5
    flat = [r for batch in pipeline.dataset for r in batch.records]
    check_census(flat[:32])  # the reference pre-flight check on the flattened order
    for batch in pipeline.dataset:
        check_census(batch)
        assert batch.domain_counts() == dict(DEFAULT_QUOTAS)
        expected_order = [d for d, q in DEFAULT_QUOTAS.items() for _ in range(q)]
        assert [r.domain for r in batch.records] == expected_order


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(0, 25), min_size=5, max_size=5),
       quota_list=st.lists(st.integers(0, 5), min_size=5, max_size=5).filter(any),
       order=st.permutations(DOMAINS), shuffle=st.booleans(), seed=st.integers(0, 2**32))
def test_quotas_hold_for_every_batch(counts, quota_list, order, shuffle, seed):
    records = mixed(dict(zip(DOMAINS, counts, strict=True)))
    quotas = {d: quota_list[DOMAINS.index(d)] for d in order}  # random quota order
    config = PipelineConfig(batch_size=sum(quotas.values()), quotas=quotas, shuffle=shuffle,
                            seed=seed, group_size=2)
    by_domain = collections.Counter(r.domain for r in records)
    full = min(by_domain[d] // q for d, q in quotas.items() if q)
    if full == 0:
        with pytest.raises(ValueError, match="cannot fill a single batch"):
            QueryPipeline(records, config)
        return
    pipeline = QueryPipeline(records, config)
    batches = list(pipeline.dataset)
    assert len(batches) == len(pipeline) == full
    seen: set[str] = set()
    for batch in batches:
        assert batch.domain_counts() == {d: quotas[d] for d in DOMAINS}
        assert [r.domain for r in batch.records] == [d for d, q in quotas.items()
                                                     for _ in range(q)]
        assert seen.isdisjoint(ids(batch))  # no record twice in an epoch
        seen.update(ids(batch))
        if not shuffle:  # draw order = file order within each domain
            for domain in DOMAINS:
                positions = [int(r.sample_id[1:]) for r in batch.records if r.domain is domain]
                assert positions == sorted(positions)


def test_census_check_names_expected_and_found():
    batch = QueryPipeline(TASKS, PipelineConfig(seed=1)).batch(0)
    check_census(batch, {"math": 7, "code": 7, "knowledge": 7, "reason": 6, "recall": 5})
    with pytest.raises(ValueError) as info:
        check_census(batch, {Domain.MATH: 8, Domain.CODE: 6, Domain.KNOWLEDGE: 7,
                             Domain.REASON: 6, Domain.RECALL: 5})
    assert str(info.value) == (
        "domain census of batch 0: expected {MATH 8, CODE 6, KNOWLEDGE 7, REASON 6, RECALL 5}"
        ", found {MATH 7, CODE 7, KNOWLEDGE 7, REASON 6, RECALL 5}")
    with pytest.raises(ValueError, match=r"of rows: expected \{MATH 7, CODE 7, .*RECALL 5\}, "
                                         r"found \{MATH 7, CODE 7, KNOWLEDGE 7, REASON 7, "):
        check_census([*batch.records[:-1], rec(999, Domain.REASON)])


# ---------------------------------------------------------------------------- determinism
def test_same_seed_same_batches_other_seed_other_order():
    a = [ids(b) for b in QueryPipeline(TASKS, PipelineConfig(seed=3)).dataset]
    b = [ids(b) for b in QueryPipeline(list(TASKS), PipelineConfig(seed=3)).dataset]
    c = [ids(b) for b in QueryPipeline(TASKS, PipelineConfig(seed=4)).dataset]
    assert a == b
    assert a != c
    used = [sample_id for batch in c for sample_id in batch]
    assert len(set(used)) == len(used) == 5 * 32


def test_without_shuffle_rows_are_drawn_in_file_order():
    plan = plan_batches(TASKS, PipelineConfig(shuffle=False))
    math_rows = [i for i, r in enumerate(TASKS) if r.domain is Domain.MATH]
    assert plan[0][:7] == math_rows[:7] and plan[1][:7] == math_rows[7:14]


@pytest.mark.slow
def test_plan_does_not_depend_on_python_hash_seed():
    script = ("import json; from jax_routeweaver.routing.simulated.tasks import synthetic_tasks; "
              "from jax_routeweaver.data.pipeline import PipelineConfig, plan_batches; "
              "print(json.dumps(plan_batches(synthetic_tasks(100, seed=2), "
              "PipelineConfig(seed=5), epoch=1)))")
    outputs = []
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                              text=True, check=True)
        outputs.append(json.loads(done.stdout))
    assert outputs[0] == outputs[1]
    assert outputs[0] == plan_batches(synthetic_tasks(100, seed=2), PipelineConfig(seed=5),
                                      epoch=1)


def test_no_quotas_gives_consecutive_batches_of_the_order():
    records = mixed({Domain.MATH: 50, Domain.RECALL: 20})
    config = PipelineConfig(batch_size=32, quotas=None, shuffle=False)
    batches = list(QueryPipeline(records, config).dataset)
    assert [ids(b) for b in batches] == [[r.sample_id for r in records[:32]],
                                         [r.sample_id for r in records[32:64]]]
    shuffled = plan_batches(records, PipelineConfig(quotas=None, seed=1))
    assert len(shuffled) == 2 and shuffled != plan_batches(records, config)
    assert len(set(shuffled[0] + shuffled[1])) == 64


# ---------------------------------------------------------------------------- batch contents
def test_batch_index_is_reassigned_from_first_index():
    records = [r.replace(batch_index=99) for r in TASKS]
    pipeline = QueryPipeline(records, PipelineConfig(first_index=25, num_batches=4))
    batches = list(pipeline)
    assert [b.index for b in batches] == [25, 26, 27, 28]
    for batch in batches:
        assert {r.batch_index for r in batch.records} == {batch.index}
    assert pipeline.batch(2) == batches[2]
    # the records are the input records, changed only in batch_index
    by_id = {r.sample_id: r for r in records}
    assert all(r == by_id[r.sample_id].replace(batch_index=26) for r in batches[1].records)
    with pytest.raises(IndexError):
        pipeline.batch(4)
    with pytest.raises(IndexError):
        pipeline.batch(-1)


def test_rollouts_are_query_major_with_k_per_query():
    batch = QueryPipeline(TASKS, PipelineConfig(group_size=3)).batch(0)
    rollouts = batch.rollouts()
    assert len(rollouts) == 32 * 3
    assert rollouts[:4] == [(batch.records[0], 0), (batch.records[0], 1),
                            (batch.records[0], 2), (batch.records[1], 0)]
    assert rollouts == [(r, k) for r in batch.records for k in range(3)]
    with pytest.raises(ValueError, match="batch_index 3"):
        QueryBatch(index=3, records=batch.records, group_size=3)


# ---------------------------------------------------------------------------- resume
def test_resume_from_json_state_continues_with_the_same_batches():
    config = PipelineConfig(seed=11)
    uninterrupted = [ids(b) for b in QueryPipeline(TASKS, config)]
    it = iter(QueryPipeline(TASKS, config))
    assert isinstance(it, QueryIterator) and isinstance(it, grain.DatasetIterator)
    first = [ids(next(it)) for _ in range(3)]
    saved = json.dumps(it.get_state())
    resumed = iter(QueryPipeline(list(TASKS), config))  # a new process would rebuild it
    resumed.set_state(json.loads(saved))
    rest = [ids(b) for b in resumed]
    assert first + rest == uninterrupted and len(rest) == len(uninterrupted) - 3
    # the interrupted iterator itself goes on identically
    assert [ids(b) for b in it] == rest


def test_resume_with_more_batches_and_refusal_of_a_foreign_state():
    short = iter(QueryPipeline(TASKS, PipelineConfig(num_batches=2, repeat=True)))
    list(short)
    state = short.get_state()
    longer = QueryPipeline(TASKS, PipelineConfig(num_batches=8, repeat=True))
    resumed = iter(longer)
    resumed.set_state(state)
    assert [b.index for b in resumed] == [2, 3, 4, 5, 6, 7]
    for other in (PipelineConfig(num_batches=2, repeat=True, seed=1),
                  PipelineConfig(num_batches=2, repeat=True, first_index=1)):
        with pytest.raises(ValueError, match="different pipeline"):
            iter(QueryPipeline(TASKS, other)).set_state(state)
    with pytest.raises(ValueError, match="different pipeline"):
        iter(QueryPipeline(TASKS[1:] + TASKS[:1], PipelineConfig())).set_state(state)
    with pytest.raises(ValueError, match="not a QueryIterator state"):
        iter(longer).set_state({"next_index": 2})


def test_state_round_trips_through_orbax(tmp_path):
    pipeline = QueryPipeline(TASKS, PipelineConfig(seed=2))
    it = iter(pipeline)
    next(it), next(it)
    expected = [ids(b) for b in iter(pipeline)][2:]
    # as the trainer stores it: a JSON item of an orbax CheckpointManager
    with ocp.CheckpointManager(tmp_path / "ckpt", item_names=("data",)) as manager:
        manager.save(2, args=ocp.args.Composite(data=ocp.args.JsonSave(it.get_state())))
        manager.wait_until_finished()
        restored = manager.restore(2, args=ocp.args.Composite(data=ocp.args.JsonRestore()))
    fresh = iter(pipeline)
    fresh.set_state(restored["data"])
    assert [ids(b) for b in fresh] == expected
    # and through grain's own orbax handler, which calls get_state/set_state
    checkpointer = ocp.Checkpointer(grain.checkpoint.CheckpointHandler())
    checkpointer.save(tmp_path / "grain", args=grain.checkpoint.CheckpointSave(it))
    fresh = iter(pipeline)
    checkpointer.restore(tmp_path / "grain", args=grain.checkpoint.CheckpointRestore(fresh))
    assert [ids(b) for b in fresh] == expected


# ---------------------------------------------------------------------------- repeat
def test_repeat_crosses_epochs_deterministically():
    # 45 MATH rows: 6 batches per epoch use 42, so epoch 1 can draw the 3 left over.
    records = mixed({Domain.MATH: 45, Domain.CODE: 12})
    config = PipelineConfig(batch_size=9, quotas={"MATH": 7, "CODE": 2}, seed=5, repeat=True,
                            num_batches=15)
    pipeline = QueryPipeline(records, config)
    assert pipeline.batches_per_epoch == 6 and len(pipeline) == 15
    batches = list(pipeline)
    assert [b.index for b in batches] == list(range(15))
    assert [ids(b) for b in batches] == [ids(b) for b in QueryPipeline(records, config)]
    epochs = [[i for b in batches[e * 6:(e + 1) * 6] for i in ids(b)] for e in range(2)]
    for epoch in epochs:
        assert len(epoch) == len(set(epoch)) == 54
    assert epochs[0] != epochs[1]  # reshuffled with (seed, epoch)
    assert set(epochs[1]) - set(epochs[0])  # rows left over in epoch 0 get their turn
    assert ids(batches[6]) == [records[i].sample_id
                               for i in plan_batches(records, config, epoch=1)[0]]
    # resuming inside epoch 2 continues identically
    it = iter(pipeline)
    for _ in range(13):
        next(it)
    resumed = iter(QueryPipeline(records, config))
    resumed.set_state(json.loads(json.dumps(it.get_state())))
    assert [ids(b) for b in resumed] == [ids(b) for b in batches[13:]]


def test_endless_pipeline_has_no_length():
    pipeline = QueryPipeline(TASKS, PipelineConfig(repeat=True))
    with pytest.raises(TypeError, match="endless"):
        len(pipeline)
    it = iter(pipeline)
    assert [next(it).index for _ in range(12)] == list(range(12))
    assert pipeline.batch(1000).index == 1000


# ---------------------------------------------------------------------------- errors
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"quotas": {**DEFAULT_QUOTAS, Domain.RECALL: 4}}, "quotas sum to 31 but batch_size is 32"),
    ({"quotas": {"MATH": 16, "POETRY": 16}}, "unknown domain 'POETRY'"),
    ({"quotas": {"MATH": 33, "CODE": -1}}, r"quotas\[CODE\] must be >= 0"),
    ({"quotas": {"math": 16, Domain.MATH: 16}}, "MATH is given twice"),
    ({"quotas": [("MATH", 32)]}, "must be a mapping"),
    ({"batch_size": 0, "quotas": None}, "batch_size must be >= 1"),
    ({"group_size": 0}, "group_size must be >= 1"),
    ({"first_index": -1}, "first_index must be >= 0"),
    ({"num_batches": 2.0}, "num_batches must be an integer"),
    ({"shuffle": 1}, "shuffle must be True or False"),
])
def test_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PipelineConfig(**kwargs)


def test_config_accepts_domain_names():
    config = PipelineConfig(batch_size=3, quotas={"recall": 2, " Math ": 1})
    assert list(config.quotas.items()) == [(Domain.RECALL, 2), (Domain.MATH, 1)]


def test_running_out_of_data_names_the_domain():
    records = mixed({Domain.MATH: 40, Domain.CODE: 40, Domain.KNOWLEDGE: 40,
                     Domain.REASON: 40, Domain.RECALL: 12})
    with pytest.raises(ValueError) as info:
        QueryPipeline(records, PipelineConfig(num_batches=3))
    message = str(info.value)
    assert "fill 2 batches, 3 requested" in message
    assert "domain RECALL has 12 rows, needs 15 (3 × 5)" in message
    assert "MATH" not in message
    assert len(QueryPipeline(records, PipelineConfig(num_batches=3, repeat=True))) == 3
    with pytest.raises(ValueError, match="cannot fill a single batch: domain CODE has 0 rows"):
        QueryPipeline(mixed({Domain.MATH: 40}), PipelineConfig(batch_size=8,
                                                               quotas={"MATH": 4, "CODE": 4}))
    with pytest.raises(ValueError, match="cannot fill a single batch: 5 records, 32 needed"):
        QueryPipeline(TASKS[:5], PipelineConfig(quotas=None, repeat=True))
    empty = QueryPipeline(TASKS[:5], PipelineConfig(num_batches=0))  # asked for none: fine
    assert len(empty) == 0 and list(empty) == []


def test_bad_record_lists():
    with pytest.raises(ValueError, match=r"records\[0\] and records\[3\] share sample_id 'q0'"):
        QueryPipeline([rec(0, "MATH"), rec(1, "MATH"), rec(2, "MATH"), rec(0, "CODE")],
                      PipelineConfig(batch_size=1, quotas={"MATH": 1}))
    with pytest.raises(ValueError, match=r"records\[1\] is a dict"):
        plan_batches([rec(0, "MATH"), {"sample_id": "x"}], PipelineConfig())
