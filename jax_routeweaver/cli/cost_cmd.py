"""`routeweaver calibrate-cost`: C_ref (a quantile of per-trajectory worker cost) from a
rollout dump, written as a cost-reference record; and the reader of that dump."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from jax_routeweaver.cli.common import Command

_DUMP_SCHEMA = """\
DUMP is a JSONL file of rollouts, one JSON object per line (blank lines skipped), e.g. the rows
of `Rewards.as_row()`:
  cost_usd       number >= 0: worker cost of the trajectory in USD, at the price table the
                 rollouts were billed at: the original price table (the simulated pool's), or
                 with --channels the channel file's prices (read only for kept rows; may be
                 null otherwise)
  infra_failed   0/1 (or false/true): system failure; the row is skipped
  cost_complete  0/1 (or false/true): every call had usage and a price; 0 rows are skipped
  price_table_version  optional string; if present it must be that table's version
Other fields are ignored. C_ref is the q-quantile (linear interpolation, pos = q·(n−1)) of
cost_usd over the kept rows, correct and wrong alike (docs/algorithm.md, "Efficiency reward")."""


def _calibrate_cost_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = _DUMP_SCHEMA
    p.add_argument("dump", type=Path, metavar="DUMP", help="JSONL rollout dump (schema below)")
    p.add_argument("--out", type=Path, default=None,
                   help="cost-reference JSON to write (default: cost_ref.json next to DUMP)")
    p.add_argument("--q", type=_quantile, default=0.95,
                   help="quantile in (0, 1] (default: 0.95, the paper's P95)")
    p.add_argument("--channels", type=Path, default=None, metavar="FILE",
                   help="the channel file the DUMP's rollouts were billed with (the run's "
                        "workers.pool): its prices and price_table_version (required) go in "
                        "the record (default: the original price table of the simulated pool)")


def _quantile(text: str) -> float:
    try:
        q = float(text)
    except ValueError:
        q = float("nan")
    if not 0.0 < q <= 1.0:
        raise argparse.ArgumentTypeError(f"invalid quantile {text!r}: expected 0 < q <= 1")
    return q


def _dump_flag(row: dict, name: str, where: str) -> bool:
    if name not in row:
        raise ValueError(f"{where}: missing field {name!r}")
    value = row[name]
    if value not in (0, 1) or not isinstance(value, int | bool):
        raise ValueError(f"{where}: {name}={value!r} must be 0/1 or false/true")
    return bool(value)


def read_cost_dump(path: Path, price_table_version: str) -> list[dict]:
    """The rows of a `calibrate-cost` DUMP, validated; errors name the file and line."""
    import json
    import math

    rows: list[dict] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
            infra, complete = (_dump_flag(row, n, where)
                               for n in ("infra_failed", "cost_complete"))
            version = row.get("price_table_version", price_table_version)
            if version != price_table_version:
                raise ValueError(f"{where}: price_table_version {version!r} is not the "
                                 f"billing table's {price_table_version!r}")
            cost = row.get("cost_usd")
            if not infra and complete and (
                    isinstance(cost, bool) or not isinstance(cost, int | float)
                    or not math.isfinite(cost) or cost < 0):
                raise ValueError(f"{where}: cost_usd={cost!r} must be a finite number >= 0")
            rows.append({"cost_usd": cost, "infra_failed": infra, "cost_complete": complete})
    return rows


def _billing_table(channels: Path | None) -> tuple[Any, str]:
    """(prices, price_table_version) a cost dump was billed at: the original price table, or
    channel file's prices under its `price_table_version` (a C_ref is only meaningful under
    a named table, so a file without one is a ValueError)."""
    from jax_routeweaver.routing.pools.channels import load_channels
    from jax_routeweaver.routing.pools.pricing import PRICE_TABLE_VERSION, REFERENCE_PRICES

    if channels is None:
        return REFERENCE_PRICES, PRICE_TABLE_VERSION
    config = load_channels(channels)
    if config.price_table_version is None:
        raise ValueError(f"{channels}: no price_table_version; a C_ref is only meaningful "
                         "under a named price table: give the channel file one")
    return config.prices(), config.price_table_version


def _calibrate_cost(args: argparse.Namespace) -> int:
    import json

    from jax_routeweaver.routing.pools.pricing import c_ref_from_costs

    prices, version = _billing_table(args.channels)
    rows = read_cost_dump(args.dump, version)
    try:
        result = c_ref_from_costs(rows, q=args.q)
    except ValueError as e:
        raise ValueError(f"{args.dump}: {e}") from None
    if args.q != 0.95:
        result = dataclasses.replace(result, statistic=f"P{args.q * 100:g} of per-trajectory "
                                                       "worker cost")
    out = args.out if args.out is not None else args.dump.parent / "cost_ref.json"
    record = result.to_record(prices, version)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(f"C_ref = {result.c_ref_usd!r} USD ({result.statistic}; n={result.n_reference_rollouts}"
          f", skipped {result.n_skipped_infra_failed} infra-failed and "
          f"{result.n_skipped_cost_incomplete} cost-incomplete) -> {out}")
    return 0


CALIBRATE_COST = Command("calibrate-cost", "compute C_ref (P95 of per-trajectory worker cost) "
                         "from a rollout dump and write cost_ref.json",
                         _calibrate_cost_arguments, _calibrate_cost)
