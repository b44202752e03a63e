"""Evaluation dumps -> summaries, tables (the paper's Table 1 and Figure 4) and plots.

A dump (``rows.jsonl``) holds one JSON object per evaluated question with at least
`ROW_KEYS`::

    {"sample_id", "dataset", "domain", "router", "mode": "single"|"multi"|"agentic"|null,
     "workers": [ids called, in order], "answer", "correct": bool, "verdict": failure kind,
     "cost_usd": float, "calls": int,
     "tokens": {"router": int, "worker_prompt": int, "worker_completion": int}}

`summarize` (one router's rows):
    accuracy(dataset)  = mean of `correct` over its rows (infra-failed rows count as wrong,
                         and are counted apart in `infra`)
    domains[d]         = mean of the accuracies of d's datasets (unweighted)
    avg                = mean of the domain averages (the paper's "Avg")
    dataset_avg        = mean of the dataset accuracies
  where domains, avg and dataset_avg take the rows of Table 1's nine benchmarks only
  (`in_table1`): PopQA and the SuperGPQA/SATBench rows of the ``eval_600_free`` set are
  left out of them, as the original's evaluation does, while the per-dataset table keeps
  every row; `avg_covers` names the (set, dataset) pairs the averages cover and
  `avg_excluded` counts the rows left out. Synthetic and custom sets are covered whole.
    mode_shares[m]     = share of rows whose mode is m ("none": no mode was declared), over
                         all rows and per domain
    mean_cost_usd, mean_calls, mean_tokens = means per question over all rows
  Standard errors (`binomial_se`, `mean_se`), over the same rows as the accuracy they go with
  (infra-failed rows included, as wrong):
    accuracy_se(dataset) = sqrt(p (1 - p) / n), p its accuracy, n its rows (`DatasetScore.n`)
    domains_se[d]      = sqrt(sum of its datasets' squared se) / k over d's k datasets, each
                         se binomial over the dataset's Table-1 rows (`domains_n[d]` rows)
    avg_se, dataset_avg_se = the same propagation over the domains / the datasets
  None where there is nothing to average (never NaN).

The accuracy-cost frontier (`eval.frontier`) is taken over (`avg`, `mean_cost_usd`)
(`accuracy_cost_points`).

Writers: `write_summary` (one router: ``summary.json``, ``summary.md``, ``mode_shares.png``,
``accuracy_vs_cost.png``) and `write_comparison` (several: ``comparison.json``,
``comparison.md``, the same two plots over all of them; each router's entry in
``comparison.json`` adds ``on_frontier``, ``dominated_by`` and ``upper_bound``). Plots render
through `matplotlib.figure.Figure` (the Agg canvas): the global pyplot backend is left alone.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from jax_routeweaver.data.records import Domain
from jax_routeweaver.eval.frontier import frontier_line, frontier_of
from jax_routeweaver.rewards.reward import INFRA_KINDS

ROW_KEYS: tuple[str, ...] = ("sample_id", "dataset", "domain", "router", "mode", "workers",
                             "answer", "correct", "verdict", "cost_usd", "calls", "tokens")
TOKEN_KEYS: tuple[str, ...] = ("router", "worker_prompt", "worker_completion")
MODES: tuple[str, ...] = ("single", "multi", "agentic")
NO_MODE = "none"
SHARE_KEYS: tuple[str, ...] = (*MODES, NO_MODE)
DOMAIN_ORDER: tuple[str, ...] = tuple(d.value for d in Domain)
ALL = "All"

ROWS_FILE = "rows.jsonl"
SUMMARY_JSON = "summary.json"
SUMMARY_MD = "summary.md"
COMPARISON_JSON = "comparison.json"
COMPARISON_MD = "comparison.md"
MODE_SHARES_PNG = "mode_shares.png"
ACCURACY_VS_COST_PNG = "accuracy_vs_cost.png"
META_FILE = "eval.json"


# Rows the original's evaluation leaves out of Table 1's averages, by (evaluation set stem,
# dataset); "*" = any set.
TABLE1_EXCLUDED: frozenset[tuple[str, str]] = frozenset({
    ("*", "popqa"), ("eval_600_free", "supergpqa"), ("eval_600_free", "satbench")})


def set_stem(row: Mapping[str, Any]) -> str:
    """The evaluation set a row came from, as a file stem ("" when not recorded)."""
    name = str(row.get("set") or "")
    return Path(name).stem if name.endswith((".parquet", ".jsonl", ".json")) else name


def in_table1(row: Mapping[str, Any]) -> bool:
    """Whether a row counts in Table 1's domain averages (`TABLE1_EXCLUDED`)."""
    dataset = str(row["dataset"])
    return ("*", dataset) not in TABLE1_EXCLUDED \
        and (set_stem(row), dataset) not in TABLE1_EXCLUDED


