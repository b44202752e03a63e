"""Benchmark preparation: every source's converter on fixture files in that dataset's public
layout (tests/fixtures/datasets/<source>/), the readers (HF saved directories, Hub snapshots,
parquet, CSV), malformed-row reports, the training / cold-start / eval / OOD / Router-R1
builders, and `routeweaver data prepare` end to end."""

from __future__ import annotations

import base64
import collections
import json
import pickle
import zlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jax_routeweaver.cli.app import main
from jax_routeweaver.data.benchmarks import SOURCES, bbh_task, last_boxed
from jax_routeweaver.data.dataset_files import read_rows
from jax_routeweaver.data.pipeline import DEFAULT_QUOTAS, PipelineConfig, QueryPipeline
from jax_routeweaver.data.prepare import (
    EVAL_SETS,
    PAPER_MIX,
    PAPER_QUOTAS,
    REFERENCE_MIX,
    SourcePool,
    SourceSpec,
    batch_mix,
    build_eval_sets,
    build_ood_sets,
    build_router_r1_files,
    build_training_file,
    prepare,
)
from jax_routeweaver.data.record_files import read_records, write_parquet
from jax_routeweaver.data.records import Domain, RecordError
from jax_routeweaver.data.sources import SourceStats, draw_key, load_source
from jax_routeweaver.rewards.scorers.registry import score

FIX = Path(__file__).parent / "fixtures" / "datasets"


def load(name: str, rel: str, **kwargs):
    return load_source(name, FIX / rel, **kwargs)


def by_id(records):
    return {r.sample_id: r for r in records}


# ============================================================================ converters
def test_omni_math():
    records = load("omni_math", "omni_math/test.jsonl")
    assert [r.sample_id for r in records] == ["omni_math-0", "omni_math-1", "omni_math-2"]
    first = records[0]
    assert (first.domain, first.dataset, first.scorer_dataset) == (Domain.MATH, "omni_math",
                                                                   "omni_math")
    assert first.gold == ("2, 3",) and first.question.startswith("Find all real $x$")
    assert first.meta == {"difficulty": 2.5, "domain": ["Mathematics -> Algebra -> Other"],
                          "source": "imo_longlists"}
    assert first.data_source == "routeweaver" and first.batch_index is None


def test_math_keeps_levels_2_to_5_and_extracts_the_boxed_answer():
    stats = SourceStats()
    records = by_id(load("math", "math/test.jsonl", stats=stats))
    assert sorted(records) == ["math-0", "math-2", "math-3"]
    assert records["math-0"].gold == ("\\frac{1}{2}",)
    assert records["math-3"].gold == ("\\{-1, 1\\}",)  # nested braces matched
    assert records["math-2"].meta == {"level": 5, "type": "Algebra"}
    assert records["math-0"].dataset == "math_l2-5" and records["math-0"].scorer_dataset == "math"
    assert (stats.rows, stats.unusable, stats.kept, stats.skipped) == (5, 2, 3, 0)
    assert stats.reasons == {"level 1 (MATH L2-5 keeps levels 2-5)": 1,
                             "level 'Level ?' is not 'Level 1'..'Level 5'": 1}


def test_math_500_layout(tmp_path):
    path = _write_jsonl(tmp_path / "test.jsonl", [
        {"problem": "Compute $6 / 4$.", "solution": "It is $\\frac{3}{2}$.",
         "answer": "\\frac{3}{2}", "subject": "Prealgebra", "level": 2,
         "unique_id": "test/prealgebra/1.json"},
        {"problem": "Compute $1 + 1$.", "solution": "2", "answer": "2", "subject": "Prealgebra",
         "level": 1, "unique_id": "test/prealgebra/2.json"}])
    stats = SourceStats()
    (record,) = load_source("math", path, stats=stats)
    assert record.sample_id == "math-test/prealgebra/1.json"
    assert record.gold == ("\\frac{3}{2}",) and record.meta == {"level": 2, "type": "Prealgebra"}
    assert stats.reasons == {"level 1 (MATH L2-5 keeps levels 2-5)": 1}


@pytest.mark.parametrize("text, answer", [
    ("so $\\boxed{42}$.", "42"),
    ("first \\boxed{1}, then \\boxed{\\frac{a}{b}}", "\\frac{a}{b}"),
    ("\\fbox{7}", "7"),
    ("$\\boxed 5$", "5"),
    ("\\boxed{unclosed", None),
    ("no answer here", None),
])
def test_last_boxed(text, answer):
    assert last_boxed(text) == answer


def test_aime_reads_both_public_layouts():
    records = by_id(load("aime", "aime"))  # a folder: the AIME_1983_2024 CSV and aimo jsonl
    assert records["aime-1983-I-1"].gold == ("60",)
    assert records["aime-1983-I-1"].meta == {"year": "1983"}
    assert records["aime-0"].gold == ("16",)
    assert records["aime-0"].question == "Find the number of positive divisors of $2024$."
    assert {r.scorer_dataset for r in records.values()} == {"math"}


