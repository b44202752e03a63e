"""Record schema: validation errors, reference row round trip, JSONL files."""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_routeweaver.data.record_files import (
    QuestionLimit,
    ReadStats,
    read_jsonl,
    read_parquet,
    read_records,
    write_jsonl,
    write_parquet,
)
from jax_routeweaver.data.records import Domain, Record, RecordError
from jax_routeweaver.routing.simulated.tasks import synthetic_tasks


def make(**changes) -> Record:
    fields = dict(sample_id="q-1", domain="MATH", dataset="math_l2-5", scorer_dataset="math",
                  question="What is 2 + 3?", gold=["5"], meta={"level": 2}, pool="train",
                  batch_index=4, forced_mode="multi", data_source="routeweaver")
    fields.update(changes)
    return Record(**fields)


def code_record(**changes) -> Record:
    fields = dict(sample_id="c-1", domain="CODE", dataset="apps", scorer_dataset="apps_functional",
                  question="Write add(a, b).", gold=[],
                  meta={"func_name": "add", "test_type": "functional",
                        "tests": [{"input": [1, 2], "output": 3}]})
    fields.update(changes)
    return Record(**fields)


# A row as the reference parquet holds it, including keys we do not interpret.
REFERENCE_ROW = {
    "data_source": "routeweaver",
    "prompt": [{"role": "user", "content": "You are a router. ...\nQuestion: What is 2 + 3?"}],
    "ability": "routing",
    "extra_info": {
        "payload_json": json.dumps({"raw_question": "What is 2 + 3?", "gold": ["5", "five"],
                                    "meta": {"level": 2}, "source": "MATH"}),
        "scorer_dataset": "math",
        "sample_id": "math-00017",
        "batch_index": 25,
        "domain": "MATH",
        "pool": "main",
        "dataset": "math_l2-5",
        "forced_mode": "agentic",
        "index": 17,
    },
}


# ---------------------------------------------------------------------------- validation
@pytest.mark.parametrize(("changes", "field"), [
    ({"domain": "POETRY"}, "domain"),
    ({"dataset": ""}, "dataset"),
    ({"scorer_dataset": "no spaces allowed"}, "scorer_dataset"),
    ({"question": "   "}, "question"),
    ({"gold": []}, "gold"),
    ({"gold": ["", " "]}, "gold"),
    ({"gold": "5"}, "gold"),
    ({"gold": ["5", None]}, "gold[1]"),
    ({"gold": [True]}, "gold[0]"),
    ({"meta": {"x": float("nan")}}, "meta"),
    ({"meta": {"x": object()}}, "meta"),
    ({"meta": ["not", "a", "dict"]}, "meta"),
    ({"batch_index": -1}, "batch_index"),
    ({"batch_index": 2.5}, "batch_index"),
    ({"batch_index": True}, "batch_index"),
    ({"forced_mode": "solo"}, "forced_mode"),
    ({"pool": None}, "pool"),
    ({"prompt": ""}, "prompt"),
    ({"extras": {"extra_info.sample_id": "x"}}, "extras['extra_info.sample_id']"),
])
def test_validation_errors_name_field_and_sample_id(changes, field):
    with pytest.raises(RecordError) as info:
        make(**changes)
    message = str(info.value)
    assert f"field {field!r}" in message and "'q-1'" in message


def test_an_unscored_question_needs_no_gold_and_no_domain():
    from jax_routeweaver.data.records import UNSCORED

    served = Record(sample_id="req-1", domain=None, dataset="serve", scorer_dataset=UNSCORED,
                    question="What is 2+2?", gold=())
    assert served.domain is None and served.to_row()["extra_info"]["domain"] is None
    with pytest.raises(RecordError, match="'domain'"):
        Record(sample_id="q", domain=None, dataset="d", scorer_dataset="math", question="q",
               gold=("1",))
    with pytest.raises(RecordError, match="'gold'"):
        Record(sample_id="q", domain="MATH", dataset="d", scorer_dataset="math", question="q",
               gold=())


