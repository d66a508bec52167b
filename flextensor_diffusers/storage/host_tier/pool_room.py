"""The locked pool held to the host tier's budget: what its buffers may hold beyond their payloads, and which idle
ones it keeps.

The pool (`storage.locked_pool`) hands payload buffers on from the units let go to the units read, so that reads and
hand-overs make no driver call. But a buffer kept idle is RAM the host copies no longer count: it may be kept only
where the budget has room for it. `PoolRoom` says how much, from the tier's own counts:

* **Idle buffers** are kept up to the room left in the host copies' share, plus what the reads under way reserved
  for units whose reads have no buffer yet (those buffers will hold them). They are trimmed to that after every
  change: a component moved out, one about to be packed (the room it takes is not theirs), a switch, a hand-over.
* **Larger buffers** (one made for the largest payload serves any block) are lent only while the share has room
  for the difference (`LockedPool.allow_slack`), never while the tier is changing what it counts (`changing`).
* **The peak, and making room,** count the idle buffers no reservation will take (`held_beyond`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from ..locked_pool import LockedPool
from .records import Reading

if TYPE_CHECKING:
    from .placement import TierBudget


class PoolRoom:
    """``pool`` against ``budget``'s share, with the host copies' RAM (``ram_bytes``, reservations and the pool's
    slack included) and the reads under way (``readings``) as the tier counts them (`Placement`, which holds this
    room); the tier makes each change of what it counts inside `changing`, under its lock."""

    def __init__(
        self,
        pool: LockedPool,
        budget: TierBudget,
        ram_bytes: Callable[[], int],
        readings: Callable[[], list[Reading]],
    ) -> None:
        self.pool = pool
        self._budget = budget
        self._ram_bytes = ram_bytes
        self._readings = readings

    @contextlib.contextmanager
    def changing(self, upcoming: int = 0) -> Iterator[None]:
        """Around a change of the placement or the reads: meanwhile no buffer larger than its read is lent (a reader
        may take one); after it, even one that raised, lent buffers may hold beyond their reads what is left of the
        share, and the idle ones are trimmed to the room less ``upcoming`` (`trim`)."""
        self.pool.allow_slack(0)
        try:
            yield
        finally:
            self.pool.allow_slack(max(self._budget.weights_budget - self._ram_bytes(), 0))
            self.trim(upcoming)

    def trim(self, upcoming: int = 0) -> None:
        """Free idle buffers beyond what is left of the share less ``upcoming`` (about to be taken otherwise: a
        component packed), and what the reads under way reserved for units that hold no buffer yet."""
        room = self._budget.weights_budget - self._ram_bytes() - upcoming
        self.pool.trim(max(room, 0) + self._unbuffered_bytes())

    def held_beyond(self, reserving: int) -> int:
        """The idle buffers beyond what the reads under way reserved for units that hold no buffer yet, and
        ``reserving`` bytes about to be (which those buffers will hold): RAM held that the tier's ``ram_bytes`` does
        not count. A unit under way holds its buffer already (lent, counted in its reservation): counted among the
        units to come, it would leave as many idle bytes uncounted (up to two units a read)."""
        return max(self.pool.idle_beyond(self._unbuffered_bytes) - reserving, 0)

    def _unbuffered_bytes(self) -> int:
        return sum(r.job.unbuffered_bytes for r in self._readings())

    @property
    def slack_bytes(self) -> int:
        """What the lent buffers hold beyond their reads' pages: RAM the host copies do not count."""
        return self.pool.slack_bytes