def test_satbench_question_and_label():
    sat, unsat = load("satbench", "satbench/SATBench-problems.jsonl")
    assert sat.gold == ("SAT",) and unsat.gold == ("UNSAT",)
    assert (sat.domain, sat.scorer_dataset) == (Domain.REASON, "satbench")
    assert sat.question == ("Three friends decide whether to attend a concert.\n\n"
                            "1. Alice or Bob attends.\n2. Alice does not attend.\n"
                            "3. If Bob attends, Carol attends.\n\n"
                            "Can all these conditions be satisfied at the same time?")
    # Already numbered conditions are not numbered twice.
    assert "\n1. The red light is on.\n2. If" in unsat.question
    assert "1. 1." not in unsat.question


def test_supergpqa_options_and_letter():
    first, second = load("supergpqa", "supergpqa/SuperGPQA-all.jsonl")
    assert first.sample_id == "supergpqa-a1b2c3d4" and first.gold == ("C",)
    assert first.question.splitlines()[2:5] == ["A) Nucleus", "B) Ribosome", "C) Mitochondrion"]
    assert first.question.splitlines()[-1] == "J) Endoplasmic reticulum"
    assert second.gold == ("B",) and second.domain is Domain.KNOWLEDGE
    assert first.meta["subfield"] == "Cell Biology"


def test_gpqa_diamond_shuffles_options_deterministically():
    records = load("gpqa_diamond", "gpqa_diamond/gpqa_diamond.csv")
    again = load("gpqa_diamond", "gpqa_diamond/gpqa_diamond.csv")
    assert [(r.question, r.gold) for r in records] == [(r.question, r.gold) for r in again]
    correct = {"gpqa_diamond-recA1b2C3d4E5f6G7": "Photon", "gpqa_diamond-recH8i9J0k1L2m3N4": "+7"}
    for record in records:
        lines = dict(line.split(") ", 1) for line in record.question.splitlines()
                     if line[:2] in ("A)", "B)", "C)", "D)"))
        assert sorted(lines) == ["A", "B", "C", "D"]
        assert lines[record.gold[0]] == correct[record.sample_id]
    assert records[0].question.startswith("Which particle mediates the electromagnetic force?"
                                          "\nChoose one.")  # a quoted multi-line CSV cell
    # The hash puts the correct answer somewhere other than first for at least one row.
    assert {r.gold[0] for r in records} != {"A"}
    assert records[0].scorer_dataset == "mc_letter"


def test_bbh_task_names_and_gold_variants(tmp_path):
    records = by_id(load("bbh", "bbh"))
    assert records["bbh-boolean_expressions-0"].gold == ("False",)
    assert records["bbh-date_understanding-2"].gold == ("(B)", "B")
    assert records["bbh-date_understanding-2"].meta == {"task": "date_understanding"}
    # lukaemon/bbh snapshot layout: <task>/test-00000-of-00001.parquet
    shard = tmp_path / "snapshot" / "navigate" / "test-00000-of-00001.parquet"
    shard.parent.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([{"input": "Take 1 step. Are you back?",
                                          "target": "No"}]), shard)
    (record,) = load_source("bbh", tmp_path / "snapshot")
    assert record.meta["task"] == "navigate" and record.sample_id == "bbh-navigate-0"


@pytest.mark.parametrize("path, task", [
    ("bbh/boolean_expressions.json", "boolean_expressions"),
    ("x/navigate/test-00000-of-00001.parquet", "navigate"),
    ("saved/web_of_lies/test/data-00000-of-00001.arrow", "web_of_lies"),
])
def test_bbh_task(path, task):
    assert bbh_task(Path(path)) == task


def test_apps_stdin_and_call_based_tests():
    stats = SourceStats()
    records = by_id(load("apps", "apps/test.jsonl", stats=stats))
    stdin, call = records["apps-4001"], records["apps-4002"]
    assert stdin.scorer_dataset == "stdin" and stdin.gold == ()
    assert stdin.meta["tests"] == [{"input": "1 2\n", "output": "3\n"},
                                   {"input": "10 -3\n", "output": "7\n"}]
    assert stdin.meta["test_type"] == "stdin" and stdin.question.endswith(
        "Use Standard Input format")
    assert call.scorer_dataset == "apps_functional" and call.meta["func_name"] == "add"
    assert call.meta["tests"][0] == {"input": [1, 2], "output": [3]}
    assert "def add(a, b):" in call.question and call.question.endswith("Use Call-Based format")
    assert stats.reasons == {"no tests (empty input_output)": 1}


def test_livecodebench_decodes_compressed_private_tests():
    records = by_id(load("livecodebench", "livecodebench"))
    leet, atcoder = records["livecodebench-3301"], records["livecodebench-abc350_a"]
    assert leet.meta["tests"] == [{"input": "[1, 5, 3]", "output": "8"},
                                  {"input": "[2, 2]", "output": "4"},
                                  {"input": "[-1, -2, 7]", "output": "6"}]
    assert (leet.meta["test_type"], leet.meta["func_name"]) == ("functional", "largestPair")
    assert "class Solution:" in leet.question and leet.scorer_dataset == "livecodebench"
    assert atcoder.meta["tests"] == [{"input": "3\n", "output": "6\n"},
                                     {"input": "100\n", "output": "200\n"}]
    assert atcoder.meta["test_type"] == "stdin" and "func_name" not in atcoder.meta
    assert atcoder.meta["platform"] == "atcoder"