def test_sample_id_must_be_present():
    with pytest.raises(RecordError, match="field 'sample_id'"):
        make(sample_id="")


def test_code_records_need_tests_and_func_name():
    assert code_record().gold == ()
    with pytest.raises(RecordError, match=r"'c-1'.*field 'meta.tests'"):
        code_record(meta={"func_name": "add"})
    with pytest.raises(RecordError, match=r"field 'meta.tests\[0\]'"):
        code_record(meta={"func_name": "add", "tests": [{"input": [1]}]})
    with pytest.raises(RecordError, match="field 'meta.func_name'"):
        code_record(meta={"tests": [{"input": [1, 2], "output": 3}]})
    stdin = code_record(scorer_dataset="stdin", meta={"tests": [{"input": "1 2", "output": "3"}]})
    assert stdin.meta["tests"][0]["output"] == "3"


def test_forgiving_inputs_are_normalised():
    record = make(domain="recall", gold=[42, 1.5], forced_mode="")
    assert record.domain is Domain.RECALL and record.gold == ("42", "1.5")
    assert record.forced_mode is None
    assert make(meta={"difficulty": "hard"}).difficulty == "hard" and make().difficulty is None
    assert make().replace(batch_index=7).batch_index == 7
    with pytest.raises(RecordError, match="batch_index"):
        make().replace(batch_index=-3)


# ---------------------------------------------------------------------------- rows
def test_reference_row_round_trips_exactly():
    record = Record.from_row(REFERENCE_ROW)
    assert record.sample_id == "math-00017" and record.domain is Domain.MATH
    assert record.question == "What is 2 + 3?" and record.gold == ("5", "five")
    assert record.meta == {"level": 2} and record.batch_index == 25
    assert record.forced_mode == "agentic" and record.prompt.startswith("You are a router.")
    assert record.extras == {"ability": "routing", "extra_info.index": 17,
                             "payload_json.source": "MATH"}
    row = record.to_row()
    assert row == REFERENCE_ROW
    assert isinstance(row["extra_info"]["payload_json"], str)


def test_row_without_optional_fields():
    info = {"payload_json": json.dumps({"raw_question": "Who?", "gold": ["Ann"]}),
            "scorer_dataset": "triviaqa", "sample_id": "r-1", "domain": "RECALL",
            "dataset": "triviaqa"}
    record = Record.from_row({"extra_info": info})
    assert (record.meta, record.pool, record.batch_index, record.forced_mode, record.prompt,
            record.data_source) == ({}, "", None, None, None, "")
    assert Record.from_row(record.to_row()) == record


class FakeNumpyInt:
    """What pandas hands out for an int64 column (has `tolist` and `__index__`)."""

    def __init__(self, value):
        self.value = value

    def tolist(self):
        return self.value

    def __index__(self):
        return self.value


def test_row_from_dataframe_like_values():
    row = json.loads(json.dumps(REFERENCE_ROW))
    row["extra_info"]["batch_index"] = FakeNumpyInt(30)
    assert Record.from_row(row).batch_index == 30