class RowError(ValueError):
    """A dump row is malformed; the message names the file and line (or the row index)."""


# ------------------------------------------------------------------------------ rows
def check_row(row: Any, where: str) -> dict[str, Any]:
    """`row` if it has every `ROW_KEYS` field with a sane type; RowError naming `where`."""
    if not isinstance(row, dict):
        raise RowError(f"{where}: expected a JSON object, got {type(row).__name__}")
    missing = [k for k in ROW_KEYS if k not in row]
    if missing:
        raise RowError(f"{where}: row lacks {missing} (required: {list(ROW_KEYS)})")
    problems = []
    if not isinstance(row["correct"], bool):
        problems.append(f"correct={row['correct']!r} must be true/false")
    if row["mode"] is not None and row["mode"] not in MODES:
        problems.append(f"mode={row['mode']!r} must be one of {list(MODES)} or null")
    cost = row["cost_usd"]
    if isinstance(cost, bool) or not isinstance(cost, int | float) or not math.isfinite(cost) \
            or cost < 0:
        problems.append(f"cost_usd={cost!r} must be a finite number >= 0")
    if isinstance(row["calls"], bool) or not isinstance(row["calls"], int) or row["calls"] < 0:
        problems.append(f"calls={row['calls']!r} must be an int >= 0")
    if not isinstance(row["workers"], list):
        problems.append(f"workers={row['workers']!r} must be a list of worker ids")
    tokens = row["tokens"]
    if not isinstance(tokens, dict) or any(not isinstance(tokens.get(k), int)
                                           for k in TOKEN_KEYS):
        problems.append(f"tokens={tokens!r} must hold ints {list(TOKEN_KEYS)}")
    for key in ("sample_id", "dataset", "domain", "router"):
        if not isinstance(row[key], str) or not row[key]:
            problems.append(f"{key}={row[key]!r} must be a non-empty string")
    if problems:
        raise RowError(f"{where} (sample {row.get('sample_id')!r}): " + "; ".join(problems))
    return row


def row_key(row: Mapping[str, Any]) -> tuple[str, str]:
    """A row's identity in a dump: (dataset, sample_id)."""
    return str(row["dataset"]), str(row["sample_id"])


def read_rows(path: str | os.PathLike[str], *, repair: bool = False) -> list[dict[str, Any]]:
    """The rows of a dump, checked. A last line without its newline that is not valid JSON
    is a torn append (a crash): with `repair` it is cut from the file, otherwise it is a
    RowError. Any other bad line is a RowError naming the file and line."""
    path = Path(path)
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    rows: list[dict[str, Any]] = []
    good = 0
    for number, line in enumerate(lines, 1):
        last = number == len(lines)
        if not line.strip():
            good += len(line) + (0 if last else 1)
            continue
        try:
            value = json.loads(line)
        except ValueError:
            if last and repair:
                with open(path, "r+b") as f:
                    f.truncate(good)
                break
            hint = " (a torn last line: rerun the evaluation to repair it)" if last else ""
            raise RowError(f"{path}:{number}: not valid JSON{hint}") from None
        rows.append(check_row(value, f"{path}:{number}"))
        good += len(line) + (0 if last else 1)
        if last and repair:  # a whole row whose newline was lost
            with open(path, "ab") as f:
                f.write(b"\n")
    return rows


