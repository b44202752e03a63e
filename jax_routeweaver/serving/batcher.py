"""One router sampler shared by every request: concurrent turns sampled as one batch.

Each request runs its own episode (`routing.episodes.episode.run_episodes_async`); when its router
must speak it awaits `BatchingSampler.agenerate`. The batcher queues the turn; a single
drain task takes everything queued, groups it by `SamplingParams` and runs one
`Sampler.generate` per group on one background thread (the sampler is not thread-safe, and
JAX releases the GIL while it computes, so the event loop keeps serving HTTP and worker
replies meanwhile). Turns that arrive while a batch is being sampled wait for the next
batch: under load the batches fill by themselves (continuous batching at turn granularity),
with no fixed window that would add latency to a lone request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from jax_routeweaver.sampling.base import Completion, Sampler, SamplingParams


@dataclasses.dataclass
class _Pending:
    prompts: list[list[int]]
    grammars: list[Any] | None
    future: asyncio.Future[list[Completion]]


class BatchingSampler:
    """`agenerate` merges the turns of concurrent callers into batched `generate` calls on
    `sampler`; at most `max_batch` rows per call (the rest wait for the next). `on_batch(rows,
    seconds)`: called after each `generate` (metrics). Use it from one event loop."""

    def __init__(self, sampler: Sampler, *, max_batch: int = 64,
                 on_batch: Callable[[int, float], None] | None = None):
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} must be >= 1")
        self.sampler, self.max_batch, self.on_batch = sampler, max_batch, on_batch
        self._queue: dict[SamplingParams, list[_Pending]] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = concurrent.futures.ThreadPoolExecutor(1, "router-sampler")
        self.batches = 0
        self.rows = 0

    async def agenerate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                        grammars: Sequence[Any] | None = None) -> list[Completion]:
        """One Completion per prompt, sampled in a batch with other callers' turns."""
        loop = asyncio.get_running_loop()
        if self._task is None:
            self._loop = loop
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._drain(), name="router-batcher")
        elif loop is not self._loop:  # its drain task lives on the first loop: never a hang
            raise RuntimeError("BatchingSampler is tied to the event loop of its first call")
        future: asyncio.Future[list[Completion]] = loop.create_future()
        pending = _Pending([list(p) for p in prompts],
                           None if grammars is None else list(grammars), future)
        self._queue.setdefault(params, []).append(pending)
        assert self._wake is not None
        self._wake.set()
        return await future

    async def aclose(self) -> None:
        """Stop the drain task (queued turns fail) and the sampling thread."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for waiting in self._queue.values():
            for p in waiting:
                if not p.future.done():
                    p.future.set_exception(RuntimeError("the router sampler is shut down"))
        self._queue.clear()
        self._thread.shutdown(wait=True)

    async def _drain(self) -> None:
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                params = next(iter(self._queue))
                batch = self._take(params)
                try:
                    rows = await loop.run_in_executor(self._thread, self._generate, params,
                                                      batch)
                except Exception as error:  # every waiter of the batch fails, not the server
                    for p in batch:
                        if not p.future.done():
                            p.future.set_exception(error)
                    continue
                start = 0
                for p in batch:
                    if not p.future.done():  # a cancelled request's turn is dropped
                        p.future.set_result(rows[start:start + len(p.prompts)])
                    start += len(p.prompts)

    def _take(self, params: SamplingParams) -> list[_Pending]:
        """Up to `max_batch` rows of `params`' queue (at least one caller's turn)."""
        queue = self._queue[params]
        batch, rows = [], 0
        while queue and (not batch or rows + len(queue[0].prompts) <= self.max_batch):
            p = queue.pop(0)
            batch.append(p)
            rows += len(p.prompts)
        if not queue:
            del self._queue[params]
        else:  # the rest go after the other groups' turns
            self._queue[params] = self._queue.pop(params)
        return batch

    def _generate(self, params: SamplingParams, batch: list[_Pending]) -> list[Completion]:
        prompts = [row for p in batch for row in p.prompts]
        constrained = any(p.grammars is not None for p in batch)
        grammars = [g for p in batch for g in (p.grammars or [None] * len(p.prompts))]
        start = time.perf_counter()
        out = self.sampler.generate(prompts, params, grammars if constrained else None)
        self.batches += 1
        self.rows += len(prompts)
        if self.on_batch is not None:
            self.on_batch(len(prompts), time.perf_counter() - start)
        return out
