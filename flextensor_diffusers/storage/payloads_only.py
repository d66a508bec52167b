"""Payloads only (``raw_copies="none"``): a unit kept compressed has no raw copy anywhere; its payload is its host copy.

Under a host budget with compression, RAM holds payloads and the raw bytes of each unit kept compressed leave it
for a raw home (`raw_homes`). A pipeline loaded from its folder keeps them in its own weight files (`raw_home`),
which costs nothing. Weights built, edited or LoRA-fused in memory had no such files, so their raw bytes were
written to a cache file as large as the weights (on the GPU machine, 64 GB of disk, the Wan2.2-A14B pipeline ran
out of space before its host budget could work). The payloads are lossless, in RAM and in the payload file
already: `PayloadsOnlyHome` keeps nothing else, and writes nothing.

Between calls the unit's tensors view a `read_guard.NoRawBytes` and refuse reads; each place that needs the raw
bytes decodes the payload instead (`HostCopies.decoded`, `decode_to_ram`): ``state_dict()``, an edit (decoded,
applied, encoded again), a write-back of an edit made in a device copy, removal. A unit with a tensor subclass
(whose class `read_guard` cannot swap) keeps its raw bytes in RAM.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..engine.config import format_bytes
from ..engine.errors import FlexTensorError, OffloadStateError
from ..engine.units import Unit
from .codec import EncodedUnit, decode_into
from .host_memory import host_buffer
from .raw_homes import Moved
from .read_guard import NoRawBytes, eligible

if TYPE_CHECKING:
    from .host_copies import HostCopies

logger = logging.getLogger(__name__)


class PayloadsOnlyHome:
    """A `raw_homes.RawHome` that keeps no raw bytes: a unit's stand-in is a `NoRawBytes` and its payload is its
    host copy. A unit whose tensors `read_guard` cannot refuse (a tensor subclass) keeps its RAM buffer instead,
    counted in `ram_bytes`."""

    #: Nothing is on disk: no file or folder to report.
    where: Path | None = None

    def __init__(self) -> None:
        self._kept: dict[int, int] = {}  # per position: bytes of a unit kept in RAM (its tensors not refusable)

    def prepare(self, position: int, unit: Unit) -> None:
        """Nothing to do ahead."""

    def stand_in_as_loaded(self, position: int, unit: Unit) -> None:
        """No file holds the unit's bytes: each one is packed, and (encoded first) keeps its payload only."""
        return None

    def forget(self, position: int) -> None:
        """`stand_in_as_loaded` gave nothing to forget."""

    def stand_in(self, position: int, unit: Unit) -> NoRawBytes | torch.Tensor:
        """A `NoRawBytes` of the unit's size; its RAM buffer when its tensors cannot refuse reads."""
        stand_in = self.stand_in_without_bytes(position, unit)
        if stand_in is not None:
            return stand_in
        logger.info("%s keeps its raw bytes in RAM: a tensor subclass cannot refuse reads", unit.name)
        buffer = unit.buffer
        assert buffer is not None, f"{unit.name} is kept in RAM from a flat buffer"
        self._kept[position] = unit.nbytes
        return buffer

    def stand_in_without_bytes(self, position: int, unit: Unit) -> NoRawBytes | None:
        """A `NoRawBytes` of the unit's size, its payload to be its host copy; None when its tensors cannot refuse
        reads (a tensor subclass), so that it keeps raw bytes."""
        if unit.wrappers or not eligible(packed.tensor for packed in unit.tensors):
            return None
        return NoRawBytes(unit.nbytes)

    def ram_bytes(self) -> int:
        return sum(self._kept.values())

    def moved_if_written(self, position: int, unit: Unit, raw: torch.Tensor) -> Moved | None:
        """An edit changes the payload, which is made again from the edited bytes: nothing moves."""
        return None

    def close(self) -> None:
        """Nothing was written."""


def decode_to_ram(encoded: EncodedUnit, payload: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``encoded``'s raw bytes (its ``payload``, in RAM) in a new RAM buffer of ``raw_nbytes``, zero between tensors as
    packing leaves it: decoded on ``device`` when it is a GPU (the payload and the raw bytes of one unit there for the
    while, nothing else of the model: its callers run outside the model's calls, or with its device memory given
    back), else, or when that device is out of memory, by the host decoder (`codec`: one chunk row batch at a time,
    bitwise the same, far slower)."""
    out = host_buffer(encoded.raw_nbytes)
    out.zero_()
    if device.type == "cuda":
        try:
            staged = payload.to(device, non_blocking=True)
            decoded = torch.zeros(encoded.raw_nbytes, dtype=torch.uint8, device=device)
            decode_into(encoded, staged, decoded)
            out.copy_(decoded)
            return out
        except torch.OutOfMemoryError:
            logger.warning("decoding a payload on %s ran out of memory: decoded on the host instead (slower)", device)
    decode_into(encoded, payload, out, backend="torch")
    return out


def decoded(host: HostCopies, unit: Unit) -> torch.Tensor:
    """``unit``'s raw bytes (kept as payloads only) in a new RAM buffer: copied from the device buffer its tensors view
    when they view one (a resident or slotted unit holds its bytes whole, with any edit made there), else decoded
    from its payload (`decode_to_ram`), read back from the payload file and checked when it waits there, or, during
    set-up, the one `raw_homes.RawHomes.held` holds. Refused first when the RAM available cannot hold it
    (`refuse_without_ram`): ``state_dict()`` decodes a component unit by unit, each checked so."""
    refuse_without_ram(unit.nbytes, f"reading the weights of {unit.name!r}")
    on_device = host.binding.on_device(unit)
    if on_device is not None:
        out = host_buffer(unit.nbytes)
        out.copy_(on_device[: unit.nbytes])
        return out
    host.gates.ask(unit)
    found = host.compressed.payload_to_decode(unit.index)
    held = host.raw_homes.held.get(unit.index) if host.raw_homes is not None else None
    if found is None and held is not None:
        found = (held, held.payload)
    if found is None:
        raise OffloadStateError(f"{unit.name!r} has neither raw bytes nor a compressed copy: its weights are lost")
    return decode_to_ram(*found, host.device)


def refuse_without_ram(nbytes: int, what: str) -> None:
    """Refuse, before decoding anything, to decode ``nbytes`` of weights kept as payloads only into RAM for ``what``
    when the RAM available now (`host_budget.available_ram`) cannot hold them: the kernel would kill the process
    half way instead."""
    from . import host_budget  # it imports the engine's package, which imports this module

    available = host_budget.available_ram().nbytes
    if nbytes > available:
        raise FlexTensorError(
            f"{what} decodes {format_bytes(nbytes)} of weights kept as their compressed copy only into RAM, and "
            f"{format_bytes(available)} is available: free host memory, or enable offload with raw_copies='disk' "
            "(--raw-copies disk) so that their raw copy waits in a cache file"
        )