def append_rows(path: str | os.PathLike[str], rows: Iterable[Mapping[str, Any]]) -> None:
    """Append rows to a dump with one write and fsync (a crash loses at most this batch)."""
    text = "".join(json.dumps(dict(r), ensure_ascii=False, allow_nan=False) + "\n"
                   for r in rows)
    if not text:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, text.encode("utf-8"))
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------ summary
@dataclasses.dataclass(frozen=True)
class DatasetScore:
    """One dataset's numbers; `infra`: rows that failed for system reasons (counted wrong)."""

    dataset: str
    domain: str
    n: int
    correct: int
    accuracy: float
    infra: int
    mean_cost_usd: float
    mean_calls: float
    accuracy_se: float | None = None


@dataclasses.dataclass(frozen=True)
class Summary:
    """One router's evaluation (see the module doc for the formulas). `datasets` in domain
    order (`DOMAIN_ORDER`, then unknown domains by name), then by dataset name; `domains` in
    the same order. `alpha`: the cost trade-off the router was trained with, if known."""

    router: str
    n: int
    datasets: tuple[DatasetScore, ...]
    domains: dict[str, float]
    avg: float
    dataset_avg: float
    mode_shares: dict[str, float]
    mode_shares_by_domain: dict[str, dict[str, float]]
    mean_cost_usd: float
    mean_calls: float
    mean_tokens: dict[str, float]
    infra: int
    alpha: float | None = None
    avg_covers: tuple[str, ...] = ()
    avg_excluded: int = 0
    domains_se: dict[str, float | None] = dataclasses.field(default_factory=dict)
    domains_n: dict[str, int] = dataclasses.field(default_factory=dict)
    avg_se: float | None = None
    dataset_avg_se: float | None = None

    def dataset(self, name: str) -> DatasetScore | None:
        return next((d for d in self.datasets if d.dataset == name), None)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def binomial_se(p: float, n: int) -> float | None:
    """The standard error of a share `p` of `n` rows, sqrt(p (1 - p) / n); None when n is 0
    or p is not a number."""
    if n <= 0 or math.isnan(p):
        return None
    return math.sqrt(max(p * (1 - p), 0.0) / n)


def mean_se(ses: Sequence[float | None]) -> float | None:
    """The standard error of the unweighted mean of k independent estimates whose standard
    errors are `ses`: sqrt(sum se_i^2) / k; None when `ses` is empty or holds a None."""
    if not ses or any(se is None for se in ses):
        return None
    return math.sqrt(sum(se * se for se in ses if se is not None)) / len(ses)


def _domain_rank(domain: str) -> tuple[int, str]:
    return (DOMAIN_ORDER.index(domain) if domain in DOMAIN_ORDER else len(DOMAIN_ORDER), domain)


def _is_infra(row: Mapping[str, Any]) -> bool:
    return bool(row.get("infra", row["verdict"] in INFRA_KINDS))