@pytest.mark.parametrize(("mutate", "field"), [
    (lambda r: r.pop("extra_info"), "extra_info"),
    (lambda r: r["extra_info"].pop("payload_json"), "extra_info.payload_json"),
    (lambda r: r["extra_info"].update(payload_json="{not json"), "extra_info.payload_json"),
    (lambda r: r["extra_info"].update(payload_json='"a string"'), "extra_info.payload_json"),
    (lambda r: r["extra_info"].update(payload_json='{"gold": ["5"]}'),
     "extra_info.payload_json.raw_question"),
    (lambda r: r["extra_info"].update(payload_json='{"raw_question": "q", "gold": "5"}'),
     "extra_info.payload_json.gold"),
    (lambda r: r["extra_info"].update(
        payload_json='{"raw_question": "q", "gold": ["5"], "meta": [1]}'),
     "extra_info.payload_json.meta"),
    (lambda r: r["extra_info"].pop("domain"), "extra_info.domain"),
    (lambda r: r["extra_info"].pop("scorer_dataset"), "extra_info.scorer_dataset"),
    (lambda r: r.update(prompt=[{"role": "system", "content": "x"}]), "prompt"),
    (lambda r: r.update(prompt="not a message list"), "prompt"),
    (lambda r: r["extra_info"].update(forced_mode="everything"), "forced_mode"),
])
def test_bad_rows_name_the_field(mutate, field):
    row = json.loads(json.dumps(REFERENCE_ROW))
    mutate(row)
    with pytest.raises(RecordError) as info:
        Record.from_row(row)
    assert f"field {field!r}" in str(info.value)
    if field != "extra_info":
        assert "math-00017" in str(info.value)


texts = st.text(min_size=1, max_size=40).filter(lambda s: s.strip())


@settings(max_examples=60, deadline=None)
@given(sample_id=texts, domain=st.sampled_from(list(Domain)), question=texts,
       gold=st.lists(texts, min_size=1, max_size=3),
       meta=st.dictionaries(st.text(max_size=8), st.one_of(st.integers(), st.text(max_size=8),
                                                          st.lists(st.integers(), max_size=3)),
                            max_size=3),
       batch_index=st.one_of(st.none(), st.integers(0, 10_000)),
       forced_mode=st.sampled_from([None, "single", "multi", "agentic"]),
       prompt=st.one_of(st.none(), texts))
def test_row_round_trip_property(sample_id, domain, question, gold, meta, batch_index,
                                 forced_mode, prompt):
    record = Record(sample_id=sample_id, domain=domain, dataset="d", scorer_dataset="qa_subem",
                    question=question, gold=gold, meta=meta, batch_index=batch_index,
                    forced_mode=forced_mode, prompt=prompt)
    row = record.to_row()
    assert Record.from_row(json.loads(json.dumps(row))) == record


# ---------------------------------------------------------------------------- JSONL
def test_jsonl_round_trip(tmp_path):
    records = [make(), code_record(), Record.from_row(REFERENCE_ROW),
               make(sample_id="q-2", question="Ünïcode — 質問?", gold=["✓"])]
    path = tmp_path / "rows.jsonl"
    assert write_jsonl(path, records) == 4
    assert read_jsonl(path) == records
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 4 and "質問" in lines[3]  # UTF-8, not \\u escapes
    assert json.loads(lines[2]) == REFERENCE_ROW
    assert not list(tmp_path.glob(".*tmp*"))


