"""`eval compare` / `eval report` output that tells routers apart: the binomial standard
error of every accuracy in the tables and JSON, and the accuracy-cost Pareto frontier (the
rule, the markdown line, the JSON keys, the plot)."""

import io
import json
import math
from itertools import permutations

import pytest
from rich.console import Console

from jax_routeweaver.eval import frontier, report


def rows(router, correct, n, *, cost=0.001, dataset="d1", domain="MATH", infra=0, set_=None):
    """`n` rows of one dataset, the first `correct` right; `infra` of the wrong ones failed
    for system reasons."""
    out = []
    for i in range(n):
        right = i < correct
        verdict = "correct" if right else ("provider_error" if i >= n - infra
                                           else "genuine_incorrect")
        row = {"sample_id": f"{dataset}-{i}", "dataset": dataset, "domain": domain,
               "router": router, "mode": "single", "workers": ["worker_1"], "answer": "x",
               "correct": right, "verdict": verdict, "cost_usd": cost, "calls": 1,
               "tokens": {"router": 1, "worker_prompt": 10, "worker_completion": 2}}
        if set_:
            row["set"] = f"data/eval/{set_}.parquet"
        out.append(row)
    return out


def pm(p, n):
    """The hand-computed table cell: percent ± binomial se, one decimal each."""
    return f"{100 * p:.1f} ± {100 * math.sqrt(p * (1 - p) / n):.1f}"


# ------------------------------------------------------------------------------ se
def test_se_of_seven_correct_of_ten_is_the_binomial_one():
    s = report.summarize(rows("r", 7, 10))
    expected = math.sqrt(0.7 * 0.3 / 10)  # 0.1449...
    assert expected == pytest.approx(0.1449, abs=1e-4)
    (score,) = s.datasets
    assert score.n == 10 and score.accuracy_se == pytest.approx(expected)
    # one dataset in one domain: every average is that dataset, and so is its se
    assert s.domains_se == {"MATH": pytest.approx(expected)} and s.domains_n == {"MATH": 10}
    assert s.avg_se == pytest.approx(expected) and s.dataset_avg_se == pytest.approx(expected)
    assert "| r | 70.0 ± 14.5 | 70.0 ± 14.5 | 70.0 ± 14.5 | 70.0 ± 14.5 |" in \
        report.accuracy_table({"r": s})
    assert "| 10 | 7 | 70.0 ± 14.5 |" in report.dataset_table(s)


def test_infra_rows_count_in_the_se_as_in_the_accuracy():
    """An infra-failed row is a wrong row of the accuracy's mean, so n counts it too."""
    s = report.summarize(rows("r", 7, 10, infra=2))
    assert s.infra == 2 and s.datasets[0].accuracy == 0.7
    assert s.datasets[0].accuracy_se == pytest.approx(math.sqrt(0.21 / 10))


def test_domain_and_avg_se_propagate_over_the_datasets_averaged():
    s = report.summarize([*rows("r", 1, 2, dataset="a"), *rows("r", 2, 3, dataset="b"),
                          *rows("r", 3, 4, dataset="k", domain="KNOWLEDGE")])
    se = {"a": math.sqrt(0.25 / 2), "b": math.sqrt(2 / 9 / 3), "k": math.sqrt(3 / 16 / 4)}
    math_se = math.sqrt(se["a"] ** 2 + se["b"] ** 2) / 2
    assert s.domains_se["MATH"] == pytest.approx(math_se)
    assert s.domains_se["KNOWLEDGE"] == pytest.approx(se["k"])
    assert s.domains_n == {"MATH": 5, "KNOWLEDGE": 4}
    assert s.avg_se == pytest.approx(math.sqrt(math_se ** 2 + se["k"] ** 2) / 2)
    assert s.dataset_avg_se == pytest.approx(math.sqrt(sum(v ** 2 for v in se.values())) / 3)


def test_se_of_nothing_is_none_not_a_crash(tmp_path):
    assert report.binomial_se(0.5, 0) is None and report.binomial_se(math.nan, 3) is None
    assert report.binomial_se(1.0, 4) == 0.0
    assert report.mean_se([]) is None and report.mean_se([0.1, None]) is None
    # every row left out of the Table-1 averages: no domain, no Avg, and so no se
    s = report.summarize(rows("r", 1, 2, dataset="popqa", domain="RECALL"))
    assert s.domains == {} and s.avg_se is None and s.dataset_avg_se is None
    assert "| r | 50.0 ± 35.4 | – | – | – |" in report.accuracy_table({"r": s})
    report.write_comparison({"r": s, "q": report.summarize(rows("q", 1, 1))}, tmp_path)
    data = json.loads((tmp_path / "comparison.json").read_text())
    assert data["r"]["avg_se"] is None and data["r"]["on_frontier"] is False
    assert "r: no Avg or cost, not placed." in (tmp_path / "comparison.md").read_text()