def _shares(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    counts = {k: 0 for k in SHARE_KEYS}
    for row in rows:
        counts[row["mode"] or NO_MODE] += 1
    return {k: (c / len(rows) if rows else math.nan) for k, c in counts.items()}


def routers(rows: Iterable[Mapping[str, Any]]) -> list[str]:
    """Distinct router names in first-seen order."""
    return list(dict.fromkeys(str(r["router"]) for r in rows))


def summarize(rows: Sequence[Mapping[str, Any]], *, router: str | None = None,
              alpha: float | None = None) -> Summary:
    """One router's `Summary`. Rows of several routers are an error unless `router` names
    the one to keep (`routers(rows)` lists them)."""
    if not rows:
        raise ValueError("summarize: no rows")
    for index, row in enumerate(rows):
        check_row(row, f"row {index}")
    names = routers(rows)
    if router is not None:
        rows = [r for r in rows if r["router"] == router]
        if not rows:
            raise ValueError(f"summarize: no rows of router {router!r} (routers: {names})")
    elif len(names) > 1:
        raise ValueError(f"summarize: rows of several routers {names}; pass router=")
    name = router or names[0]
    seen: set[tuple[str, str]] = set()
    by_dataset: dict[str, list[Mapping[str, Any]]] = {}
    dataset_domain: dict[str, str] = {}
    for row in rows:
        key = row_key(row)
        if key in seen:
            raise ValueError(f"summarize: {name}: sample {key[1]!r} of {key[0]!r} appears "
                             "twice")
        seen.add(key)
        domain = dataset_domain.setdefault(row["dataset"], row["domain"])
        if domain != row["domain"]:
            raise ValueError(f"summarize: dataset {row['dataset']!r} has rows of domains "
                             f"{domain!r} and {row['domain']!r}")
        by_dataset.setdefault(row["dataset"], []).append(row)
    scores = []
    for dataset in sorted(by_dataset, key=lambda d: (_domain_rank(dataset_domain[d]), d)):
        group = by_dataset[dataset]
        correct = sum(bool(r["correct"]) for r in group)
        scores.append(DatasetScore(
            dataset=dataset, domain=dataset_domain[dataset], n=len(group), correct=correct,
            accuracy=correct / len(group), infra=sum(_is_infra(r) for r in group),
            accuracy_se=binomial_se(correct / len(group), len(group)),
            mean_cost_usd=_mean([float(r["cost_usd"]) for r in group]),
            mean_calls=_mean([float(r["calls"]) for r in group])))
    covered = [r for r in rows if in_table1(r)]
    accuracy: dict[str, list[bool]] = {}
    for row in covered:
        accuracy.setdefault(row["dataset"], []).append(bool(row["correct"]))
    averaged = {d: sum(v) / len(v) for d, v in accuracy.items()}
    averaged_se = {d: binomial_se(averaged[d], len(v)) for d, v in accuracy.items()}
    domains: dict[str, float] = {}
    domains_se: dict[str, float | None] = {}
    domains_n: dict[str, int] = {}
    for domain in sorted({dataset_domain[d] for d in averaged}, key=_domain_rank):
        members = [d for d in averaged if dataset_domain[d] == domain]
        domains[domain] = _mean([averaged[d] for d in members])
        domains_se[domain] = mean_se([averaged_se[d] for d in members])
        domains_n[domain] = sum(len(accuracy[d]) for d in members)
    by_domain = {d: _shares([r for r in rows if r["domain"] == d]) for d in domains}
    covers = sorted({f"{set_stem(r) or '-'}/{r['dataset']}" for r in covered})
    return Summary(
        router=name, n=len(rows), datasets=tuple(scores), domains=domains,
        avg=_mean(list(domains.values())), dataset_avg=_mean(list(averaged.values())),
        avg_covers=tuple(covers), avg_excluded=len(rows) - len(covered),
        domains_se=domains_se, domains_n=domains_n, avg_se=mean_se(list(domains_se.values())),
        dataset_avg_se=mean_se(list(averaged_se.values())),
        mode_shares=_shares(rows), mode_shares_by_domain=by_domain,
        mean_cost_usd=_mean([float(r["cost_usd"]) for r in rows]),
        mean_calls=_mean([float(r["calls"]) for r in rows]),
        mean_tokens={k: _mean([float(r["tokens"][k]) for r in rows]) for k in TOKEN_KEYS},
        infra=sum(_is_infra(r) for r in rows), alpha=alpha)


# ------------------------------------------------------------------------------ tables
def _pct(value: float) -> str:
    return "–" if value is None or math.isnan(value) else f"{100 * value:.1f}"


def _pct_se(value: float, se: float | None) -> str:
    """A percent with its standard error, "70.0 ± 2.6"; the percent alone without an se."""
    if se is None or value is None or math.isnan(value) or math.isnan(se):
        return _pct(value)
    return f"{_pct(value)} ± {100 * se:.1f}"


def _usd(value: float) -> str:
    return "–" if math.isnan(value) else f"{value:.3g}"


def _columns(summaries: Sequence[Summary]) -> list[tuple[str, str | None]]:
    """(domain, dataset) columns in Table-1 order; dataset None = the domain's average."""
    pairs = {(s.domain, s.dataset) for summary in summaries for s in summary.datasets}
    columns: list[tuple[str, str | None]] = []
    for domain in sorted({d for d, _ in pairs}, key=_domain_rank):
        columns += [(domain, ds) for ds in sorted(ds for d, ds in pairs if d == domain)]
        columns.append((domain, None))
    return columns


def _md_table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str = "-:") -> str:
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join([":--"] + [align] * (len(header) - 1)) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def accuracy_table(summaries: Mapping[str, Summary]) -> str:
    """Table 1 as markdown: one row per router; per domain its datasets' accuracies (%) and
    the domain average, then Avg (over domains), Avg over datasets, cost and calls per
    question. Every accuracy shows its standard error ("70.0 ± 2.6"). A dataset a router was
    not evaluated on shows "–"."""
    columns = _columns(list(summaries.values()))
    header = ["router", *(f"{d} avg" if ds is None else f"{d} / {ds}" for d, ds in columns),
              "Avg", "Avg (datasets)", "$ / query", "calls / query"]
    body = []
    for name, s in summaries.items():
        cells = []
        for domain, dataset in columns:
            if dataset is None:
                cells.append(_pct_se(s.domains.get(domain, math.nan),
                                     s.domains_se.get(domain)))
            else:
                score = s.dataset(dataset)
                cells.append("–" if score is None else _pct_se(score.accuracy,
                                                                score.accuracy_se))
        body.append([name, *cells, _pct_se(s.avg, s.avg_se),
                     _pct_se(s.dataset_avg, s.dataset_avg_se), _usd(s.mean_cost_usd),
                     f"{s.mean_calls:.2f}"])
    return _md_table(header, body)


