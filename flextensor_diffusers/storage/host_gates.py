"""Gates on a model's host bytes: what a read of a unit's host bytes asks first while some of them are not final.

Several owners may make a unit's host bytes not final for a while: set-up's packing (`packing.Packing`),
packing while the model runs (`packing.ProgressivePacking`), and the host tier's read back and hand-over
(`host_tier.read_back`, `host_tier.hand_over`). Each opens a gate of its own (`HostGates.open`) and holds the
`OpenGate` it gets; it alone closes it (`OpenGate.close`), so no owner can lift another's. A gate opened later
supersedes the one open before (a read back of bytes a hand-over let go takes over their arrival): the earlier
one is closed then, and its owner's close does nothing. A read asks the open gate (`HostGates.ask`), which
returns once the unit's bytes are final. With no gate open a read costs one check.
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
        return self._gates._open is self


class HostGates:
    """The gates open on one model's host bytes (see the module docstring)."""

    def __init__(self) -> None:
        self._open: OpenGate | None = None
        self._lock = threading.Lock()

    def open(self, gate: Gate) -> OpenGate:
        """Reads ask ``gate`` first from now until the `OpenGate` returned is closed, or superseded."""
        opened = OpenGate(self, gate)
        with self._lock:
            self._open = opened
        return opened

    def _close(self, opened: OpenGate) -> None:
        with self._lock:
            if self._open is opened:
                self._open = None

    @property
    def any_open(self) -> bool:
        """Some host bytes are not final yet (packed, or arriving from disk)."""
        return self._open is not None

    def ask(self, unit: Unit) -> None:
        """Return once the open gate says ``unit``'s host bytes are final."""
        opened = self._open  # read once: its owner may close it on another thread meanwhile
        if opened is not None:
            opened.gate(unit)
