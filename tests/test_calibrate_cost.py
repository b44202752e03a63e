"""`routeweaver calibrate-cost`: P95 of kept rows on a synthetic dump (hand-computed), the
cost_ref.json record, and one-line errors naming file:line."""

import json

import pytest

from jax_routeweaver.cli.app import main
from jax_routeweaver.routing.pools.pricing import PRICE_TABLE_VERSION, REFERENCE_PRICES

KEPT = [0.004, 0.001, 0.010, 0.003, 0.002]  # sorted: .001 .002 .003 .004 .010
ROWS = ([{"cost_usd": c, "infra_failed": 0, "cost_complete": 1, "failure_kind": "correct"}
         for c in KEPT]
        + [{"cost_usd": 5.0, "infra_failed": 1, "cost_complete": 1},       # skipped: infra
           {"cost_usd": None, "infra_failed": True, "cost_complete": False},
           {"cost_usd": 3.0, "infra_failed": False, "cost_complete": False}])  # incomplete


def write_dump(path, rows, blank_after=None):
    lines = [json.dumps(r) for r in rows]
    if blank_after is not None:
        lines.insert(blank_after, "")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_p95_of_kept_rows(tmp_path, capsys):
    dump = write_dump(tmp_path / "dump.jsonl", ROWS, blank_after=2)
    out = tmp_path / "ref" / "cost_ref.json"
    assert main(["calibrate-cost", str(dump), "--out", str(out)]) == 0
    # n = 5, pos = 0.95·4 = 3.8 -> 0.004 + (0.010 − 0.004)·0.8 = 0.0088
    record = json.loads(out.read_text())
    assert record["c_ref_usd"] == pytest.approx(0.0088, abs=1e-15)
    assert record["statistic"] == "P95 of per-trajectory worker cost"
    assert record["n_reference_rollouts"] == 5
    assert record["price_table_version"] == PRICE_TABLE_VERSION
    assert set(record["prices"]) == set(REFERENCE_PRICES)
    assert record["prices"]["worker_5"] == {"model": "llama33_70b", "in": 0.10, "out": 0.32}
    printed = capsys.readouterr().out
    assert repr(record["c_ref_usd"]) in printed and "skipped 2 infra-failed and 1 " \
        "cost-incomplete" in printed and str(out) in printed


def test_default_out_is_next_to_the_dump_and_q(tmp_path, capsys):
    dump = write_dump(tmp_path / "dump.jsonl", ROWS)
    assert main(["calibrate-cost", str(dump), "--q", "0.5"]) == 0
    record = json.loads((tmp_path / "cost_ref.json").read_text())
    assert record["c_ref_usd"] == 0.003 and record["statistic"].startswith("P50 ")
    assert "0.003" in capsys.readouterr().out


@pytest.mark.parametrize("line, problem", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"cost_usd": 0.1, "cost_complete": 1}', "missing field 'infra_failed'"),
    ('{"cost_usd": 0.1, "infra_failed": "0", "cost_complete": 1}', "infra_failed='0'"),
    ('{"cost_usd": 0.1, "infra_failed": 0, "cost_complete": 2}', "cost_complete=2"),
    ('{"cost_usd": "0.1", "infra_failed": 0, "cost_complete": 1}', "cost_usd='0.1'"),
    ('{"cost_usd": -1, "infra_failed": 0, "cost_complete": 1}', "cost_usd=-1"),
    ('{"cost_usd": 0.1, "infra_failed": 0, "cost_complete": 1, '
     '"price_table_version": "other"}', "price_table_version 'other'"),
])
def test_bad_line_names_file_and_line(tmp_path, capsys, line, problem):
    dump = tmp_path / "dump.jsonl"
    dump.write_text(json.dumps(ROWS[0]) + "\n\n" + line + "\n" + json.dumps(ROWS[1]) + "\n")
    assert main(["calibrate-cost", str(dump)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("routeweaver: error: ") and err.count("\n") == 1
    assert f"{dump}:3: " in err and problem in err
    assert not (tmp_path / "cost_ref.json").exists()


def test_no_kept_rows_and_bad_arguments(tmp_path, capsys):
    dump = write_dump(tmp_path / "dump.jsonl", ROWS[5:])
    assert main(["calibrate-cost", str(dump)]) == 2
    err = capsys.readouterr().err
    assert str(dump) in err and "no reference rollouts left" in err
    assert main(["calibrate-cost", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    for q in ("0", "1.5", "x"):
        assert main(["calibrate-cost", str(dump), "--q", q]) == 2
        assert "invalid quantile" in capsys.readouterr().err


def test_help_documents_the_schema(capsys):
    assert main(["calibrate-cost", "--help"]) == 0
    text = capsys.readouterr().out
    for field in ("cost_usd", "infra_failed", "cost_complete", "--out", "--q"):
        assert field in text


def test_the_train_config_takes_c_ref_as_a_number_or_a_cost_ref_file(tmp_path, capsys):
    from jax_routeweaver.config import load_config
    from jax_routeweaver.rl.run.routeweaver_run import c_ref
    from jax_routeweaver.rl.run.train_config import TrainConfig
    from jax_routeweaver.routing.pools.pricing import C_REF_USD

    dump = write_dump(tmp_path / "dump.jsonl", ROWS)
    out = tmp_path / "cost_ref.json"
    assert main(["calibrate-cost", str(dump), "--out", str(out)]) == 0
    for overrides, want in ((["reward.c_ref=0.0001"], 0.0001), ([], C_REF_USD),
                            ([f"reward.c_ref={out}"], 0.0088)):
        cfg = load_config(TrainConfig, None, overrides)
        assert c_ref(cfg) == pytest.approx(want, rel=1e-12), overrides
