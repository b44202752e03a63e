"""`PageCache`: the host-side allocator of the paged KV cache (`paged_engine`).

The device holds one pool of `num_pages` pages of `page_size` token slots
(`models.paged_attention`); this class decides which pages each row uses. A row owns a list of
pages (its page table): position p of the row lives in `pages[p // page_size]`.

Sharing, as vLLM's automatic prefix caching: every full page of a row's tokens gets a chained
hash (page i's hash covers tokens `[0, (i + 1) * page_size)`), registered when the page is
allocated for a prompt (pending until its prefill has run: `ready`) or when the row leaves
(its generated tokens' full pages). A new row whose tokens start with registered pages takes
those pages (refcount + 1) and computes only the rest: the rulebook every row of a call shares
is stored once, and an episode's next turn (its earlier prompt + completion + new tokens)
finds its earlier turns in place. Shared pages are full and read-only; a row writes only its
own, unshared pages.

Refcounts: a page is free (on the free list), cached (refcount 0 but hashed: in an LRU, still
matchable, evicted oldest first when the free list runs out) or in use (refcount >= 1). A
row's pages are released tail first, so a chain's later pages are evicted before its earlier
ones. `invalidate` (new weights) forgets every hash: cached pages become free.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Match:
    """The registered pages a token sequence starts with: `pages` (in order, ready), and
    `blocked`: the next page of the chain is registered but pending (its prefill has not run
    yet), so the row should wait a round to share it instead of computing it again."""

    pages: tuple[int, ...]
    blocked: bool = False


def chain_hashes(tokens: Sequence[int] | np.ndarray, page_size: int,
                 limit: int | None = None) -> list[tuple[int, bytes]]:
    """(chained hash, the page's token bytes) of each full page of `tokens[:limit]`."""
    arr = np.asarray(tokens, np.int64)[:limit]
    out, h = [], 0
    for i in range(len(arr) // page_size):
        block = arr[i * page_size:(i + 1) * page_size].tobytes()
        h = hash((h, block))
        out.append((h, block))
    return out


class PageCache:
    """Pages `0 .. num_pages - 1` of `page_size` slots; rows keyed by any hashable id."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"PageCache: num_pages={num_pages} and page_size={page_size} "
                             "must be >= 1")
        self.num_pages, self.page_size = int(num_pages), int(page_size)
        self._free: collections.deque[int] = collections.deque(range(self.num_pages))
        self._refs = np.zeros(self.num_pages, np.int32)
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._hash_of: dict[int, tuple[int, bytes]] = {}  # page -> (chain hash, its tokens)
        self._page_of: dict[int, int] = {}                # chain hash -> page
        self._pending: set[int] = set()
        self.rows: dict[object, list[int]] = {}
        self.peak_used = 0   # most pages in use at once since `reset_stats`
        self.allocated = 0   # pages handed out (computed into) since `reset_stats`

    # ------------------------------------------------------------------ counts
    @property
    def used(self) -> int:
        """Pages held by rows (refcount >= 1)."""
        return self.num_pages - len(self._free) - len(self._cached)

    @property
    def cached(self) -> int:
        """Pages no row holds whose contents are still matchable."""
        return len(self._cached)

    @property
    def free(self) -> int:
        return len(self._free)

    def pages_for(self, tokens: int) -> int:
        """Pages that hold `tokens` tokens."""
        return -(-tokens // self.page_size)

    def available(self, match: Match | None = None) -> int:
        """Pages a new allocation can get (free + cached), not counting the cached pages of
        `match`, which the row takes as they are."""
        taken = 0 if match is None else sum(p in self._cached for p in match.pages)
        return len(self._free) + len(self._cached) - taken

    def reset_stats(self) -> None:
        self.peak_used, self.allocated = self.used, 0

    # ------------------------------------------------------------------ rows
    def match(self, tokens: Sequence[int], limit: int) -> Match:
        """The longest chain of registered, ready pages `tokens[:limit]` starts with."""
        pages: list[int] = []
        for h, block in chain_hashes(tokens, self.page_size, limit):
            page = self._page_of.get(h)
            if page is None or self._hash_of[page][1] != block:
                break
            if page in self._pending:
                return Match(tuple(pages), blocked=True)
            pages.append(page)
        return Match(tuple(pages))

    def admit(self, row: object, tokens: Sequence[int], match: Match, reserve: int) -> None:
        """Give `row` the pages of `match` plus new ones up to `reserve` tokens; the full
        pages of `tokens` past the match are registered as pending (`ready` once computed).
        The caller checked `available(match)`; ValueError if the row exists."""
        if row in self.rows:
            raise ValueError(f"PageCache: row {row!r} is already admitted")
        for page in match.pages:
            self._acquire(page)
        pages = list(match.pages)
        self.rows[row] = pages
        if not self.grow(row, reserve):
            raise RuntimeError(f"PageCache: no room to admit row {row!r} (check available())")
        for i, (h, block) in enumerate(chain_hashes(tokens, self.page_size)):
            if i >= len(match.pages) and self._register(pages[i], h, block):
                self._pending.add(pages[i])

    def grow(self, row: object, tokens: int) -> bool:
        """Make `row`'s pages hold `tokens` tokens; False (nothing allocated) if the pool
        cannot."""
        pages = self.rows[row]
        need = self.pages_for(tokens) - len(pages)
        if need > self.available():
            return False
        pages.extend(self._take() for _ in range(max(need, 0)))
        self.peak_used = max(self.peak_used, self.used)
        return True

    def ready(self, row: object) -> None:
        """`row`'s prefill has written its pages: other rows may share them now."""
        self._pending.difference_update(self.rows[row])

    def release(self, row: object, tokens: Sequence[int]) -> None:
        """`row` leaves; `tokens` are those whose keys and values its pages hold. Their full
        pages are registered (if no other page holds that chain already) and every page loses
        one reference: unreferenced hashed pages go to the cache, the others are freed."""
        pages = self.rows.pop(row)
        self._pending.difference_update(pages)
        for i, (h, block) in enumerate(chain_hashes(tokens, self.page_size)):
            if i < len(pages) and pages[i] not in self._hash_of:
                self._register(pages[i], h, block)
        for page in reversed(pages):  # tail first: evicted before the pages it extends
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._hash_of:
                    self._cached[page] = None
                else:
                    self._free.append(page)

    def table(self, rows: Sequence[object | None], width: int) -> np.ndarray:
        """Page tables `[len(rows), width]` int32: each row's first `width` pages (None rows
        and unused entries: page 0)."""
        out = np.zeros((len(rows), width), np.int32)
        for i, row in enumerate(rows):
            if row is not None:
                pages = self.rows[row][:width]
                out[i, :len(pages)] = pages
        return out

    def invalidate(self) -> None:
        """Forget every registered page (the weights changed): cached pages are freed, rows
        still holding pages keep them but nothing matches them any more."""
        self._free.extend(self._cached)
        self._cached.clear()
        self._hash_of.clear()
        self._page_of.clear()
        self._pending.clear()

    # ------------------------------------------------------------------ pages
    def _register(self, page: int, h: int, block: bytes) -> bool:
        if h in self._page_of:
            return False
        self._page_of[h] = page
        self._hash_of[page] = (h, block)
        return True

    def _acquire(self, page: int) -> None:
        if self._refs[page] == 0:
            del self._cached[page]
        self._refs[page] += 1

    def _take(self) -> int:
        """A free page, evicting the least recently released cached page if none is free."""
        if self._free:
            page = self._free.popleft()
        else:
            page, _ = self._cached.popitem(last=False)
            h, _ = self._hash_of.pop(page)
            del self._page_of[h]
        self._refs[page] = 1
        self.allocated += 1
        return page
