"""Set-up work spread over host threads, one unit per task.

Packing, page-locking, host encoding and reading units back are each bound by one core's memory bandwidth
or by a kernel call that releases the GIL, so several threads go several times faster.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Generic, TypeVar

from tqdm.auto import tqdm

#: Threads that pack, pin, encode and read units at set-up.
PACK_THREADS = max(1, min(8, os.cpu_count() or 1))

Item = TypeVar("Item")


class ThreadedWork(Generic[Item]):
    """``work`` on every item on `PACK_THREADS` threads, started at once and running while the caller goes
    on: `wait_for` one item's task, `finish` them all."""

    def __init__(self, work: Callable[[Item], None], items: list[Item], desc: str) -> None:
        self._started = time.perf_counter()
        self._pool = ThreadPoolExecutor(PACK_THREADS)
        self._bar = tqdm(total=len(items), desc=desc, disable=None, leave=False)
        self._ended = self._started  # when the last task to end so far ended
        self._futures: list[Future[None]] = [self._pool.submit(work, item) for item in items]
        for future in self._futures:
            future.add_done_callback(self._one_ended)

    def _one_ended(self, _: Future[None]) -> None:
        self._ended = time.perf_counter()
        self._bar.update()

    def wait_for(self, position: int) -> None:
        """Return once the task of ``items[position]`` has ended; raise its error if it failed."""
        self._futures[position].result()

    def finish(self) -> float:
        """Wait for every task, then raise the first failure (in item order); seconds from the start until
        the last task ended (not until this call). Interrupted while waiting (Ctrl-C), it cancels the tasks
        not started and waits for those running before it lets the interrupt go on: the caller's clean-up
        then sees every item as it stays (no task left to pack a unit after set-up put the tensors back)."""
        try:
            wait(self._futures)
        finally:  # after a whole wait every task has ended, and there is nothing left to cancel
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._bar.close()
        for future in self._futures:
            future.result()
        return self._ended - self._started


def on_threads(work: Callable[[Item], None], items: list[Item], desc: str) -> float:
    """Run ``work`` on every item on `PACK_THREADS` threads; seconds of wall time. Every started task
    finishes before the first failure is raised."""
    return ThreadedWork(work, items, desc).finish()