def test_jsonl_bad_lines_name_file_and_line(tmp_path):
    good = json.dumps(make().to_row())
    other = json.dumps(make(sample_id="q-2").to_row())  # sample ids must be unique per file
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{good}\n\n{other}\n{{broken\n", encoding="utf-8")
    with pytest.raises(RecordError, match=rf"^{path}:4: invalid JSON"):
        read_jsonl(path)
    row = make().to_row()
    row["extra_info"]["domain"] = "ASTROLOGY"
    path.write_text(f"{good}\n{json.dumps(row)}\n", encoding="utf-8")
    with pytest.raises(RecordError, match=rf"^{path}:2: record 'q-1': field 'domain'"):
        read_jsonl(path)
    path.write_text("[1, 2]\n", encoding="utf-8")
    with pytest.raises(RecordError, match=rf"^{path}:1: row: expected an object"):
        read_jsonl(path)


def test_write_jsonl_rejects_non_records_and_leaves_no_file(tmp_path):
    path = tmp_path / "out.jsonl"
    with pytest.raises(RecordError, match="item 1 is a dict"):
        write_jsonl(path, [make(), {"sample_id": "x"}])
    assert not path.exists() and not list(tmp_path.iterdir())


# ---------------------------------------------------------------------------- files, parquet
def test_parquet_round_trip(tmp_path):
    records = [*synthetic_tasks(15, seed=4), make(), code_record(), Record.from_row(REFERENCE_ROW),
               make(sample_id="q-2", question="Ünïcode — 質問?", gold=["✓"], batch_index=None,
                    forced_mode=None, prompt="Route this: 質問")]
    assert any(r.meta.get("tests") for r in records[:15])  # code rows with test lists
    path = tmp_path / "rows.parquet"
    assert write_parquet(path, records) == len(records)
    assert read_parquet(path) == records
    assert read_records(path) == records
    assert not list(tmp_path.glob(".*tmp*"))
    table = pq.read_table(path)
    assert table.column_names == ["data_source", "prompt", "extra_info", "ability"]
    assert pa.types.is_struct(table.schema.field("extra_info").type)
    row = table.slice(17, 1).to_pylist()[0]  # the reference row, as pyarrow hands it out
    assert row["extra_info"]["payload_json"] == REFERENCE_ROW["extra_info"]["payload_json"]
    assert row["prompt"] == REFERENCE_ROW["prompt"] and row["ability"] == "routing"
    assert write_parquet(tmp_path / "empty.parquet", []) == 0
    assert read_parquet(tmp_path / "empty.parquet") == []


def test_parquet_reads_verl_layouts(tmp_path):
    """extra_info as a struct with unknown fields and nested columns, or as a JSON string."""
    info = dict(REFERENCE_ROW["extra_info"])
    struct_row = {**REFERENCE_ROW, "reward_model": {"style": "rule", "ground_truth": "5"},
                  "extra_info": info}
    other = json.loads(json.dumps(struct_row))
    other["extra_info"].update(sample_id="math-00018", index=None)
    path = tmp_path / "verl.parquet"
    pq.write_table(pa.Table.from_pylist([struct_row, other]), path)
    first, second = read_parquet(path)
    assert first.extras["reward_model"] == {"style": "rule", "ground_truth": "5"}
    assert first.to_row()["extra_info"] == REFERENCE_ROW["extra_info"]
    assert "extra_info.index" not in second.extras  # a null struct field reads as absent
    as_text = {**REFERENCE_ROW, "extra_info": json.dumps(REFERENCE_ROW["extra_info"])}
    pq.write_table(pa.Table.from_pylist([as_text]), path)
    assert read_parquet(path) == [Record.from_row(REFERENCE_ROW)]


def _rows_with_bad_domain(tmp_path, suffix):
    rows = [make(sample_id=f"q-{i}").to_row() for i in range(4)]
    rows[1]["extra_info"]["domain"] = "ASTROLOGY"
    path = tmp_path / f"bad{suffix}"
    if suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.mark.parametrize(("suffix", "where"), [(".jsonl", "2"), (".json", "2"),
                                               (".parquet", "row 1")])
def test_bad_rows_error_names_file_row_and_field(tmp_path, suffix, where):
    path = _rows_with_bad_domain(tmp_path, suffix)
    with pytest.raises(RecordError, match=rf"^{path}:{where}: record 'q-1': field 'domain'"):
        read_records(path)
    stats = ReadStats()
    records = read_records(path, bad_rows="skip", stats=stats)
    assert [r.sample_id for r in records] == ["q-0", "q-2", "q-3"]
    assert (stats.rows, stats.skipped, stats.kept) == (4, 1, 3)
    assert len(stats.errors) == 1 and stats.errors[0].startswith(f"{path}:{where}: ")


def test_skip_mode_counts_and_totals_several_files(tmp_path):
    good = [json.dumps(make(sample_id=f"q-{i}").to_row()) for i in range(3)]
    path = tmp_path / "mixed.jsonl"
    path.write_text(f"{good[0]}\n{{broken\n\n[1]\n{good[1]}\n{good[0]}\n{good[2]}\n",
                    encoding="utf-8")
    stats = ReadStats()
    assert [r.sample_id for r in read_jsonl(path, bad_rows="skip", stats=stats)] == \
        ["q-0", "q-1", "q-2"]
    assert (stats.rows, stats.skipped) == (6, 3)  # the blank line is not a row
    assert [m.split(": ")[0] for m in stats.errors] == [f"{path}:2", f"{path}:4", f"{path}:6"]
    assert "duplicate of line 1" in stats.errors[2]
    read_records(_rows_with_bad_domain(tmp_path, ".parquet"), bad_rows="skip", stats=stats)
    assert (stats.rows, stats.skipped, stats.kept) == (10, 4, 6)
    many = tmp_path / "many.jsonl"
    many.write_text("{broken\n" * 12, encoding="utf-8")
    stats = ReadStats()
    assert read_jsonl(many, bad_rows="skip", stats=stats) == []
    assert stats.skipped == 12 and len(stats.errors) == ReadStats.MAX_ERRORS
    with pytest.raises(ValueError, match="bad_rows must be 'error' or 'skip'"):
        read_jsonl(many, bad_rows="ignore")


def test_duplicate_sample_ids_name_both_rows(tmp_path):
    records = [make(), make(sample_id="q-2"), make(question="Same id, other text?")]
    jsonl = tmp_path / "dup.jsonl"
    write_jsonl(jsonl, records)
    with pytest.raises(RecordError,
                       match=rf"^{jsonl}:3: record 'q-1': field 'sample_id': duplicate of line 1"):
        read_jsonl(jsonl)
    parquet = tmp_path / "dup.parquet"
    write_parquet(parquet, records)
    with pytest.raises(RecordError, match=rf"^{parquet}:row 2: .*duplicate of row 0"):
        read_parquet(parquet)
    stats = ReadStats()
    assert read_parquet(parquet, bad_rows="skip", stats=stats) == records[:2]
    assert stats.skipped == 1


def test_unknown_suffix_and_unreadable_files(tmp_path):
    with pytest.raises(RecordError, match=r"rows\.csv: unknown record file type '\.csv'"):
        read_records(tmp_path / "rows.csv")
    upper = tmp_path / "ROWS.PARQUET"
    write_parquet(upper, [make()])
    assert read_records(upper) == [make()]
    fake = tmp_path / "fake.parquet"
    fake.write_text("not parquet", encoding="utf-8")
    with pytest.raises(RecordError, match=rf"^{fake}: not a readable parquet file"):
        read_parquet(fake, bad_rows="skip")
    pq.write_table(pa.table({"data_source": ["x"]}), fake)
    with pytest.raises(RecordError, match=rf"^{fake}: no 'extra_info' column"):
        read_parquet(fake, bad_rows="skip")
    with pytest.raises(FileNotFoundError):
        read_records(tmp_path / "missing.parquet")


# ---------------------------------------------------------------------------- bytes, empty files
def test_a_non_utf8_jsonl_line_names_file_line_byte_and_column(tmp_path):
    good = [json.dumps(make(sample_id=f"q-{i}").to_row()) for i in range(3)]
    path = tmp_path / "data.jsonl"
    path.write_bytes(f"{good[0]}\n{good[1]}\n".encode() + b'{"caf\xff": 1}\n'
                     + f"{good[2]}\n".encode())
    message = f"{path}:3: not valid UTF-8 (byte 0xff at column 6)"
    with pytest.raises(RecordError) as info:
        read_records(path)
    assert str(info.value) == message


def test_skip_mode_skips_and_counts_a_non_utf8_line(tmp_path):
    good = [json.dumps(make(sample_id=f"q-{i}").to_row()) for i in range(3)]
    path = tmp_path / "data.jsonl"
    path.write_bytes(f"{good[0]}\n".encode() + "é\n".encode("latin-1")
                     + f"{good[1]}\r\n\n{good[2]}".encode())
    stats = ReadStats()
    records = read_records(path, bad_rows="skip", stats=stats)
    assert [r.sample_id for r in records] == ["q-0", "q-1", "q-2"]
    assert (stats.rows, stats.skipped) == (4, 1)
    assert stats.errors == [f"{path}:2: not valid UTF-8 (byte 0xe9 at column 1)"]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_data_file_without_records_is_an_error_naming_it(tmp_path, suffix):
    path = tmp_path / f"empty{suffix}"
    if suffix == ".jsonl":
        path.write_text("\n  \n", encoding="utf-8")
    else:
        write_parquet(path, [])
    with pytest.raises(RecordError) as info:
        read_records(path)
    assert str(info.value) == f"{path}: no records: the file has no rows"
    assert (read_parquet if suffix == ".parquet" else read_jsonl)(path) == []  # the raw readers
    only_bad = tmp_path / f"only_bad{suffix}"
    rows = [make(sample_id=f"q-{i}").to_row() for i in range(2)]
    for row in rows:
        row["extra_info"]["domain"] = "ASTROLOGY"
    if suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), only_bad)
    else:
        only_bad.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    with pytest.raises(RecordError) as info:
        read_records(only_bad, bad_rows="skip")
    assert str(info.value) == f"{only_bad}: no records: every one of its 2 rows was skipped as bad"


