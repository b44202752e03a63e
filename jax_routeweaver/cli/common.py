"""What every `routeweaver` subcommand shares: the `Command` record (name, help line,
argument declaration, run function), the program name, the argument types for sizes and
device meshes, and the one-line text of an error."""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jax.sharding import Mesh

PROG = "routeweaver"

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
# HF's convention (`max_shard_size="2GB"`): KB/MB/GB are powers of 1000, KiB/MiB/GiB of 1024.
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@dataclasses.dataclass(frozen=True)
class Command:
    """A subcommand: `add_arguments(parser)` declares it, `run(args) -> exit code` runs it."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def parse_size(text: str) -> int:
    """'2GB' -> 2_000_000_000, '500MB', '100KB', '1GiB' -> 2**30, '4096' -> bytes."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (e.g. 2GB, 500MB, 100KB)")
    size = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    if size <= 0:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: must be positive")
    return size


def parse_mesh(text: str) -> tuple[int, ...]:
    """'1,-1,1' -> (1, -1, 1): the (data, fsdp, tensor) mesh shape, one entry may be -1."""
    try:
        shape = tuple(int(s) for s in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3 or any(s == 0 or s < -1 for s in shape):
        raise argparse.ArgumentTypeError(
            f"invalid mesh {text!r}: expected data,fsdp,tensor sizes such as 1,-1,1")
    return shape


def optional_mesh(shape: tuple[int, ...] | None) -> Mesh | None:
    """The (data, fsdp, tensor) device mesh of `shape` (`make_mesh`), or None for no mesh."""
    if shape is None:
        return None
    from jax_routeweaver.models.sharding import make_mesh

    return make_mesh(shape)


def add_mesh_argument(p: argparse.ArgumentParser) -> None:
    """Add the `--mesh D,F,T` option (a `parse_mesh` shape, default None) to `p`."""
    p.add_argument("--mesh", type=parse_mesh, default=None, metavar="D,F,T",
                   help="shard over a (data,fsdp,tensor) device mesh, e.g. 1,-1,1 "
                        "(default: no mesh, one device)")


def one_line(e: BaseException, limit: int = 1000) -> str:
    """`e`'s message on one line (whitespace collapsed; its type name if empty), cut to
    `limit` characters."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[:limit] + " ..."
