"""Where each unit's tensors point, and the in-place edits made through them.

**A unit's tensors view its own bytes, or its host copy.** While a unit is called, and after that for as long
as the device buffer it was called in still holds its bytes, its parameters and buffers are views of that
buffer (its resident copy, the base's device copy, or its slot). Everything else views the host copy, the
weights' truth. A slot is handed to its next occupant only after its previous one was pointed back at its
host copy (`Binding.to_host`), and a unit is pointed at its slot only when it is called (`Binding.to_device`),
after its load. So no tensor ever views bytes of another unit, or bytes still being copied in: code that reads
a weight outside its unit's call (a direct ``forward``, a parent reading a child's weight, user code between
forwards) reads that weight's value, on the host when the unit is not loaded (on a CUDA model, computing with
it is a device mismatch error, never another block's weights).

**Edits are found by version counters.** Every parameter and buffer counts the in-place writes made through
it (``mul_``, ``copy_``, BatchNorm's running statistics, ``self.calls += 1``); our own copies write through other
views and ``.data`` re-pointing counts nothing, so a changed count is always somebody else's edit. Each unit's
counts are compared whenever it is re-pointed and at every `sweep` (the start of each forward). A change is an
edit made where the tensors pointed since the last comparison:

* at a device buffer: that buffer is copied back into the host copy at once, before it can be dropped or
  handed to another unit (a forward that updates its own buffers, an edit of a resident unit between forwards);
* at the host copy: the truth has it already; copies made from it before (a slot loaded ahead, a compressed
  copy, a spill file) are stale, and the owner's ``on_edit`` drops them.

Writes through ``.data`` (``p.data.add_(x)``) bypass the counters and are not found: make such edits inside
``handle.editing()`` (the diffusers integration wraps ``fuse_lora`` and ``load_state_dict`` in it).

**A call that re-points its own tensors is pointed back after it.** Some representations compute from copies they
make in the call: diffusers' layerwise casting casts each layer's weights up before its forward and back down
after it, with ``module.to()``, so its tensors end the call viewing new device tensors of their own, not the
unit's buffer. Those copies would live as long as the unit stays bound (a resident unit: for good), device memory
that the profiling forward, where every unit is evicted after its call, never sees. Measuring forwards look for
it after each call (`after_call`, per tensor, so only then); a unit found doing it is pointed back at its buffer
after every call from then on, so what its call allocates is gone when the call is and the activation peak the
profiler measures covers it (the base, whose modules are not calls of ours: at the end of each forward).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from enum import Enum
from operator import attrgetter

import torch

from ..storage.host_bytes import Flat
from .units import Unit

logger = logging.getLogger(__name__)

_version = attrgetter("_version")


class Edit(Enum):
    """What `Binding.check` found: no edit, or one made in a device buffer, or one made in the host copy."""

    NONE = "none"
    ON_DEVICE = "on device"
    ON_HOST = "on host"


class Binding:
    """The device buffer each unit's tensors view (None: its host copy) and their recorded edit counts.

    ``units`` are numbered by position: 0 is the base (weights outside units), ``i + 1`` is unit ``i``.
    ``host_of(unit)`` gives a unit's final host bytes; ``on_edit(unit, on_device)`` is told of every edit
    found, after a device-side one was copied back (``on_device``), so its owner can drop stale copies.
    """

    def __init__(
        self,
        units: list[Unit],
        device: torch.device,
        host_of: Callable[[Unit], Flat],
        on_edit: Callable[[Unit, bool], None],
    ) -> None:
        self._units = units
        self._device = device
        self._host_of = host_of
        self._on_edit = on_edit
        self._tensors = [[packed.tensor for packed in unit.tensors] for unit in units]
        self._on: list[torch.Tensor | None] = [None] * len(units)
        self._counts = [self._count(position) for position in range(len(units))]
        self._repointing: set[int] = set()  # positions of units found re-pointing their tensors in their calls

    @staticmethod
    def position(unit: Unit) -> int:
        return unit.index + 1

    def on_device(self, unit: Unit) -> torch.Tensor | None:
        """The device buffer ``unit``'s tensors view now; None while they view its host copy."""
        return self._on[unit.index + 1]

    def to_device(self, unit: Unit, flat: torch.Tensor) -> bool:
        """Point ``unit``'s tensors at ``flat``, which holds its bytes. True when an edit of its host copy was
        found first: ``flat`` was filled before it and must be filled again."""
        edit = self.check(unit)
        with torch.no_grad(), torch.inference_mode(False):  # views made in inference mode would change the
            unit.bind(flat)  # tensors' dispatch keys, which compiled regions guard on
        self._on[unit.index + 1] = flat
        return edit is Edit.ON_HOST

    def to_host(self, unit: Unit, host: Flat | None = None) -> None:
        """Point ``unit``'s tensors at its host copy (``host``: a new one that holds the same bytes), after an
        edit made in the device buffer they viewed is copied back."""
        self.check(unit)
        flat = host if host is not None else unit.host
        assert flat is not None, f"{unit.name} has no host copy"
        with torch.no_grad(), torch.inference_mode(False):
            unit.bind(flat)
        self._on[unit.index + 1] = None

    def rehost(self, unit: Unit, host: Flat) -> None:
        """``unit``'s host copy moves to ``host`` (same bytes): tensors viewing the old one follow."""
        if self._on[unit.index + 1] is None:
            self.to_host(unit, host)

    def after_call(self, unit: Unit, measuring: bool) -> None:
        """``unit``'s call is over (the base's: the forward's). While ``measuring``, look for tensors it re-pointed
        (`strayed`); a unit found doing so is pointed back at the buffer it views after every call (see the module
        docstring)."""
        position = unit.index + 1
        if measuring and position not in self._repointing and self.strayed(unit):
            logger.info("%s re-points its weights in its forward (a cast?); pointed back after each call", unit.name)
            self._repointing.add(position)
        flat = self._on[position]
        if position in self._repointing and flat is not None:
            with torch.no_grad(), torch.inference_mode(False):
                unit.bind(flat)

    def strayed(self, unit: Unit) -> bool:
        """Some of ``unit``'s tensors no longer view the device buffer they were pointed at (False while they view
        the host copy). Per tensor."""
        flat = self._on[unit.index + 1]
        if flat is None:
            return False
        start = flat.data_ptr()
        with torch._C.DisableTorchFunctionSubclass():
            return any(packed.tensor.data_ptr() != start + packed.offset for packed in unit.tensors if packed.nbytes)

    def check(self, unit: Unit) -> Edit:
        """Compare ``unit``'s edit counts with the recorded ones and handle an edit found (see the module
        docstring)."""
        position = unit.index + 1
        counts = self._count(position)
        if counts == self._counts[position]:
            return Edit.NONE
        flat = self._on[position]
        if flat is not None:
            self._write_back(unit, flat)
        self._on_edit(unit, flat is not None)
        self._counts[position] = counts
        return Edit.ON_DEVICE if flat is not None else Edit.ON_HOST

    def unchanged(self, unit: Unit) -> bool:
        """No in-place write through ``unit``'s tensors since their counts were last handled (changes nothing)."""
        return self._count(unit.index + 1) == self._counts[unit.index + 1]

    def sweep(self) -> bool:
        """`check` every unit; True when any edit was found."""
        return any([self.check(unit) is not Edit.NONE for unit in self._units])  # a list: check them all

    def record(self) -> None:
        """Take the current counts as handled (after ``editing()``, which makes every copy follow by itself)."""
        self._counts = [self._count(position) for position in range(len(self._units))]

    def accept(self, unit: Unit) -> None:
        """Take ``unit``'s current counts as handled: an edit found that its owner refuses (`Edits.found`) is
        refused once, not at every check after."""
        self._counts[unit.index + 1] = self._count(unit.index + 1)

    def _count(self, position: int) -> tuple[int, ...]:
        with torch._C.DisableTorchFunctionSubclass():  # a tensor whose reads are refused (`read_guard`) counts too
            return tuple(map(_version, self._tensors[position]))

    def _write_back(self, unit: Unit, flat: torch.Tensor) -> None:
        """Copy every tensor of ``unit`` from the device buffer ``flat`` into its host copy (synchronously:
        edits are rare, and the buffer may be reused right after)."""
        if flat.device.type == "cuda":
            torch.cuda.synchronize(flat.device)
        host = self._host_of(unit)
        with torch.no_grad(), torch.inference_mode(False):
            for packed in unit.tensors:
                packed.view_of(host).copy_(packed.view_of(flat))