class _Evil:
    def __reduce__(self):
        return (print, ("unpickled code ran",))


def test_livecodebench_refuses_pickled_objects(tmp_path, capsys):
    row = json.loads((FIX / "livecodebench/test.jsonl").read_text().splitlines()[0])
    row["private_test_cases"] = base64.b64encode(zlib.compress(pickle.dumps(_Evil()))).decode()
    path = tmp_path / "lcb.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(RecordError, match=r"lcb\.jsonl:1: livecodebench: field "
                                          r"'private_test_cases': .*refusing to load"):
        load_source("livecodebench", path)
    assert "unpickled code ran" not in capsys.readouterr().out


def test_taco_stdin_and_call_based():
    stdin, call = load("taco", "taco")
    assert (stdin.sample_id, stdin.dataset, stdin.scorer_dataset) == ("taco-0", "taco_mm",
                                                                      "taco_mm")
    assert stdin.meta["tests"][1] == {"input": "10\n", "output": "55\n"}
    assert call.scorer_dataset == "apps_functional" and call.dataset == "taco_mm"
    assert call.meta["func_name"] == "solution"


def test_recall_sources():
    popqa = by_id(load("popqa", "popqa"))  # TSV
    assert popqa["popqa-4222362"].gold == ("politician", "political leader", "political figure")
    assert popqa["popqa-4222362"].scorer_dataset == "qa_subem"
    stats = SourceStats()
    trivia = by_id(load("triviaqa", "triviaqa", stats=stats))
    assert trivia["triviaqa-tc_33"].gold == ("Sunset Boulevard", "Sunset Blvd",
                                             "West Sunset Boulevard")
    assert stats.unusable == 1 and "triviaqa-tc_test_1" not in trivia
    simple = by_id(load("simpleqa_verified", "simpleqa_verified"))
    assert simple["simpleqa_verified-17"].gold == ("Antonín Dvořák",)
    assert {r.domain for r in [*popqa.values(), *trivia.values(), *simple.values()]} == {
        Domain.RECALL}


def test_router_r1_rows_keep_their_shape():
    nq = load("nq", "nq/test.jsonl")
    assert nq[0].sample_id == "nq-test_0" and nq[0].gold == ("Wilhelm Conrad Röntgen",)
    assert nq[0].data_source == "nq" and nq[0].scorer_dataset == "triviaqa"
    assert nq[0].extras == {"ability": "fact-reasoning", "extra_info.index": 0}
    (hotpot,) = load("hotpotqa", "hotpotqa/dev.jsonl")
    assert hotpot.data_source == "hotpotqa" and hotpot.question.startswith("Were Scott")


# ============================================================================ grading
@pytest.mark.parametrize("source, rel, sample_id, answer, wrong", [
    ("supergpqa", "supergpqa/SuperGPQA-all.jsonl", "supergpqa-a1b2c3d4", "The answer is C",
     "B"),
    ("satbench", "satbench/SATBench-problems.jsonl", "satbench-1", "UNSAT", "SAT"),
    ("triviaqa", "triviaqa", "triviaqa-tc_40", "Ross Bagdasarian", "Alvin"),
    ("popqa", "popqa", "popqa-1154381", "techno music", "house"),
    ("simpleqa_verified", "simpleqa_verified", "simpleqa_verified-5", "It opened in 1889.",
     "1887"),
    ("bbh", "bbh", "bbh-date_understanding-2", "B", "A"),
    ("bbh", "bbh", "bbh-date_understanding-2", "(B)", "(A)"),
    ("nq", "nq/train.jsonl", "nq-train_2", "foreigner", "Journey"),
])
def test_converted_gold_grades_with_the_real_scorer(source, rel, sample_id, answer, wrong):
    record = by_id(load(source, rel))[sample_id]
    assert score(record.scorer_dataset, answer, record.gold, record.meta).correct
    assert not score(record.scorer_dataset, wrong, record.gold, record.meta).correct


def test_gpqa_gold_letter_grades():
    for record in load("gpqa_diamond", "gpqa_diamond"):
        assert score(record.scorer_dataset, f"Answer: {record.gold[0]}", record.gold,
                     record.meta).correct


def test_math_gold_grades_with_the_math_scorer():
    record = by_id(load("math", "math/test.jsonl"))["math-0"]
    assert score("math", "$0.5$", record.gold, record.meta).correct
    assert not score("math", "$\\frac{1}{3}$", record.gold, record.meta).correct


@pytest.mark.integration  # runs the programs in the sandbox
def test_code_records_carry_tests_the_code_scorers_run():
    apps = by_id(load("apps", "apps/test.jsonl"))
    rows = {json.loads(line)["problem_id"]: json.loads(line)
            for line in (FIX / "apps/test.jsonl").read_text().splitlines()}
    for pid in (4001, 4002):  # APPS's own reference solutions pass
        record, solution = apps[f"apps-{pid}"], json.loads(rows[pid]["solutions"])[0]
        assert score(record.scorer_dataset, f"```python\n{solution}```", record.gold,
                     record.meta).correct
        assert not score(record.scorer_dataset, "```python\nprint(0)\n```", record.gold,
                         record.meta).correct
    lcb = by_id(load("livecodebench", "livecodebench"))
    pair = ("class Solution:\n    def largestPair(self, nums):\n"
            "        return sum(sorted(nums)[-2:])\n")
    assert score("livecodebench", f"```python\n{pair}```", (), lcb["livecodebench-3301"].meta
                 ).correct
    assert score("livecodebench", "```python\nprint(2 * int(input()))\n```", (),
                 lcb["livecodebench-abc350_a"].meta).correct
    stdin, call = load("taco", "taco")
    assert score(stdin.scorer_dataset, "```python\nn = int(input())\nprint(n*(n+1)//2)\n```",
                 (), stdin.meta).correct
    assert score(call.scorer_dataset, "```python\ndef solution(s):\n    return s[::-1]\n```",
                 (), call.meta).correct


