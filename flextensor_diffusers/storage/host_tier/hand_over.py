"""Handing a component's RAM over during its last forward before a switch.

Under a host budget the next component is read ahead only as far as the RAM the active one leaves, and the rest
is read after the switch while the new component waits for it (Wan2.2-A14B at 32 GiB: ~9 GB at the disk's
1.6 GB/s, 2.5-3 s exposed per switch on the H200). Yet during the active component's last forward each unit is
done after its call, and a compressed component's payloads are all in its payload file already. So, during that
forward, each unit's payload goes back to the file once its call is done on the device (`HandOver`), and the
read ahead of the next component takes the RAM freed (`HostTier.hand_over`): the disk keeps reading through the
whole last forward instead of idling until the switch.

Which forward is the last one is the pipeline's to tell (`LastForwardForecast`). A wrong guess costs time, never
correctness: a unit let go that is called again is read back from the file, checked against its checksum, before
its load (`HandOver.gate`), with a warning.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from ...engine.units import Unit

if TYPE_CHECKING:
    from collections.abc import Callable

    from ...engine import OffloadHandle

logger = logging.getLogger(__name__)


class LastForwardForecast:
    """Whether a forward of a two-expert pipeline's expert is that expert's last before the other one runs.

    Wan2.2's rule (diffusers' ``WanPipeline`` and its kin): ``transformer`` runs the steps whose timestep is at
    least ``config.boundary_ratio * scheduler.config.num_train_timesteps``, ``transformer_2`` the others, each step
    once, or twice with classifier-free guidance (``do_classifier_free_guidance``: the conditional forward, then
    the unconditional one). So a forward is the expert's last when its step is the last of the expert's run in
    ``scheduler.timesteps`` and it is the step's last forward. A pipeline without that rule gets no forecast
    (nothing is handed over).

    Nothing here synchronises the device: the timesteps (on the GPU) are read once per generation, when the
    scheduler's tensor of them is a new one, and the step is counted from the pipeline's ``_current_timestep``, a
    new tensor at each step and the same one for both forwards of a step."""

    def __init__(self, pipeline: Any) -> None:
        self.pipeline = pipeline
        self._timesteps: object = None  # the scheduler's tensor the steps below were read from
        self._steps: list[float] = []
        self._step_index = -1
        self._step_timestep: object = None  # the pipeline's ``_current_timestep`` of the forwards counted
        self._forwards = 0  # forwards so far at that step

    @staticmethod
    def applies_to(pipeline: Any) -> bool:
        config = getattr(pipeline, "config", None)
        return getattr(config, "boundary_ratio", None) is not None and hasattr(pipeline, "transformer_2")

    def is_last(self, name: str) -> bool:
        """Whether this forward of component ``name`` (beginning now) is its last before the other expert's."""
        pipeline = self.pipeline
        timestep = getattr(pipeline, "_current_timestep", None)
        scheduler = getattr(pipeline, "scheduler", None)
        timesteps = getattr(scheduler, "timesteps", None)
        trained = getattr(getattr(scheduler, "config", None), "num_train_timesteps", None)
        if timestep is None or timesteps is None or trained is None or name not in ("transformer", "transformer_2"):
            return False
        if timesteps is not self._timesteps:  # a new generation's schedule: one copy to the host
            self._timesteps, self._steps = timesteps, [float(t) for t in timesteps.tolist()]
            self._step_index, self._step_timestep = -1, None
        if timestep is not self._step_timestep:
            self._step_index, self._step_timestep, self._forwards = self._step_index + 1, timestep, 0
        self._forwards += 1
        if self._step_index >= len(self._steps):
            return False
        boundary = pipeline.config.boundary_ratio * trained
        expert_of = {True: "transformer", False: "transformer_2"}
        now = self._steps[self._step_index]
        if expert_of[now >= boundary] != name:
            return False
        after = self._steps[self._step_index + 1 :]
        last_step = not after or expert_of[after[0] >= boundary] != name
        per_step = 2 if getattr(pipeline, "do_classifier_free_guidance", False) else 1
        return last_step and self._forwards == per_step


