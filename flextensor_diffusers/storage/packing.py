"""Packing a model's units into flat host buffers: at set-up on threads (`Packing`), or while the model already
runs, each unit adopted when first asked for (`ProgressivePacking`). Either opens a gate on the host bytes
(`host_gates`) that it alone closes once its last unit is final.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from ..engine.errors import FlexTensorError, first_line
from ..engine.units import Unit, copy_into, copy_tensor_into, pack_unit, pin_unit
from . import packing_line
from .host_bytes import InRam
from .host_gates import HostGates
from .host_memory import host_buffer, pin_in_place, return_freed_heap
from .packing_line import PackingLine
from .setup_threads import PACK_THREADS, ThreadedWork

if TYPE_CHECKING:
    from .host_copies import HostCopies

#: Packing a unit of this many bytes gives the C heap's free pages back (`give_back_freed_originals`).
TRIM_AFTER_BYTES = 1 << 20


def give_back_freed_originals(unit: Unit) -> None:
    """``unit`` was just packed and its original tensors freed: give the C heap's free pages back now
    (`host_memory.return_freed_heap`), not at the heap's next trim, which may never come. Any original may have sat
    on the heap, whatever its size (a pipeline built in FP32 and cast, packed before set-up returned on the CPU:
    0.5 GB of its originals stayed resident, a 66 MB embedding among them)."""
    if unit.nbytes >= TRIM_AFTER_BYTES:
        return_freed_heap()


class PackingWindow:
    """Lets a unit be packed only within ``size`` positions of the furthest one asked for so far, so that
    packing cannot run far ahead of a consumer that frees each unit's RAM once done with it (compressed only).
    The consumer asks in order, and a position asked for is always within the window: no wait can deadlock."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._asked = 0
        self._cond = threading.Condition()

    def ask(self, position: int) -> None:
        with self._cond:
            if position > self._asked:
                self._asked = position
                self._cond.notify_all()

    def wait_to_pack(self, position: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: position <= self._asked + self.size)

    def open_all(self) -> None:
        """Let every remaining unit be packed (the consumer is done, or failed)."""
        self.ask(1 << 62)


class Packing:
    """Units being packed on threads (`HostCopies.start_packing`): its gate on ``gates`` is open meanwhile."""

    def __init__(
        self,
        gates: HostGates,
        work: ThreadedWork[Unit],
        positions: dict[int, int],
        window: PackingWindow | None,
        tasks: dict[int, int],
    ) -> None:
        self._work = work
        self._positions = positions
        self._window = window
        self._tasks = tasks  # by unit index: its task in ``work`` (a unit not packed here has none)
        self._opened = gates.open(self.gate)

    def gate(self, unit: Unit) -> None:
        task = self._tasks.get(unit.index)
        if task is None:
            return
        if self._window is not None:
            self._window.ask(self._positions[unit.index])
        self._work.wait_for(task)

    def finish(self) -> float:
        """Wait for every unit, lift the gate, raise the first failure; seconds the packing took."""
        if self._window is not None:
            self._window.open_all()
        try:
            return self._work.finish()
        finally:
            self._opened.close()


@dataclasses.dataclass(frozen=True)
class PackedCopy:
    """One unit's bytes copied by the packing line and not adopted yet (`ProgressivePacking`): its new flat
    buffer, and each tensor's edit count when its copy began."""

    buffer: torch.Tensor
    versions: tuple[int, ...]


