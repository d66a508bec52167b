"""The packing line: one for the whole process, it copies the units of every model packed progressively
(`host_copies.ProgressivePacking`) into their new host buffers, one unit at a time.

**Why one unit at a time, for the whole process.** A unit's original tensors stay alive until a thread that asks
for its host bytes *adopts* its copy (re-points the tensors at it), so every unit copied ahead of its adoption is
held twice. A window of units per model (one per packing thread) held eight units twice for each model set up,
and a pipeline sets up four at once: on an H100, Wan2.2's host peak was 87.5 GB against 77.5 GB packed before
set-up returned (issue 48). The line copies a unit only when no other is copied and not yet adopted, so host
memory holds at most one unit twice: the host peak is the weights plus the largest unit.

**Invariants.** At most one unit is *copying* or *held* (copied, not adopted) at any time. A unit is copied on a
thread of its own that waits for nothing but the copy: a unit waits for adoption as the held one, never a thread
(an unused model leaves no thread behind, and the interpreter can exit). Adoption happens only on a thread that
asks for a unit's host bytes (`take`), never on the line's thread, so no tensor changes under code reading it on
another thread. Whoever asks adopts the held unit, whatever its model, then the unit asked for is copied next:
no ask waits on a unit only another thread could adopt.

**Order.** Units asked for come first; then the next unit of the model asked last (the one in use: its next unit
is copied while it computes), then the models in the order they began packing, each in position order.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Protocol


class Packer(Hashable, Protocol):
    """A model's packing, as the line sees it (`host_copies.ProgressivePacking`)."""

    #: Positions whose copies are not adopted yet.
    pending: set[int]
    #: Positions whose copies failed, with what they raised (`failure` says it where they are asked for).
    failed: dict[int, BaseException]

    def copy(self, position: int) -> Any:
        """The unit's bytes in a new host buffer (on the line's thread; raises when that fails)."""
        ...

    def adopt(self, position: int, copy: Any) -> None:
        """Re-point the unit's tensors at ``copy`` (on the asking thread); the position leaves ``pending``."""
        ...

    def failure(self, position: int) -> BaseException:
        """The error to raise where the unit at ``position``, whose copy failed, is asked for."""
        ...


@dataclass(frozen=True)
class Held:
    """The unit copied and not adopted yet: whose (weakly: a model dropped without ``remove()`` is let go, its
    held copy with it), where, and its copy."""

    packer: weakref.ref[Packer]
    position: int
    copy: Any