def mode_share_table(summary: Summary) -> str:
    """Figure 4 as markdown: mode shares (%) per domain and over all rows; the "none"
    column (no mode declared) only when some row has none."""
    keys = list(MODES) + ([NO_MODE] if summary.mode_shares.get(NO_MODE, 0) > 0 else [])
    rows = [[d, *(_pct(shares[k]) for k in keys)]
            for d, shares in summary.mode_shares_by_domain.items()]
    rows.append([ALL, *(_pct(summary.mode_shares[k]) for k in keys)])
    return _md_table(["domain", *keys], rows)


def dataset_table(summary: Summary) -> str:
    """Per dataset: rows, correct, accuracy (%, ± its standard error), infra-failed rows,
    cost and calls per question."""
    rows = [[s.domain, s.dataset, str(s.n), str(s.correct), _pct_se(s.accuracy, s.accuracy_se),
             str(s.infra), _usd(s.mean_cost_usd), f"{s.mean_calls:.2f}"] for s in summary.datasets]
    return _md_table(["domain", "dataset", "n", "correct", "accuracy %", "infra",
                      "$ / query", "calls / query"], rows)


def console_table(summaries: Mapping[str, Summary]) -> Any:
    """Table 1 as a rich `Table` for the console: per router, the domain averages, Avg,
    Avg over datasets (each ± its standard error), cost and calls per question."""
    from rich.table import Table

    domains = sorted({d for s in summaries.values() for d in s.domains}, key=_domain_rank)
    table = Table(title="accuracy (%) and cost per question")
    for name in ("router", *domains, "Avg", "Avg (datasets)", "$ / query", "calls"):
        table.add_column(name, justify="left" if name == "router" else "right")
    for name, s in summaries.items():
        table.add_row(name, *(_pct_se(s.domains.get(d, math.nan), s.domains_se.get(d))
                              for d in domains),
                      _pct_se(s.avg, s.avg_se), _pct_se(s.dataset_avg, s.dataset_avg_se),
                      _usd(s.mean_cost_usd), f"{s.mean_calls:.2f}")
    return table


def accuracy_cost_points(summaries: Mapping[str, Summary]) -> dict[str, tuple[float, float]]:
    """name -> (Avg, mean worker cost per question in USD): the axes of
    `plot_accuracy_vs_cost` and of the frontier."""
    return {name: (s.avg, s.mean_cost_usd) for name, s in summaries.items()}


