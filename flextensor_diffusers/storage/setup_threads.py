"""Set-up work spread over host threads, one unit per task.

Packing, page-locking, host encoding and reading units back are each bound by one core's memory bandwidth
or by a kernel call that releases the GIL, so several threads make progress at once where one would leave
the machine's other cores and memory channels idle.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextvars import ContextVar
from typing import Generic, TypeVar

from tqdm.auto import tqdm

#: Threads that pack, pin, encode and read units at set-up.
PACK_THREADS = max(1, min(8, os.cpu_count() or 1))
#: A bar appears only for work still running after this many seconds: work that ends sooner would only flash a
#: bar at 0/N (tqdm redraws at most every 0.1 s, so quick units never move it) before it is cleared.
BAR_DELAY_S = 0.5

#: Whether set-up work shows progress bars (where stderr is a terminal); a command's ``--quiet`` turns them off.
_show_bars: ContextVar[bool] = ContextVar("flextensor_setup_bars", default=True)

Item = TypeVar("Item")


@contextlib.contextmanager
def progress_bars(show: bool) -> Iterator[None]:
    """Show (or hide) the bars of set-up work started in this block, in this thread and context."""
    token = _show_bars.set(show)
    try:
        yield
    finally:
        _show_bars.reset(token)


class ThreadedWork(Generic[Item]):
    """``work`` on every item on `PACK_THREADS` threads, started at once and running while the caller goes
    on: `wait_for` one item's task, `finish` them all."""

    def __init__(self, work: Callable[[Item], None], items: list[Item], desc: str) -> None:
        self._started = time.perf_counter()
        self._pool = ThreadPoolExecutor(PACK_THREADS)
        self._bar = tqdm(
            total=len(items), desc=desc, disable=None if _show_bars.get() else True, leave=False, delay=BAR_DELAY_S
        )
        self._bar_lock = threading.Lock()  # tasks end on several threads; tqdm's count is not atomic
        self._ended = self._started  # when the last task to end so far ended
        self._futures: list[Future[None]] = [self._pool.submit(work, item) for item in items]
        for future in self._futures:
            future.add_done_callback(self._one_ended)

    def _one_ended(self, _: Future[None]) -> None:
        with self._bar_lock:
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