@dataclass
class HandOverRecord:
    """One component's RAM handed over during its last forward: what left RAM then, and what a wrong guess made
    read back before the switch."""

    component: str
    let_go_bytes: int = 0
    let_go_units: int = 0
    taken_back_units: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class HandOver:
    """The payloads of ``handle``, the active component, let go one by one as its last forward is done with them.

    The engine tells `unit_done` of each unit after its last call of the forward, with an event that completes
    once that call is done on the device (so the copy that loaded its payload is done too). A thread waits for
    the event, then, under the host tier's ``lock``, lets the payload go (`HostCopies.let_go_payload`) and calls
    ``on_room``: only on the event of the unit's latest telling, never on an older one still queued for a unit
    claimed and told done again since (its newer call's copy may not have run yet). Meanwhile the handle's loads
    ask `gate` first: a unit let go is taken back from the file at once (the forecast was wrong: ``on_wrong`` first
    stops the reads into the room, so the budget holds, and nothing more is let go until the switch), one still
    waiting for its event stays in RAM. `finish` ends it (at the switch, or any call that needs the component's
    state settled)."""

    def __init__(
        self,
        name: str,
        handle: OffloadHandle,
        lock: threading.RLock,
        pin: bool,
        on_room: Callable[[], None],
        on_wrong: Callable[[], None],
    ) -> None:
        self.record = HandOverRecord(name)
        self._handle = handle
        self._lock = lock
        self._pin = pin
        self._on_room = on_room
        self._on_wrong = on_wrong
        #: Told done, event not complete yet: each unit's latest telling (its event, or a token on the CPU).
        self._pending: dict[int, object] = {}
        self._gone: set[int] = set()  # let go
        self._closed = False
        self.found_wrong = False  # the component ran again: nothing more is let go until it switches out
        self._events: queue.SimpleQueue[tuple[Unit, torch.cuda.Event] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._opened = handle.host.expect_arrivals(self.gate)

    @property
    def component(self) -> str:
        return self.record.component

    def unit_done(self, unit: Unit, event: torch.cuda.Event | None) -> None:
        """On the main thread: ``unit`` made its last call of the forward (``event``: done on the device then)."""
        telling = event if event is not None else object()
        with self._lock:
            if self._closed or self.found_wrong:
                return
            self._pending[unit.index] = telling
        if event is None:
            self._let_go(unit, telling)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._wait_events, name="flextensor-hand-over", daemon=True)
            self._thread.start()
        self._events.put((unit, event))

    def _wait_events(self) -> None:
        while (item := self._events.get()) is not None:
            unit, event = item
            event.synchronize()
            self._let_go(unit, event)

    def _let_go(self, unit: Unit, telling: object) -> None:
        """Let ``unit``'s payload go once ``telling``'s event completed, when that is still its latest telling. A unit
        the gate claimed (the component ran again) and told done again in that run is pending under its newer event:
        the older one, complete, says nothing of the newer call, whose payload copy may still be queued on the device;
        letting it go then would hand its buffer to a read while that copy reads it."""
        with self._lock:
            if self._closed or self.found_wrong or self._pending.get(unit.index) is not telling:
                return  # finished, found wrong, or the unit was claimed again meanwhile (and told done again)
            del self._pending[unit.index]
            host_copies = self._handle.host
            nbytes = host_copies.transfer_bytes(unit.index)
            if not host_copies.let_go_payload(unit):
                return
            self._gone.add(unit.index)
            self.record.let_go_bytes += nbytes
            self.record.let_go_units += 1
            self._on_room()

    def gate(self, unit: Unit) -> None:
        """Before the handle reads ``unit``'s host bytes: a unit let go is taken back from the file now (the
        component ran again after its forecast last forward), one waiting for its event stays in RAM."""
        with self._lock:
            self._pending.pop(unit.index, None)
            if unit.index not in self._gone:
                return
            if not self.found_wrong:  # the room handed over is needed back: the read aheads into it stop first
                self.found_wrong = True
                self._on_wrong()
                logger.warning(
                    "host tier: %s ran again after the forward expected to be its last before a switch; the units "
                    "handed over are read back from disk as they are needed (slower, same results)",
                    self.component,
                )
            host_copies = self._handle.host
            host_copies.take_unit(host_copies.read_unit(unit.index + 1, None, self._pin))
            self._gone.discard(unit.index)
            self.record.taken_back_units += 1

    def finish(self) -> None:
        """Stop: units still waiting for their event stay in RAM (moving the component out takes them); nothing more
        is let go, and the gate is lifted. The units let go wait in the payload file as any spilled unit does: the
        component's next activation reads them back (`read_back`), and an edit encodes every payload again.

        The gate once stayed open past here (the check that it was still this hand-over's compared a fresh bound
        method by identity and never matched), and an edit of a component let go then went through it: it took the
        units back and gave up every read ahead (`on_wrong`), with a wrong warning. That hid a read ahead of the
        old payloads adopted after an edit (`waiting_payloads`: such a payload is read again at its take now)."""
        with self._lock:
            self._closed = True
            self._pending.clear()
        self._opened.close()
        self._events.put(None)