# ------------------------------------------------------------------------------ reports
def compare(summaries: Mapping[str, Summary]) -> str:
    """The multi-router report as markdown: Table 1 over all routers (with several routers,
    followed by the accuracy-cost frontier line, `frontier_line`), then each router's mode
    shares per domain (Figure 4)."""
    if not summaries:
        raise ValueError("compare: no summaries")
    parts = ["## Accuracy (%) and cost per question", "", accuracy_table(summaries)]
    if len(summaries) > 1:
        parts += ["", frontier_line(accuracy_cost_points(summaries))]
    first = next(iter(summaries.values()))
    if first.avg_excluded:
        parts += ["", f"Domain averages and Avg cover (as the paper's Table 1): "
                  f"{', '.join(first.avg_covers)}; {first.avg_excluded} rows of the "
                  "other sets' PopQA / SuperGPQA / SATBench are left out of them."]
    for name, summary in summaries.items():
        alpha = "" if summary.alpha is None else f" (α = {summary.alpha:g})"
        parts += ["", f"## Mode shares (%): {name}{alpha}", "", mode_share_table(summary)]
    return "\n".join(parts) + "\n"


def summary_markdown(summary: Summary) -> str:
    alpha = "" if summary.alpha is None else f", α = {summary.alpha:g}"
    return "\n".join([
        f"# Evaluation: {summary.router}", "",
        f"{summary.n} questions, {len(summary.datasets)} datasets{alpha}; "
        f"{summary.infra} infra-failed (counted wrong). Mean tokens per question: "
        + ", ".join(f"{k} {v:.1f}" for k, v in summary.mean_tokens.items()) + ".", "",
        compare({summary.router: summary}).rstrip("\n"), "",
        "## Per dataset", "", dataset_table(summary), ""])


# ------------------------------------------------------------------------------ plots
def plot_mode_shares(summaries: Mapping[str, Summary], path: str | os.PathLike[str]) -> Path:
    """Stacked bars of mode shares per domain (and over all rows), one panel per router."""
    from matplotlib.figure import Figure  # deferred: matplotlib is slow to import

    names = list(summaries)
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    fig = Figure(figsize=(5.0 * cols, 3.6 * rows), layout="constrained")
    colors = {"single": "#4c72b0", "multi": "#dd8452", "agentic": "#55a868",
              NO_MODE: "#bbbbbb"}
    for k, name in enumerate(names):
        s = summaries[name]
        groups = {**s.mode_shares_by_domain, ALL: s.mode_shares}
        ax = fig.add_subplot(rows, cols, k + 1)
        labels = list(groups)
        bottom = [0.0] * len(labels)
        for mode in SHARE_KEYS:
            values = [groups[g][mode] for g in labels]
            if mode == NO_MODE and not any(values):
                continue
            ax.bar(labels, values, bottom=bottom, label=mode, color=colors[mode])
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.set(title=name, ylabel="share of questions", ylim=(0, 1.0))
        ax.tick_params(axis="x", labelrotation=30)
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    path = Path(path)
    fig.savefig(path, dpi=100)
    return path