class ProgressivePacking:
    """Raw host copies packed while the model is already in use (`HostCopies.start_progressive_packing`): set-up
    returns at once, and the first forward waits only for the units it reaches, so packing overlaps the first
    forward instead of preceding it.

    The process's packing line (`packing_line.LINE`) copies each unit into a new flat buffer, one unit at a time
    for all models. A unit's tensors are re-pointed at its buffer on a thread that asks for its host bytes (the
    host gate, `gate`), so no tensor changes under code that reads it on another thread; the originals are freed
    then. A tensor edited in place while or after it was copied is found by its edit count and copied again at
    adoption. Until a unit is adopted its original tensors stay alive, so at most one unit (of the whole process)
    is held twice: the host peak is the weights plus the largest unit. Page-locking (``pin``) needs no original:
    each adopted buffer is locked in place on threads of this packing's own (`_lock`) while the line copies the
    next unit; until then loads read it pageable, which is as correct and slower. A buffer that cannot be locked
    stays pageable (`host_memory.pin_in_place` says so).

    The packing ends (`HostCopies.packing_done`, ``on_done`` told the seconds it took) at the first gate after
    every unit is adopted and locked; `wait_all` waits for that. A unit whose copy failed keeps its original
    tensors; asking for it raises a one-line error naming the fix.
    """

    def __init__(self, host: HostCopies, pin: bool, on_done: Callable[[float], None]) -> None:
        self._host = host
        self._line: PackingLine = packing_line.LINE  # looked up now: a test may give each of its models its own
        self._on_done = on_done  # told the seconds packing took once the last unit is adopted and locked
        self._started = time.perf_counter()
        self._last_packed = self._started
        #: Positions not adopted yet: their tensors are still the model's own.
        self.pending: set[int] = set(range(len(host.positions)))
        #: Positions whose copies failed, with what they raised.
        self.failed: dict[int, BaseException] = {}
        self._locker = ThreadPoolExecutor(PACK_THREADS, thread_name_prefix="flextensor-pin") if pin else None
        self._locks_left = 0  # buffers adopted and not locked yet (counted under ``_count``)
        self._count = threading.Lock()
        self._finished = False
        self._opened = host.gates.open(self.gate)
        self._line.join(self, list(range(len(host.positions))))

    def copy(self, position: int) -> PackedCopy:
        """The unit at ``position`` copied into a new flat buffer (on the line's thread)."""
        unit = self._host.positions[position]
        versions = tuple(packed.tensor._version for packed in unit.tensors)
        buffer = host_buffer(unit.nbytes)
        with torch.no_grad():
            copy_into(unit, buffer)
        if self._host.on_packed is not None:
            self._host.on_packed(unit, buffer)
        self._last_packed = time.perf_counter()
        return PackedCopy(buffer, versions)

    def gate(self, unit: Unit) -> None:
        """The host gate while packing: return once ``unit`` is adopted; adopt the unit the line holds meanwhile
        (any model's: the line goes on only once it is), and end the packing once all is done."""
        position = unit.index + 1
        if position in self.pending:
            self._line.take(self, position)
        else:
            self._line.adopt_held()
        if not self.pending and self._locks_left == 0:
            self._finish()

    def wait_all(self) -> None:
        """Adopt every unit and wait for every lock, then end the packing; raise a unit's copy failure."""
        for position in sorted(self.pending):
            self._line.take(self, position)
        if self._locker is not None:
            self._locker.shutdown(wait=True)
        self._finish()

    def adopt(self, position: int, copy: PackedCopy) -> None:
        """Re-point the unit's tensors at ``copy`` (on the asking thread): its originals are freed, its buffer
        handed to be locked. Interrupted (Ctrl-C), the unit is either adopted or still pending."""
        locks = 1 if self._locker is not None else 0
        with self._count:  # counted before the unit leaves ``pending``: the packing cannot end before its lock
            self._locks_left += locks
        try:
            self._adopt(position, copy)
        except BaseException:
            with self._count:
                self._locks_left -= locks
            raise
        unit = self._host.positions[position]
        give_back_freed_originals(unit)
        if self._locker is not None:
            self._locker.submit(self._lock, unit, copy.buffer)

    def _adopt(self, position: int, copy: PackedCopy) -> None:
        unit = self._host.positions[position]
        recopied = False
        with torch.no_grad(), torch.inference_mode(False):
            for packed, version in zip(unit.tensors, copy.versions, strict=True):
                if packed.tensor._version != version:  # edited in place while or after it was copied
                    copy_tensor_into(packed, copy.buffer)
                    recopied = True
            unit.bind(copy.buffer)
        if recopied and self._host.on_packed is not None:
            self._host.on_packed(unit, copy.buffer)
        unit.stored, unit.pinned_in_place = InRam(copy.buffer), False
        self.pending.discard(position)

    def _lock(self, unit: Unit, buffer: torch.Tensor) -> None:
        """Page-lock an adopted buffer in place (on this packing's threads). The flag is read only once every
        lock is done (`wait_all`, `abandon`): whoever replaces or frees ``unit.host`` waits for them first."""
        try:
            unit.pinned_in_place = pin_in_place(buffer)
        finally:
            with self._count:
                self._locks_left -= 1
                self._last_packed = time.perf_counter()

    def failure(self, position: int) -> FlexTensorError:
        unit, cause = self._host.positions[position], first_line(self.failed[position])
        return FlexTensorError(
            f"packing {unit.name!r} into host memory failed ({cause}): free host memory (or pass a host_budget), "
            "then remove() the offload and offload again; the model's weights are unchanged"
        )

    def _finish(self) -> None:
        with self._count:
            if self._finished:
                return
            self._finished = True
        self._line.leave(self)
        if self._locker is not None:
            self._locker.shutdown(wait=False)
        self._opened.close()
        self._host.packing_done(self)
        self._on_done(self._last_packed - self._started)

    def abandon(self) -> None:
        """Stop packing (removal): units not copied are not, one being copied is waited for, and every unit not
        adopted keeps its original tensors; the copy held for one is dropped. Locks under way are waited for."""
        self._line.leave(self)
        if self._locker is not None:
            self._locker.shutdown(wait=True)
        self.pending = set()
        self._opened.close()
        self._host.packing_done(self)


