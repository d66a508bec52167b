"""Gates on a model's host bytes: what a read of a unit's host bytes asks first while some of them are not final.

Several owners may make a unit's host bytes not final for a while: set-up's packing (`packing.Packing`),
packing while the model runs (`packing.ProgressivePacking`), and the host tier's read back and hand-over
(`host_tier.read_back`, `host_tier.hand_over`). Each opens a gate of its own (`HostGates.open`) and holds the
`OpenGate` it gets; it alone closes it (`OpenGate.close`), so no owner can lift another's. A read asks every
open gate, in the order they were opened (`HostGates.ask`); each returns once the unit's bytes are final as far
as its owner is concerned. With no gate open a read costs one check.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ..engine.units import Unit

#: A gate: returns once ``unit``'s host bytes are final as far as its owner is concerned.
Gate = Callable[[Unit], None]


class OpenGate:
    """One owner's gate, open until that owner closes it (closing twice is harmless)."""

    def __init__(self, gates: HostGates, gate: Gate) -> None:
        self._gates = gates
        self.gate = gate

    def close(self) -> None:
        """Reads no longer ask this gate."""
        self._gates._close(self)

    @property
    def is_open(self) -> bool:
        return self in self._gates._open


class HostGates:
    """The gates open on one model's host bytes (see the module docstring)."""

    def __init__(self) -> None:
        #: Replaced, never changed in place: a reader on another thread iterates the tuple it read.
        self._open: tuple[OpenGate, ...] = ()
        self._lock = threading.Lock()

    def open(self, gate: Gate) -> OpenGate:
        """Reads ask ``gate`` first from now until the `OpenGate` returned is closed."""
        opened = OpenGate(self, gate)
        with self._lock:
            self._open = (*self._open, opened)
        return opened

    def _close(self, opened: OpenGate) -> None:
        with self._lock:
            self._open = tuple(g for g in self._open if g is not opened)

    @property
    def any_open(self) -> bool:
        """Some host bytes are not final yet (packed, or arriving from disk)."""
        return bool(self._open)

    def ask(self, unit: Unit) -> None:
        """Return once every open gate says ``unit``'s host bytes are final."""
        for opened in self._open:
            opened.gate(unit)