def plot_accuracy_vs_cost(summaries: Mapping[str, Summary],
                          path: str | os.PathLike[str]) -> Path:
    """Figure 3: average accuracy (`avg`, ± its standard error as a vertical bar) against
    mean cost per question, one point per router, labelled with its α (and its name when α
    is unknown or shared). The accuracy-cost frontier (`frontier_of`) is a step line through
    its routers by cost; dominated routers are hollow circles, upper bounds (oracle) hollow
    stars."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    fig = Figure(figsize=(6.4, 4.6), layout="constrained")
    ax = fig.add_subplot()
    alphas = [s.alpha for s in summaries.values()]
    points = accuracy_cost_points(summaries)
    front = frontier_of(points)
    for k, (name, s) in enumerate(summaries.items()):
        x, y = s.mean_cost_usd, 100 * s.avg
        yerr = None if s.avg_se is None else [100 * s.avg_se]
        color = f"C{k % 10}"
        filled = name in front.frontier
        ax.errorbar([x], [y], yerr=yerr, fmt="*" if name in front.upper_bounds else "o",
                    markersize=11 if name in front.upper_bounds else 7, color=color,
                    markerfacecolor=color if filled else "none", markeredgewidth=1.4,
                    capsize=3, elinewidth=1)
        if s.alpha is None:
            label = name
        elif alphas.count(s.alpha) > 1:
            label = f"α={s.alpha:g} ({name})"
        else:
            label = f"α={s.alpha:g}"
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(5, 5),
                    fontsize="small")
    with_alpha = sorted((s.alpha, s.mean_cost_usd, 100 * s.avg) for s in summaries.values()
                        if s.alpha is not None)
    # The trade-off curve of an α sweep (not when routers share an α: e.g. forced modes).
    if len(with_alpha) > 1 and len({a for a, _, _ in with_alpha}) == len(with_alpha):
        ax.plot([c for _, c, _ in with_alpha], [a for _, _, a in with_alpha], color="grey",
                linewidth=1, alpha=0.6, linestyle=":")
    handles = []
    if len(front.frontier) > 1:
        ax.step([points[n][1] for n in front.frontier],
                [100 * points[n][0] for n in front.frontier], where="post", color="black",
                linewidth=1.2, alpha=0.7, zorder=1)
        handles.append(Line2D([], [], color="black", linewidth=1.2, label="frontier"))
    if len(summaries) > 1:
        handles.append(Line2D([], [], color="grey", marker="o", linestyle="none",
                              label="on the frontier"))
    if front.dominated:
        handles.append(Line2D([], [], color="grey", marker="o", markerfacecolor="none",
                              linestyle="none", label="dominated"))
    if front.upper_bounds:
        handles.append(Line2D([], [], color="grey", marker="*", markerfacecolor="none",
                              markersize=10, linestyle="none", label="upper bound"))
    if handles:
        ax.legend(handles=handles, fontsize="small", loc="best")
    ax.set(xlabel="mean worker cost per question (USD)",
           ylabel="average accuracy (%, ± standard error)", title="accuracy vs cost")
    ax.margins(0.15)
    path = Path(path)
    fig.savefig(path, dpi=100)
    return path


# ------------------------------------------------------------------------------ writers
def write_summary(summary: Summary, out_dir: str | os.PathLike[str]) -> list[Path]:
    """``summary.json``, ``summary.md``, ``mode_shares.png``, ``accuracy_vs_cost.png``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / SUMMARY_JSON).write_text(json.dumps(summary.to_json(), indent=1) + "\n")
    (out / SUMMARY_MD).write_text(summary_markdown(summary))
    one = {summary.router: summary}
    return [out / SUMMARY_JSON, out / SUMMARY_MD,
            plot_mode_shares(one, out / MODE_SHARES_PNG),
            plot_accuracy_vs_cost(one, out / ACCURACY_VS_COST_PNG)]


def write_comparison(summaries: Mapping[str, Summary],
                     out_dir: str | os.PathLike[str]) -> list[Path]:
    """``comparison.json`` (router -> its summary, plus `Frontier.entry`'s keys:
    ``on_frontier``, ``dominated_by``, ``upper_bound``), ``comparison.md`` (`compare`) and
    the two plots over all routers."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    front = frontier_of(accuracy_cost_points(summaries))
    (out / COMPARISON_JSON).write_text(json.dumps(
        {name: {**s.to_json(), **front.entry(name)} for name, s in summaries.items()},
        indent=1) + "\n")
    (out / COMPARISON_MD).write_text(compare(summaries))
    return [out / COMPARISON_JSON, out / COMPARISON_MD,
            plot_mode_shares(summaries, out / MODE_SHARES_PNG),
            plot_accuracy_vs_cost(summaries, out / ACCURACY_VS_COST_PNG)]


def load_summaries(run_dir: str | os.PathLike[str]) -> dict[str, Summary]:
    """The summaries of an evaluation output directory, recomputed from its ``rows.jsonl``
    (one per router in it); α from its ``eval.json`` when that names one router."""
    run = Path(run_dir)
    dump = run / ROWS_FILE
    if not dump.is_file():
        raise FileNotFoundError(f"{run}: no {ROWS_FILE} (not an evaluation output directory)")
    rows = read_rows(dump)
    if not rows:
        raise ValueError(f"{dump}: no rows")
    meta: dict[str, Any] = {}
    if (run / META_FILE).is_file():
        meta = json.loads((run / META_FILE).read_text())
    names = routers(rows)
    alpha = meta.get("alpha") if len(names) == 1 else None
    return {name: summarize(rows, router=name, alpha=alpha) for name in names}