class PackingLine:
    """Copies the units of the packers that `join` it, one at a time (see the module docstring). Packers are held
    weakly: one dropped with its model leaves the line."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        #: Members, in the order they joined: the positions each has left to copy.
        self._queues: weakref.WeakKeyDictionary[Packer, deque[int]] = weakref.WeakKeyDictionary()
        self._asked: deque[tuple[weakref.ref[Packer], int]] = deque()
        self._last_asker: weakref.ref[Packer] | None = None
        self._copying: tuple[weakref.ref[Packer], threading.Thread] | None = None
        self._held: Held | None = None
        self._adopting = False  # a thread is adopting the held unit now

    def join(self, packer: Packer, positions: list[int]) -> None:
        """``packer``'s units at ``positions`` are to be copied (in that order, unless asked for)."""
        with self._cond:
            self._queues[packer] = deque(positions)
            self._pump()

    def take(self, packer: Packer, position: int) -> None:
        """Return once ``packer``'s unit at ``position`` is adopted, adopting the held unit meanwhile (any
        packer's: the line goes on only once it is), on this thread; raise its copy's failure. Interrupted
        (Ctrl-C), the unit being adopted is adopted or still held: asking again goes on."""

        def settled() -> bool:  # adopted, or failed, or a held unit to adopt first
            return position not in packer.pending or position in packer.failed or self._adoptable()

        while position in packer.pending:
            with self._cond:
                self._ask(packer, position)
                self._cond.wait_for(settled)
                if position not in packer.pending:
                    return
                claimed = self._claim()
                if claimed is None:
                    if position in packer.failed:
                        raise packer.failure(position)
                    continue  # the held unit's model was gone
            self._adopt(*claimed)

    def adopt_held(self) -> None:
        """Adopt the held unit, if any and nobody adopts it now, on this thread: lets the line go on."""
        with self._cond:
            claimed = self._claim()
        if claimed is not None:
            self._adopt(*claimed)

    def leave(self, packer: Packer) -> None:
        """Copy nothing more for ``packer``: its units not copied yet stay so, one being copied is waited for, and
        its held one is dropped (never adopted)."""
        with self._cond:
            self._queues.pop(packer, None)
            self._asked = deque(ask for ask in self._asked if ask[0]() is not packer)
            if self._last_asker is not None and self._last_asker() is packer:
                self._last_asker = None
            self._cond.wait_for(lambda: not self._adopting or self._held is None or self._held.packer() is not packer)
            copying = self._copying
        if copying is not None and copying[0]() is packer:
            copying[1].join()  # it drops its copy, finding the packer gone
        with self._cond:
            if self._held is not None and self._held.packer() is packer:
                self._held = None
                self._pump()
            self._cond.notify_all()

    # ------------------------------------------------------------------------------------ internals

    def _adoptable(self) -> bool:
        return self._held is not None and not self._adopting

    def _claim(self) -> tuple[Packer, Held] | None:
        """The held unit and its packer, for this thread to adopt (called holding ``_cond``); None when there is
        none to adopt. One whose packer is gone is dropped (and the next unit copied)."""
        if not self._adoptable():
            return None
        held = self._held
        assert held is not None
        packer = held.packer()
        if packer is None:
            self._held = None
            self._pump()
            return None
        self._adopting = True
        return packer, held

    def _ask(self, packer: Packer, position: int) -> None:
        """``packer`` needs ``position`` now: copied next (unless being copied or held already)."""
        self._last_asker = weakref.ref(packer)
        queue = self._queues.get(packer)
        if queue is not None and position in queue:
            self._asked.append((weakref.ref(packer), position))
        self._pump()

    def _adopt(self, packer: Packer, held: Held) -> None:
        """Adopt ``held`` (claimed by this thread); the next unit is copied once it is adopted."""
        try:
            packer.adopt(held.position, held.copy)
        finally:
            with self._cond:
                self._adopting = False
                if self._held is held and held.position not in packer.pending:
                    self._held = None
                    self._pump()
                self._cond.notify_all()

    def _pump(self) -> None:
        """Start copying the next unit when none is copying or held (called holding ``_cond``)."""
        if self._copying is not None or self._held is not None:
            return
        chosen = self._next()
        if chosen is None:
            return
        packer, position = chosen
        thread = threading.Thread(target=self._copy, args=(packer, position), name="flextensor-pack")
        try:
            thread.start()  # it waits for ``_cond``, held here, before it says anything
        except RuntimeError as exc:  # no thread to be had (at interpreter shutdown, say): said where it is asked for
            packer.failed[position] = exc
            return
        self._copying = (weakref.ref(packer), thread)

    def _next(self) -> tuple[Packer, int] | None:
        """The unit to copy next (see the module docstring's order), taken out of its queue."""
        while self._asked:
            ref, position = self._asked.popleft()
            packer = ref()
            queue = self._queues.get(packer) if packer is not None else None
            if queue is not None and position in queue:
                queue.remove(position)
                return packer, position  # type: ignore[return-value]
        members = list(self._queues.items())
        last = self._last_asker() if self._last_asker is not None else None
        if last is not None and last in self._queues:
            members.insert(0, (last, self._queues[last]))
        for packer, queue in members:
            if queue:
                return packer, queue.popleft()
        return None

    def _copy(self, packer: Packer, position: int) -> None:
        """The line's thread for one unit: copy it, then hold it (or record its failure) and start the next."""
        copy, failure = None, None
        try:
            copy = packer.copy(position)
        except BaseException as exc:  # raised where the unit is asked for, on the asking thread
            failure = exc
        with self._cond:
            self._copying = None
            if packer in self._queues:  # else it left meanwhile: the copy is dropped
                if failure is not None:
                    packer.failed[position] = failure
                else:
                    self._held = Held(weakref.ref(packer), position, copy)
            self._pump()
            self._cond.notify_all()


#: The process's line.
LINE = PackingLine()