# ============================================================================ reading
def _save_to_disk(directory: Path, rows: list[dict]) -> None:
    """What `datasets.Dataset.save_to_disk` writes: an Arrow IPC stream + state.json."""
    directory.mkdir(parents=True)
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(directory / "data-00000-of-00001.arrow"), "wb") as sink, \
            pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    (directory / "state.json").write_text(json.dumps({
        "_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_fingerprint": "f",
        "_format_type": None, "_split": None}))
    (directory / "dataset_info.json").write_text("{}")


def _fixture_rows(rel: str) -> list[dict]:
    return [json.loads(line) for line in (FIX / rel).read_text().splitlines() if line.strip()]


def test_hf_saved_dataset_and_dataset_dict(tmp_path):
    math_rows = _fixture_rows("math/test.jsonl")
    _save_to_disk(tmp_path / "dd" / "test", math_rows)
    _save_to_disk(tmp_path / "dd" / "train", math_rows[:1])
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    test = load_source("math", tmp_path / "dd", split="test")
    assert [r.sample_id for r in test] == ["math-test-0", "math-test-2", "math-test-3"]
    assert test[0].gold == ("\\frac{1}{2}",)
    assert [r.sample_id for r in load_source("math", tmp_path / "dd" / "train")] == ["math-0"]
    with pytest.raises(RecordError, match=r"splits \['train', 'test'\]; choose one"):
        load_source("math", tmp_path / "dd")
    # A nested struct column (TriviaQA's answer) read from Arrow.
    _save_to_disk(tmp_path / "tqa", [{"question_id": "q1", "question": "Capital of France?",
                                      "answer": {"aliases": ["Paris"], "value": "Paris",
                                                 "type": "WikipediaEntity"}}])
    assert load_source("triviaqa", tmp_path / "tqa")[0].gold == ("Paris",)
    # The Arrow IPC *file* format reads too.
    table = pa.Table.from_pylist(math_rows[:1])
    with pa.OSFile(str(tmp_path / "math.arrow"), "wb") as sink, \
            pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    assert load_source("math", tmp_path / "math.arrow")[0].gold == ("\\frac{1}{2}",)


def test_hub_snapshot_split_filter(tmp_path):
    rows = _fixture_rows("apps/test.jsonl")
    for split, part in (("train", rows[:1]), ("test", rows[1:2])):
        pq.write_table(pa.Table.from_pylist(part), tmp_path / f"{split}-00000-of-00001.parquet")
    assert [r.sample_id for r in load_source("apps", tmp_path, split="test")] == [
        "apps-test-4002"]
    assert len(load_source("apps", tmp_path)) == 2  # no split: every file
    with pytest.raises(RecordError, match="no data files for split 'validation'"):
        load_source("apps", tmp_path, split="validation")
    with pytest.raises(RecordError, match="a split selects files inside a directory"):
        load_source("apps", FIX / "apps/test.jsonl", split="test")


def test_malformed_jsonl_rows_name_file_line_and_field():
    path = FIX / "supergpqa/malformed.jsonl"
    with pytest.raises(RecordError) as err:
        load_source("supergpqa", path)
    assert str(err.value).startswith(f"{path}:2: supergpqa: field 'answer_letter': 'F' is not "
                                      "one of A-D")
    stats = SourceStats()
    records = load_source("supergpqa", path, bad_rows="skip", stats=stats)
    assert [r.sample_id for r in records] == ["supergpqa-a1b2c3d4"]
    assert (stats.rows, stats.skipped, stats.kept) == (3, 2, 1)
    assert stats.errors[0].startswith(f"{path}:2:")
    assert stats.errors[1].startswith(f"{path}:3: supergpqa: field '<line>': invalid JSON")
    with pytest.raises(RecordError, match=r"malformed\.jsonl:1: satbench: field 'satisfiable': "
                                          r"expected true/false, got 'maybe'"):
        load("satbench", "satbench/malformed.jsonl")
    with pytest.raises(RecordError, match=r"malformed\.jsonl:2: apps: field 'input_output': "
                                          r"1 inputs but 0 outputs"):
        load("apps", "apps/malformed.jsonl")


