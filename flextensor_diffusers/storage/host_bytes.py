"""Where one unit's host bytes are, and in what form: a typed record per place (`Unit.stored`).

A unit's tensors view its host bytes through `PackedTensor.view_of`, which only slices a flat source at each
tensor's range. Most places give one flat uint8 tensor (a buffer in RAM, a shared file, a cache file's mapping);
the weight files a component was loaded from give a `StandIn`, which answers only those slices. The record says
which it is, so that code needing one flat tensor (page-locking, a full-speed copy) asks `HostBytes.buffer` and
is told None for a stand-in, instead of being handed something that only looks like a tensor.

The kinds:

* `InRam`: raw bytes in a flat buffer of the unit's own (packed, read back, or a pinned copy);
* `InSharedMemory`: a flat buffer mapped shared with other processes (`shared_host`);
* `InCacheFile`: a view of a cache file's shared mapping, written once by a spill (`cache_files`);
* `InWeightFiles`: private views of the weight files the model was loaded from, after a spill onto them;
* `AtRawHome`: compressed only, the raw bytes of a unit kept compressed wait in a `raw_homes.RawHome` (the
  weight files, else a room in one cache file) for good, while RAM holds its payload;
* `InPayloadsOnly`: compressed only, with no raw copy anywhere: the unit's payload is its host copy, and its
  tensors view a `read_guard.NoRawBytes` whose reads are refused;
* `DecodedPayload`: such a unit's raw bytes decoded into a RAM buffer of its own for a while (an edit, a write-back,
  removal), until `raw_homes.RawHomes.close_opened` makes it `InPayloadsOnly` again.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Protocol, TypeAlias

import torch

from .read_guard import NoRawBytes


class StandIn(Protocol):
    """Stands in for a unit's flat host buffer while its bytes are elsewhere: sliced at a packed tensor's range it
    gives that tensor's bytes (e.g. `weight_files.ScatteredHost`), which is all `PackedTensor.view_of` asks."""

    def __getitem__(self, key: slice) -> torch.Tensor: ...


#: What a unit's tensors can view: one flat uint8 tensor, or a stand-in for it.
Flat: TypeAlias = "torch.Tensor | StandIn"


@dataclasses.dataclass(frozen=True)
class HostBytes:
    """A unit's host bytes, wherever they are (see the module docstring). ``flat`` is what its tensors view."""

    #: A label for reports and errors.
    place: ClassVar[str] = "host"
    #: The bytes are in a RAM buffer of the unit's own, so a raw load copies them at full speed.
    at_hand: ClassVar[bool] = False

    @property
    def flat(self) -> Flat:
        raise NotImplementedError

    @property
    def buffer(self) -> torch.Tensor | None:
        """The bytes as one flat uint8 tensor; None when a stand-in holds them."""
        flat = self.flat
        return flat if isinstance(flat, torch.Tensor) else None


@dataclasses.dataclass(frozen=True)
class _OneBuffer(HostBytes):
    """Host bytes in one flat uint8 tensor."""

    tensor: torch.Tensor

    @property
    def flat(self) -> torch.Tensor:
        return self.tensor


@dataclasses.dataclass(frozen=True)
class InRam(_OneBuffer):
    """Raw bytes in a flat RAM buffer of the unit's own (pageable, or page-locked: `Unit.pinned_in_place`)."""

    place: ClassVar[str] = "ram"
    at_hand: ClassVar[bool] = True


@dataclasses.dataclass(frozen=True)
class InSharedMemory(_OneBuffer):
    """A flat buffer mapped shared with the other processes of the host (`shared_host.SharedHostMemory`)."""

    place: ClassVar[str] = "shared memory"
    at_hand: ClassVar[bool] = True


@dataclasses.dataclass(frozen=True)
class InCacheFile(_OneBuffer):
    """A view of a cache file's shared mapping (a spill): its pages come from disk as they are read."""

    place: ClassVar[str] = "cache file"


@dataclasses.dataclass(frozen=True)
class InWeightFiles(HostBytes):
    """Private, copy-on-write views of the weight files the model was loaded from (a spill onto them)."""

    place: ClassVar[str] = "weight files"

    stand_in: Flat

    @property
    def flat(self) -> Flat:
        return self.stand_in


@dataclasses.dataclass(frozen=True)
class AtRawHome(HostBytes):
    """Compressed only: raw bytes waiting in a raw home for good (a stand-in over the weight files, or a room of
    one cache file); loads decode the unit's payload instead."""

    place: ClassVar[str] = "raw home"

    stand_in: Flat

    @property
    def flat(self) -> Flat:
        return self.stand_in


@dataclasses.dataclass(frozen=True)
class InPayloadsOnly(HostBytes):
    """Compressed only, and no raw copy anywhere: the unit's payload (in RAM, or in the payload file) is its host copy.
    Its tensors view ``stand_in``, which holds no bytes and refuses reads (`read_guard`); whatever needs the raw bytes
    decodes the payload (`HostCopies.decoded`)."""

    place: ClassVar[str] = "payloads only"

    stand_in: NoRawBytes

    @property
    def flat(self) -> NoRawBytes:
        return self.stand_in

    @property
    def buffer(self) -> None:
        return None


@dataclasses.dataclass(frozen=True)
class DecodedPayload(_OneBuffer):
    """A unit kept as payloads only, its raw bytes decoded into a RAM buffer of its own for now (an edit, a write-back,
    removal: `raw_homes.RawHomes.open`); ``closed`` is what it goes back to once its payload says what the buffer says
    (`raw_homes.RawHomes.close_opened`)."""

    place: ClassVar[str] = "ram, decoded for now"

    closed: InPayloadsOnly