def test_an_empty_or_corrupt_parquet_file_is_named(tmp_path):
    empty = tmp_path / "zero.parquet"
    empty.write_bytes(b"")
    with pytest.raises(RecordError, match=rf"^{re.escape(str(empty))}: not a readable parquet"):
        read_records(empty)
    path = tmp_path / "corrupt.parquet"
    write_parquet(path, synthetic_tasks(40, seed=1))
    data = bytearray(path.read_bytes())
    data[4:len(data) // 2] = b"\xff" * (len(data) // 2 - 4)  # the pages; the footer stays intact
    path.write_bytes(bytes(data))
    for bad_rows in ("error", "skip"):
        with pytest.raises(RecordError) as info:
            read_records(path, bad_rows=bad_rows)
        message = str(info.value)
        assert message.startswith(f"{path}:row 0: cannot read the parquet data: "), message
        assert "\n" not in message


def test_write_parquet_rejects_bad_input_and_leaves_no_file(tmp_path):
    path = tmp_path / "out.parquet"
    with pytest.raises(RecordError, match="item 1 is a dict"):
        write_parquet(path, [make(), {"sample_id": "x"}])
    clash = [make(extras={"extra_info.index": 1}),
             make(sample_id="q-2", extras={"extra_info.index": {"a": 1}})]
    with pytest.raises(RecordError, match=r"column 'extra_info\.index'"):
        write_parquet(path, clash)
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------- questions that cannot fit
def _word_limit(calls=None, **changes) -> QuestionLimit:
    """5 words of at most 8 bytes; lines of 13 x 40 + 1000 bytes."""
    def count(question: str) -> int:
        if calls is not None:
            calls.append(question)
        return len(question.split())
    fields = dict(tokens=5, token_bytes=8, count=count, why="test context=9 less the prompt's 4",
                  other_bytes=1000)
    fields.update(changes)
    return QuestionLimit(**fields)


def _write_rows(path, records):
    if path.suffix == ".parquet":
        write_parquet(path, records)
    else:
        write_jsonl(path, records)


@pytest.mark.parametrize(("suffix", "where"), [(".jsonl", ("2", "3")),
                                               (".parquet", ("row 1", "row 2"))])
def test_a_question_that_cannot_fit_names_file_row_tokens_and_limit(tmp_path, suffix, where):
    path = tmp_path / f"long{suffix}"
    records = [make(sample_id="q-0", question="one two three four five"),
               make(sample_id="q-1", question="one two three four five six"),  # 6 tokens
               make(sample_id="q-2", question="x" * 41),  # 1 token, but 41 bytes > 5 x 8
               make(sample_id="q-3", question="fits")]
    _write_rows(path, records)
    with pytest.raises(RecordError) as info:
        read_records(path, limit=_word_limit())
    assert str(info.value) == (f"{path}:{where[0]}: question has 6 tokens; the router's "
                               "context fits 5 (test context=9 less the prompt's 4)")
    stats, calls = ReadStats(), []
    kept = read_records(path, bad_rows="skip", stats=stats, limit=_word_limit(calls))
    assert kept == [records[0], records[3]]
    assert (stats.rows, stats.skipped, stats.too_long) == (4, 2, 2)
    assert stats.errors[1] == (f"{path}:{where[1]}: question has 41 bytes, more than 5 tokens "
                               "of at most 8 bytes can hold; the router's context fits 5 "
                               "(test context=9 less the prompt's 4)")
    assert "x" * 41 not in calls  # over the byte bound: never tokenized
    assert stats.skip_note(path) == (f"{path}: skipped 2 bad rows of 4 (2 with a question too "
                                     f"long for the router's context); first: {stats.errors[0]}")
    assert read_records(path) == records  # no limit, no check
    assert ReadStats().skip_note(path) is None


def test_a_huge_jsonl_line_is_refused_unparsed_and_never_held_whole(tmp_path, monkeypatch):
    import tracemalloc

    from jax_routeweaver.data import record_files

    limit = _word_limit()
    assert limit.line_bytes == 13 * 40 + 1000
    path = tmp_path / "huge.jsonl"
    huge = 50 << 20
    with path.open("w", encoding="utf-8") as out:
        out.write(json.dumps(make(sample_id="q-0").to_row()) + "\n")
        out.write('{"x": "')
        for _ in range(50):
            out.write("a" * (1 << 20))
        out.write('"}\n')
        out.write(json.dumps(make(sample_id="q-1").to_row()) + "\n")
    size = huge + len('{"x": "') + len('"}')
    parsed: list[int] = []

    def loads(text, *args, **kwargs):
        parsed.append(len(text))
        return json.loads(text, *args, **kwargs)

    monkeypatch.setattr(record_files, "json", type("JsonSpy", (), {
        "loads": staticmethod(loads), "dumps": staticmethod(json.dumps),
        "JSONDecodeError": json.JSONDecodeError}))
    stats = ReadStats()
    tracemalloc.start()
    try:
        kept = read_jsonl(path, bad_rows="skip", stats=stats, limit=limit)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [r.sample_id for r in kept] == ["q-0", "q-1"]  # line 3 read as line 3
    assert (stats.rows, stats.skipped, stats.too_long) == (3, 1, 1)
    assert peak < 4 << 20, peak  # the 50 MB line was never held whole
    assert max(parsed) < limit.line_bytes  # nor parsed
    with pytest.raises(RecordError) as info:
        read_records(path, limit=limit)
    assert str(info.value) == (
        f"{path}:2: question: the line has {size:,} bytes; a row whose question fits the "
        "router's context (5 tokens: test context=9 less the prompt's 4) has at most 1,520 "
        "(13 x 40 bytes of question, escaped as JSON in its payload and prompt, + 1,000 for "
        "the other fields); not parsed")


def test_the_line_bound_is_exact_and_covers_a_last_line_without_newline(tmp_path):
    limit = _word_limit()
    row = json.dumps(make().to_row())
    path = tmp_path / "edge.jsonl"
    path.write_text(row.ljust(limit.line_bytes) + "\n", encoding="utf-8")  # JSON may pad
    assert read_jsonl(path, limit=limit) == [make()]
    path.write_text(row.ljust(limit.line_bytes + 1) + "\n", encoding="utf-8")
    with pytest.raises(RecordError, match=rf"^{re.escape(str(path))}:1: question: the line "
                                          r"has 1,521 bytes; .* not parsed$"):
        read_jsonl(path, limit=limit)
    path.write_text(f"{row}\n" + row.ljust(limit.line_bytes + 5), encoding="utf-8")
    stats = ReadStats()
    assert read_jsonl(path, bad_rows="skip", stats=stats, limit=limit) == [make()]
    assert stats.errors[0].startswith(f"{path}:2: question: the line has 1,525 bytes; ")
    # The worst-escaped question that fits (40 control bytes), in its payload and its prompt,
    # stays under the line bound whichever way the line was written.
    worst = make(question="\x01" * limit.question_bytes, prompt="Q: " + "\x01" * 40)
    write_jsonl(path, [worst])
    assert read_jsonl(path, limit=limit) == [worst]
    path.write_text(json.dumps(worst.to_row()) + "\n", encoding="utf-8")  # ensure_ascii
    assert limit.line_bytes - 1000 < path.stat().st_size < limit.line_bytes
    assert read_jsonl(path, limit=limit) == [worst]


def test_a_question_no_tokenizer_reads_is_a_bad_row_under_a_limit(tmp_path):
    path = tmp_path / "surrogate.jsonl"
    path.write_text(json.dumps(make(question="a\ud800b").to_row()) + "\n", encoding="utf-8")
    assert read_jsonl(path)[0].question == "a\ud800b"  # valid JSON, so a valid row
    with pytest.raises(RecordError) as info:
        read_jsonl(path, limit=_word_limit())
    assert str(info.value) == (f"{path}:1: record 'q-1': field 'question': not valid Unicode "
                               "(surrogates not allowed at character 1)")


def test_the_training_loader_counts_the_question_with_the_routers_tokenizer(tmp_path,
                                                                          monkeypatch):
    """Through `build_records`: the run's question limit (the quickstart's tokenizer, a
    random router of 256 positions) lets a question of exactly its tokens through and refuses
    one token more; the limit is exactly what the selector prompt leaves of the context."""
    import io
    from pathlib import Path

    from rich.console import Console

    from jax_routeweaver.models.tokenizer import build_qwen3_tokenizer
    from jax_routeweaver.rl.run import builders
    from jax_routeweaver.rl.run.train_config import load_train_config
    from jax_routeweaver.routing.protocol.prompts import selector_prompt_ids

    path = tmp_path / "train.jsonl"
    quickstart = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
    cfg = load_train_config(quickstart, [f"data.source={path}", "model.init=random",
                                         "model.random.max_position_embeddings=256"])
    tok = build_qwen3_tokenizer()
    monkeypatch.setattr(builders, "build_qwen3_tokenizer", lambda: tok)  # loaded once
    limit = builders.question_limit(cfg, tok, *builders.router_context(cfg, tok))
    prompt = 256 - limit.tokens
    fits = "a" + " a" * (limit.tokens - 1)
    over = fits + " a"
    assert len(selector_prompt_ids(tok, fits)) == 256 < len(selector_prompt_ids(tok, over))
    records = [make(sample_id="q-fits", question=fits), make(sample_id="q-over", question=over)]
    write_jsonl(path, records)
    before = path.read_bytes()
    with pytest.raises(RecordError) as info:
        builders.build_records(cfg, Console(file=io.StringIO()))  # counting_tokenizer
    assert str(info.value) == (
        f"{path}:2: question has {limit.tokens + 1:,} tokens; the router's context fits "
        f"{limit.tokens:,} (model.random.max_position_embeddings=256 less the prompt's "
        f"{prompt})")
    assert path.read_bytes() == before
    skip = load_train_config(quickstart, [f"data.source={path}", "model.init=random",
                                          "model.random.max_position_embeddings=256",
                                          "data.bad_rows=skip"])
    shown = io.StringIO()
    assert builders.build_records(skip, Console(file=shown, width=400), tok) == records[:1]
    assert f"{path}: skipped 1 bad rows of 2 (1 with a question too long" in shown.getvalue()