def test_malformed_parquet_and_csv_rows_name_the_row(tmp_path):
    rows = _fixture_rows("supergpqa/SuperGPQA-all.jsonl")
    rows.append({**rows[0], "uuid": "zz", "options": "not a list"})
    path = tmp_path / "train-00000-of-00001.parquet"
    pq.write_table(pa.Table.from_pylist([{**r, "options": json.dumps(r["options"])}
                                         for r in rows[:2]] + [
        {**rows[2], "options": "{not json"}]), path)
    with pytest.raises(RecordError, match=r"\.parquet:row 2: supergpqa: field 'options': "
                                          r"invalid JSON"):
        load_source("supergpqa", path)
    csv_path = tmp_path / "gpqa.csv"
    csv_path.write_text((FIX / "gpqa_diamond/gpqa_diamond.csv").read_text()
                        .replace("+6", ""))  # an empty cell in the second data row
    with pytest.raises(RecordError, match=r"gpqa\.csv:row 1: gpqa_diamond: field "
                                          r"'Incorrect Answer 3': expected a non-empty string"):
        load_source("gpqa_diamond", csv_path)


def test_csv_row_with_more_cells_than_columns(tmp_path):
    path = tmp_path / "simpleqa.csv"
    path.write_text("original_index,problem,answer\n1,Q one?,a\n2,Q two?,b,extra\n")
    with pytest.raises(RecordError, match=r"simpleqa\.csv:row 1: simpleqa_verified: field "
                                          r"'<row>': 1 more cells than the header"):
        load_source("simpleqa_verified", path)


def test_repeated_sample_id_is_malformed(tmp_path):
    path = tmp_path / "nq.jsonl"
    path.write_text((FIX / "nq/train.jsonl").read_text() * 2)
    with pytest.raises(RecordError, match=r"nq\.jsonl:4: nq: field 'id': sample id 'nq-train_0' "
                                          r"repeats .*nq\.jsonl:1"):
        load_source("nq", path)