def start_packing(
    host: HostCopies, pin: bool, window: int | None = None, skip: frozenset[int] = frozenset()
) -> Packing:
    """Start copying every unit and the base of ``host`` into the flat host buffers its form gives (or attaching
    them to the bytes another process packed: `HostForm.attached`), each page-locked by the task that packed it
    when ``pin``, the form told of each (`HostForm.unit_packed`); set-up goes on meanwhile, and
    `HostCopies.host_of` waits for the unit it asks for (the device encoder codes the first blocks while the last
    are packed).

    One task per unit on a few threads: a copy into host memory is bound by one core's memory bandwidth,
    and the copies and ``cudaHostRegister`` release the GIL, so one thread's registration overlaps the
    others' copies. Host memory grows by at most one unit per thread. A failure is raised by
    `Packing.finish` once every task has ended: the caller restores whatever was packed. With ``window``, a
    unit is packed only within that many positions of the furthest one asked for (`PackingWindow`). Positions in
    ``skip`` have their host bytes already (`RawHomes.settle_as_loaded`) and are not packed."""
    gate = PackingWindow(window) if window is not None else None
    positions = {unit.index: position for position, unit in enumerate(host.positions)}
    todo = [unit for position, unit in enumerate(host.positions) if position not in skip]
    form = host.form

    def pack_one(unit: Unit) -> None:
        if gate is not None:
            gate.wait_to_pack(positions[unit.index])
        with torch.no_grad():
            pack_unit(unit, host=form.buffer_for(unit), filled=form.attached)
        give_back_freed_originals(unit)
        if pin:
            pin_unit(unit, attached=form.attached)
        buffer = unit.buffer
        if host.on_packed is not None and buffer is not None:
            host.on_packed(unit, buffer)
        form.unit_packed(positions[unit.index], unit)  # while its bytes are at hand

    verb = "attaching to shared weights" if form.attached else "packing weights"
    work = ThreadedWork(pack_one, todo, f"{verb} and pinning them" if pin else verb)
    return Packing(host.gates, work, positions, gate, {unit.index: task for task, unit in enumerate(todo)})