# ------------------------------------------------------------------------------ frontier
POINTS = {  # name -> (accuracy, cost)
    "cheap": (0.50, 0.001),
    "mid": (0.70, 0.002),
    "twin": (0.70, 0.002),      # a tie with mid: both on the frontier
    "dear": (0.80, 0.010),
    "worse": (0.60, 0.003),     # mid is more accurate and cheaper
    "level": (0.65, 0.002),     # mid: more accurate at the same cost
    "pricier": (0.50, 0.002),   # cheap: as accurate and cheaper
    "oracle": (0.95, 0.0005),   # an upper bound: would dominate everything
}


def test_pareto_frontier_follows_the_rule():
    rest = {n: p for n, p in POINTS.items() if n != "oracle"}
    assert frontier.pareto_frontier(rest) == ["cheap", "mid", "twin", "dear"]  # by cost
    assert frontier.pareto_frontier(POINTS) == ["oracle"]  # the bare rule knows no oracle
    assert frontier.pareto_frontier({"a": (0.5, 0.1), "b": (0.5, 0.1)}) == ["a", "b"]
    assert frontier.pareto_frontier({"a": (0.5, 0.1), "b": (0.5, 0.2)}) == ["a"]
    assert frontier.pareto_frontier({"a": (math.nan, 0.1), "b": (0.1, 0.2)}) == ["b"]
    assert frontier.pareto_frontier({}) == []
    # the rule against brute force over every pair
    on = set(frontier.pareto_frontier(rest))
    for a, b in permutations(rest, 2):
        better = rest[a][0] >= rest[b][0] and rest[a][1] <= rest[b][1] and rest[a] != rest[b]
        assert not (better and b in on), (a, b)
    assert all(any(frontier.dominates(rest[a], rest[b]) for a in rest) for b in set(rest) - on)


def test_frontier_of_sets_the_oracle_apart_and_names_the_dominators():
    f = frontier.frontier_of(POINTS)
    assert f.frontier == ("cheap", "mid", "twin", "dear")
    assert f.dominated == {"worse": "mid", "level": "mid", "pricier": "cheap"}
    assert f.upper_bounds == ("oracle",) and f.unplaced == ()
    assert frontier.is_upper_bound("mode_Oracle") and not frontier.is_upper_bound("knn")
    line = frontier.frontier_line(POINTS)
    assert "cheap, mid, twin, dear;" in line
    assert "worse (by mid: more accurate and cheaper)" in line
    assert "level (by mid: more accurate at the same cost)" in line
    assert "pricier (by cheap: as accurate and cheaper)" in line
    assert "oracle: an upper bound, not on the frontier." in line


# ------------------------------------------------------------------------------ writers
def test_comparison_shows_se_and_frontier_in_md_json_console_and_plot(tmp_path):
    summaries = {"router": report.summarize(rows("router", 7, 10, cost=0.002)),
                 "knn": report.summarize(rows("knn", 8, 10, cost=0.001)),
                 "largest": report.summarize(rows("largest", 9, 10, cost=0.01)),
                 "oracle": report.summarize(rows("oracle", 10, 10, cost=0.0005))}
    paths = report.write_comparison(summaries, tmp_path)
    md = (tmp_path / "comparison.md").read_text()
    assert f"| router | {pm(0.7, 10)} |" in md and f"| knn | {pm(0.8, 10)} |" in md
    assert "| oracle | 100.0 ± 0.0 |" in md
    table_end = md.index("| oracle |")
    line = next(x for x in md.splitlines() if "frontier" in x)
    assert md.index(line) > table_end  # below the table
    assert "knn, largest;" in line and "router (by knn: more accurate and cheaper)" in line
    assert "oracle: an upper bound, not on the frontier." in line

    data = json.loads((tmp_path / "comparison.json").read_text())
    assert list(data) == list(summaries)  # still router -> summary for old readers
    assert data["router"]["avg"] == pytest.approx(0.7)  # old keys kept
    assert data["router"]["avg_se"] == pytest.approx(math.sqrt(0.021))
    assert data["knn"]["datasets"][0]["accuracy_se"] == pytest.approx(math.sqrt(0.016))
    assert data["knn"]["datasets"][0]["n"] == 10 and data["knn"]["domains_n"] == {"MATH": 10}
    assert {n: (d["on_frontier"], d["dominated_by"], d["upper_bound"])
            for n, d in data.items()} == {"router": (False, "knn", False),
                                          "knn": (True, None, False),
                                          "largest": (True, None, False),
                                          "oracle": (False, None, True)}

    console = Console(file=io.StringIO(), width=200)
    console.print(report.console_table(summaries))
    assert pm(0.7, 10) in console.file.getvalue()

    png = tmp_path / "accuracy_vs_cost.png"
    assert png in paths and png.stat().st_size > 1000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_single_router_summary_has_se_but_no_frontier_line(tmp_path):
    s = report.summarize(rows("r", 7, 10))
    report.write_summary(s, tmp_path)
    md = (tmp_path / "summary.md").read_text()
    assert "70.0 ± 14.5" in md and "frontier" not in md
    assert (tmp_path / "accuracy_vs_cost.png").stat().st_size > 0