def test_unreadable_inputs(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_source("apps", tmp_path / "missing.jsonl")
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(RecordError, match="unknown data file type '.txt'"):
        list(read_rows(tmp_path / "x.txt"))
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(RecordError, match="cannot read it as .parquet"):
        load_source("apps", tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="unknown source 'mmlu'"):
        load_source("mmlu", FIX / "apps/test.jsonl")


def test_seeded_order_and_limit():
    records = load("bbh", "bbh", seed=3)
    assert [r.sample_id for r in records] == sorted(
        (r.sample_id for r in records), key=lambda sid: draw_key(3, sid))
    assert load("bbh", "bbh", seed=3, limit=2) == records[:2]
    assert [r.sample_id for r in load("bbh", "bbh", seed=4)] != [r.sample_id for r in records]


# ============================================================================ generated sources
def _gen_row(source: str, i: int) -> dict:
    """Row i of a generated copy of `source`, in its public layout."""
    if source == "omni_math":
        return {"domain": ["Mathematics -> Algebra"], "difficulty": 3.0,
                "problem": f"Compute {i} + {i}.", "solution": "", "answer": str(2 * i),
                "source": "gen"}
    if source == "math":
        return {"problem": f"Compute {i} times 3.", "level": f"Level {2 + i % 4}",
                "type": "Algebra", "solution": f"It is $\\boxed{{{3 * i}}}$."}
    if source == "aime":
        return {"id": i, "problem": f"Find {i}.", "solution": "", "answer": str(i), "url": ""}
    if source == "satbench":
        return {"dims": [1], "num_vars": 1, "num_clauses": 1, "readable": "(x(0))",
                "satisfiable": i % 2 == 0, "scenario": f"Scenario {i}.",
                "variable_mapping": "", "conditions": [f"Condition {i}."],
                "question": "Can every condition hold?"}
    if source == "supergpqa":
        return {"uuid": f"u{i:04d}", "question": f"Question {i}?", "options": ["a", "b", "c"],
                "answer": "c", "answer_letter": "C", "discipline": "Science",
                "field": "Physics", "subfield": "Optics", "difficulty": "easy",
                "is_calculation": False}
    if source == "gpqa_diamond":
        return {"Question": f"GPQA {i}?", "Correct Answer": f"right {i}",
                **{f"Incorrect Answer {k}": f"wrong {k}" for k in (1, 2, 3)},
                "Record ID": f"rec{i:05d}", "Subdomain": "Optics"}
    if source in ("apps", "taco"):
        return {"problem_id": i, "question": f"Print {i}.", "solutions": "[]",
                "input_output": json.dumps({"inputs": ["\n"], "outputs": [f"{i}\n"]}),
                "difficulty": "introductory", "url": "", "starter_code": ""}
    if source == "livecodebench":
        return {"question_title": f"t{i}", "question_content": f"Print {i}.",
                "platform": "atcoder", "question_id": f"abc{i:03d}_a", "contest_id": "abc",
                "contest_date": "2024-01-01T00:00:00", "starter_code": "", "difficulty": "easy",
                "public_test_cases": json.dumps([{"input": "\n", "output": f"{i}\n",
                                                  "testtype": "stdin"}]),
                "private_test_cases": "[]", "metadata": "{}"}
    if source == "popqa":
        return {"id": i, "question": f"Who is person {i}?",
                "possible_answers": json.dumps([f"person {i}"]), "prop": "occupation"}
    if source == "triviaqa":
        return {"question_id": f"tq_{i}", "question": f"Trivia {i}?",
                "answer": {"aliases": [f"answer {i}"], "value": f"Answer {i}"}}
    if source == "simpleqa_verified":
        return {"original_index": i, "problem": f"Fact {i}?", "answer": f"fact {i}",
                "topic": "Science", "answer_type": "Other"}
    if source in ("nq", "hotpotqa"):
        return {"id": f"{source}_{i}", "question": f"{source} question {i}",
                "golden_answers": [f"ans {i}"]}
    raise AssertionError(source)


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = 40


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> dict[str, Path]:
    """Generated copies of every source: ROWS rows each; BBH 3 tasks x 10; NQ/HotpotQA also
    a held-out (test / dev) copy."""
    root = tmp_path_factory.mktemp("sources")
    paths = {name: _write_jsonl(root / f"{name}.jsonl", [_gen_row(name, i) for i in range(ROWS)])
             for name in SOURCES if name != "bbh"}
    for task in ("navigate", "snarks", "web_of_lies"):
        _write_jsonl(root / "bbh" / f"{task}.jsonl",
                     [{"input": f"{task} {i}", "target": "Yes"} for i in range(10)])
    paths["bbh"] = root / "bbh"
    for name in ("nq", "hotpotqa"):
        paths[f"{name}.eval"] = _write_jsonl(root / f"{name}_dev.jsonl", [
            {**_gen_row(name, i), "id": f"dev_{i}"} for i in range(5)])
    return paths


def pools_from(paths: dict[str, Path], seed: int = 0) -> dict[str, SourcePool]:
    return {name: SourcePool.load(name, path, seed=seed) for name, path in paths.items()
            if "." not in name}


def batches_of(records, size=32):
    return [records[i:i + size] for i in range(0, len(records), size)]


# ============================================================================ mix and modes
def test_batch_mix():
    assert batch_mix(REFERENCE_MIX, DEFAULT_QUOTAS, 100) == dict(REFERENCE_MIX)
    assert sum(REFERENCE_MIX.values()) == 3200
    assert batch_mix(PAPER_MIX, PAPER_QUOTAS, 100) == dict(PAPER_MIX)
    assert batch_mix(REFERENCE_MIX, DEFAULT_QUOTAS, 25) == {
        "omni_math": 175, "supergpqa": 175, "satbench": 150, "apps": 100, "popqa": 75,
        "livecodebench": 75, "triviaqa": 50}
    # CODE 14 split 400:300 -> 8:6, RECALL 10 split 300:200 -> 6:4.
    assert batch_mix(REFERENCE_MIX, DEFAULT_QUOTAS, 2) == {
        "omni_math": 14, "supergpqa": 14, "satbench": 12, "apps": 8, "popqa": 6,
        "livecodebench": 6, "triviaqa": 4}
    with pytest.raises(ValueError, match="domain CODE has quota 7 but no source"):
        batch_mix({k: v for k, v in REFERENCE_MIX.items() if k not in ("apps", "livecodebench")},
                  DEFAULT_QUOTAS, 1)
    with pytest.raises(ValueError, match="unknown source 'mmlu'"):
        batch_mix({**REFERENCE_MIX, "mmlu": 5}, DEFAULT_QUOTAS, 1)
    with pytest.raises(ValueError, match="'aime' is MATH, which has no quota"):
        batch_mix({"aime": 5, "nq": 5}, {"RECALL": 1}, 1)


# ============================================================================ builders
def test_training_file_batches(generated):
    records = build_training_file(pools_from(generated, seed=7), batches=2, seed=7)
    assert len(records) == 64
    order = [Domain.MATH] * 7 + [Domain.CODE] * 7 + [Domain.KNOWLEDGE] * 7 + \
        [Domain.REASON] * 6 + [Domain.RECALL] * 5
    for b, batch in enumerate(batches_of(records)):
        assert [r.domain for r in batch] == order  # grouped in quota order
        assert {r.batch_index for r in batch} == {b}
        assert sorted(collections.Counter(r.forced_mode for r in batch).values()) == [10, 11, 11]
    assert {r.pool for r in records} == {"train"}
    counts = collections.Counter(r.dataset for r in records)
    assert counts == {"omni_math": 14, "supergpqa": 14, "satbench": 12, "apps": 8,
                      "livecodebench": 6, "popqa": 6, "triviaqa": 4}
    assert len({r.sample_id for r in records}) == 64
    # Determinism: same seed, same file; another seed, another draw.
    assert build_training_file(pools_from(generated, seed=7), batches=2, seed=7) == records
    other = build_training_file(pools_from(generated, seed=8), batches=2, seed=8)
    assert [r.sample_id for r in other] != [r.sample_id for r in records]
    # Read back with shuffle off, the pipeline serves exactly these batches.
    pipeline = QueryPipeline(records, PipelineConfig(shuffle=False, group_size=1))
    for b, batch in enumerate(batches_of(records)):
        assert pipeline.batch(b).records == tuple(batch)


def test_cold_pool_is_disjoint_and_paper_mix(generated):
    pools = pools_from(generated)
    train = build_training_file(pools, batches=1)
    cold = build_training_file(pools, batches=1, first_index=0, pool="cold_pool")
    assert not {r.sample_id for r in train} & {r.sample_id for r in cold}
    assert {r.pool for r in cold} == {"cold_pool"} and {r.batch_index for r in cold} == {0}
    paper = build_training_file(pools_from(generated), batches=1, mix=PAPER_MIX,
                                quotas=PAPER_QUOTAS)
    assert collections.Counter(r.domain for r in paper) == {
        Domain.MATH: 7, Domain.CODE: 7, Domain.KNOWLEDGE: 6, Domain.REASON: 7, Domain.RECALL: 5}


def test_short_source_is_an_error_naming_it(generated, tmp_path):
    short = _write_jsonl(tmp_path / "sat.jsonl", [_gen_row("satbench", i) for i in range(5)])
    pools = {**pools_from(generated), "satbench": SourcePool.load("satbench", short)}
    with pytest.raises(ValueError, match=r"source satbench \(.*sat\.jsonl\): routeweaver_train "
                                         r"needs 12 rows but only 5 of its 5 usable rows"):
        build_training_file(pools, batches=2)
    with pytest.raises(ValueError, match="routeweaver_train needs source 'popqa'"):
        build_training_file({k: v for k, v in pools_from(generated).items() if k != "popqa"},
                            batches=1)


def test_eval_and_ood_sets(generated):
    pools = pools_from(generated)
    sets = build_eval_sets(pools, count=3, counts={"taco": 2})
    assert list(sets) == list(EVAL_SETS)
    assert collections.Counter(r.dataset for r in sets["eval_700_free"]) == {
        "omni_math": 3, "livecodebench": 3, "taco_mm": 2, "supergpqa": 3, "satbench": 3,
        "simpleqa_verified": 3}
    assert collections.Counter(r.dataset for r in sets["eval_600_free"]) == {
        "math_l2-5": 3, "apps": 3, "supergpqa": 3, "satbench": 3, "popqa": 3}
    assert len(sets["eval_triviaqa120_free"]) == 3
    in600 = {r.sample_id for r in sets["eval_600_free"]}
    # set600 and set700 both hold SuperGPQA and SATBench, never the same questions.
    assert not in600 & {r.sample_id for r in sets["eval_700_free"]}
    every = [r for rows in sets.values() for r in rows]
    assert {(r.pool, r.batch_index, r.forced_mode) for r in every} == {("eval", None, None)}
    ood = build_ood_sets(pools, counts={"aime": 4, "gpqa_diamond": 5, "bbh": 7})
    assert [len(v) for v in ood.values()] == [4, 5, 7]
    # BBH spread over its tasks: 7 over 3 tasks -> 3, 2, 2 (extra to the first by name).
    assert collections.Counter(r.meta["task"] for r in ood["ood_bbh1080_free"]) == {
        "navigate": 3, "snarks": 2, "web_of_lies": 2}
    assert {r.pool for rows in ood.values() for r in rows} == {"ood"}

def test_bbh_draw_short_of_one_task(tmp_path):
    for task, n in (("navigate", 1), ("snarks", 5)):
        _write_jsonl(tmp_path / f"{task}.jsonl",
                     [{"input": f"{task} {i}", "target": "Yes"} for i in range(n)])
    pool = SourcePool.load("bbh", tmp_path)
    with pytest.raises(ValueError, match=r"ood_bbh1080_free needs 2 rows of group 'navigate' "
                                         r"\(4 over 2 groups\) but it has 1"):
        pool.take(4, "ood_bbh1080_free", group=SOURCES["bbh"].group)


def test_router_r1_files(generated, tmp_path):
    pools = pools_from(generated)
    held = {n: SourcePool.load(n, generated[f"{n}.eval"]) for n in ("nq", "hotpotqa")}
    files = build_router_r1_files(pools, held, train_count=6, test_count=2)
    train, test = files["train_nh"], files["test_nh"]
    assert collections.Counter(r.data_source for r in train) == {"nq": 6, "hotpotqa": 6}
    assert all(r.sample_id.split("-", 1)[1].startswith("dev_") for r in test)
    assert {r.pool for r in test} == {"router_r1_test"} and len(test) == 4
    assert train[0].extras["ability"] == "fact-reasoning"
    write_parquet(tmp_path / "train_nh.parquet", train)
    assert read_records(tmp_path / "train_nh.parquet") == train


# ============================================================================ prepare + CLI
SMALL = dict(train_batches=1, cold_batches=1, eval_count=2,
             counts={"taco": 1, "aime": 3, "gpqa_diamond": 3, "bbh": 6},
             router_r1_train=3, router_r1_test=2)


def specs(paths: dict[str, Path]) -> list[SourceSpec]:
    return [SourceSpec.parse(f"{k}={p}") for k, p in paths.items()]


def test_prepare_files_do_not_depend_on_what_else_is_built(generated, tmp_path):
    everything = prepare(specs(generated), tmp_path / "all", seed=5, **SMALL)
    names = sorted(str(f.path.relative_to(tmp_path / "all")) for f in everything.files)
    assert names == sorted([
        "parquet/routeweaver_train.parquet", "parquet/routeweaver_cold_pool.parquet",
        "eval/eval_600_free.parquet", "eval/eval_700_free.parquet",
        "eval/eval_triviaqa120_free.parquet", "eval/ood_aime149_free.parquet",
        "eval/ood_gpqa_diamond198_free.parquet", "eval/ood_bbh1080_free.parquet",
        "router_r1/train_nh.parquet", "router_r1/test_nh.parquet"])
    only_eval = prepare(specs(generated), tmp_path / "eval", what=["eval"], seed=5, **SMALL)
    assert [f.path.name for f in only_eval.files] == [
        "eval_600_free.parquet", "eval_700_free.parquet", "eval_triviaqa120_free.parquet"]
    for f in only_eval.files:
        assert read_records(f.path) == read_records(tmp_path / "all" / "eval" / f.path.name)
    train_ids = {r.sample_id for r in read_records(
        tmp_path / "all/parquet/routeweaver_train.parquet")}
    eval_ids = {r.sample_id for f in only_eval.files for r in read_records(f.path)}
    assert not train_ids & eval_ids
    # The held-out NQ/HotpotQA copies feed Router-R1's test file.
    assert {r.sample_id.split("-", 1)[1][:4] for r in read_records(
        tmp_path / "all/router_r1/test_nh.parquet")} == {"dev_"}


def test_prepare_names_missing_sources(generated, tmp_path):
    partial = {k: v for k, v in generated.items() if k not in ("popqa", "taco")}
    with pytest.raises(ValueError, match=r"missing sources \(cold_start: popqa; eval: popqa; "
                                         r"eval: taco; train: popqa\)"):
        prepare(specs(partial), tmp_path, **SMALL)
    assert not list(tmp_path.iterdir())  # nothing written
    prepare(specs(partial), tmp_path, what=["ood"], **SMALL)  # OOD needs neither
    with pytest.raises(ValueError, match=r"counts: \['aimee', 'nq'\] are not in an eval or OOD"):
        prepare(specs(generated), tmp_path, **{**SMALL, "counts": {"aimee": 3, "nq": 2}})


def test_prepare_only_draws_rows_up_to_the_last_file_asked_for(generated, tmp_path):
    small = {**generated, "apps": _write_jsonl(tmp_path / "apps.jsonl",
                                               [_gen_row("apps", i) for i in range(8)])}
    # 8 APPS rows fill one training batch's 4 and the cold pool's 4; eval would need 2 more.
    result = prepare(specs(small), tmp_path / "out", what=["train", "cold_start"], **SMALL)
    assert [f.rows for f in result.files] == [32, 32]
    with pytest.raises(ValueError, match=r"source apps \(.*\): eval_600_free needs 2 rows but "
                                         r"only 0 of its 8 usable rows are left after 8 drawn"):
        prepare(specs(small), tmp_path / "out", what=["eval"], **SMALL)


def test_held_out_copy_must_differ_from_the_training_copy(generated, tmp_path):
    same = [*specs(generated), SourceSpec.parse(f"apps.eval={generated['apps']}")]
    with pytest.raises(ValueError, match="apps.eval=.*the held-out copy is the training copy"):
        prepare(same, tmp_path, **SMALL)


def test_source_spec_parse():
    spec = SourceSpec.parse("apps.eval=/data/apps#test")
    assert (spec.name, spec.path, spec.split, spec.held_out, spec.key) == (
        "apps", Path("/data/apps"), "test", True, "apps.eval")
    assert str(spec) == "apps.eval=/data/apps#test"
    with pytest.raises(ValueError, match="expected NAME"):
        SourceSpec.parse("mmlu=/x")


def test_cli_data_prepare_end_to_end(generated, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["data", "prepare", "--out", str(out), "--seed", "3", "--train-batches", "2",
            "--cold-batches", "1", "--eval-count", "2", "--count", "taco=1",
            "--count", "aime=2", "--count", "gpqa_diamond=2", "--count", "bbh=3",
            "--router-r1-train", "2", "--router-r1-test", "1", "--format", "jsonl"]
    for key, path in generated.items():
        argv += ["--source", f"{key}={path}"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "routeweaver_train.jsonl" in printed and "eval_700_free.jsonl" in printed
    train = read_records(out / "parquet/routeweaver_train.jsonl")
    assert len(train) == 64 and [r.batch_index for r in train[::32]] == [0, 1]
    code = [r for r in train if r.domain is Domain.CODE]
    assert code and all(r.meta["tests"] for r in code)
    manifest = json.loads((out / "prepare.json").read_text())
    assert manifest["settings"]["seed"] == 3
    assert f"apps={generated['apps']}" in manifest["settings"]["sources"]
    assert {f["path"].rsplit("/", 1)[1]: f["rows"] for f in manifest["files"]}[
        "routeweaver_cold_pool.jsonl"] == 32
    assert manifest["sources"]["apps"]["kept"] == ROWS
    # The same command again writes the same files.
    first = (out / "eval/eval_600_free.jsonl").read_text()
    assert main(argv) == 0
    assert (out / "eval/eval_600_free.jsonl").read_text() == first


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["data", "prepare", "--out", str(tmp_path), "--what", "ood",
                 "--source", f"aime={FIX / 'aime'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("routeweaver: error: missing sources (ood: bbh; ood: gpqa_diamond)")
    assert main(["data", "prepare", "--out", str(tmp_path), "--what", "ood",
                 "--source", f"aime={FIX / 'aime'}", "--source", f"bbh={FIX / 'bbh'}",
                 "--source", f"gpqa_diamond={FIX / 'gpqa_diamond'}"]) == 2
    assert "source aime (" in capsys.readouterr().err  # 149 asked, 4 in the fixture
