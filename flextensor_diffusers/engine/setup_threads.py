"""Set-up work spread over host threads, one unit per task.

Packing, page-locking, host encoding and reading units back are each bound by one core's memory bandwidth
or by a kernel call that releases the GIL, so several threads go several times faster.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import TypeVar

from tqdm.auto import tqdm

#: Threads that pack, pin, encode and read units at set-up.
PACK_THREADS = max(1, min(8, os.cpu_count() or 1))

Item = TypeVar("Item")


def on_threads(work: Callable[[Item], None], items: list[Item], desc: str) -> float:
    """Run ``work`` on every item on `PACK_THREADS` threads; seconds of wall time. Every started task
    finishes before the first failure is raised."""
    start = time.perf_counter()
    with ThreadPoolExecutor(PACK_THREADS) as pool, tqdm(total=len(items), desc=desc, disable=None, leave=False) as bar:
        futures = [pool.submit(work, item) for item in items]
        for _done in as_completed(futures):
            bar.update()
        for future in futures:
            future.result()
    return time.perf_counter() - start
