"""Set-up: everything offloading adds to a model, done in one place and undone in one place.

In order, as the storage plan says (`StoragePlan`): host buffers packed (or attached to another process's shared
ones) and page-locked (raw copies only: while the model is already in use, `StoragePlan.packs_progressively`),
compressed copies made while later units are still packed (compressed only, ``raw_copies="none"`` or ``"disk"``, each
unit's raw bytes leave RAM for its raw home as soon as its payload is made, the packing kept a few units ahead of the
encoder), the boundaries that route the model's and its units' calls to the handle, ``state_dict`` hooks that read
host copies. A set-up that does not wait for its compressed copies leaves them to an `arrivals` object: the payload
file, read once packing is over, or (``background_encoding``) the encoder between forwards; compressed only (a host
budget with compression) each unit's raw bytes then leave RAM for their raw home as soon as it is packed, and the
model streams them from there until the payloads are kept; with ``raw_copies="none"`` only when the weight files
hold every unit as loaded, else it is encoded before set-up returns (a unit they do not hold keeps its payload only).
Any failure undoes all of it (`SetUp.undo`, with the host copies restored by the handle), so a model that could not
be offloaded is left as it was.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from ..storage.arrivals import encoder_room, refuse_without_room
from ..storage.cache_files import RawCacheFile
from ..storage.host_copies import PACKING_WINDOW, HostCopies
from ..storage.payload_cache import PayloadCache, weights_key
from ..storage.payloads_only import PayloadsOnlyHome
from ..storage.raw_homes import RawHome
from .binding import Binding
from .boundaries import Boundaries, Crossing, hidden
from .cast_guard import CastGuard
from .config import cache_folder
from .device_copies import DeviceCopies
from .edits import Edits
from .units import PackedTensor, Unit, UnitLayout

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from ..storage.plan import StoragePlan
    from ..storage.shared_host import SharedHostMemory
    from .calls import BoundaryCalls
    from .config import OffloadConfig
    from .planning import Planning
    from .stats import SetupTimes


@dataclass(frozen=True)
class Copies:
    """The objects that own an offloaded model's bytes: where they are, on the host and on the device, what
    each tensor views, and the edits that reach them."""

    host: HostCopies
    device: DeviceCopies
    binding: Binding
    edits: Edits


def encodes_between_forwards(plan: StoragePlan, budget: int | None, units: list[Unit]) -> bool:
    """Whether a set-up that finds no payload file to read encodes between forwards (`StoragePlan.encoding`): by
    default on CUDA wherever it can be and the device encoder's room for the largest unit fits the budget beside
    nothing else. Encoding first took 79x raw's set-up on an H100, between forwards 1.28x (call V)."""
    return plan.encodes_between_forwards(budget is None or encoder_room(largest_to_encode(units)) <= budget)


def largest_to_encode(units: list[Unit]) -> int:
    """The bytes the encoder reads for the largest of ``units`` (its tensors', without the flat buffer's padding)."""
    return max((sum(packed.nbytes for packed in unit.tensors) for unit in units), default=0)


def assemble(
    model: nn.Module, layout: UnitLayout, device: torch.device, shared: SharedHostMemory | None = None
) -> Copies:
    """The four owners of a model's bytes, wired to each other (nothing is packed yet); the host copies in memory
    ``shared`` by the processes of the host when given (`host_forms.RawInSharedMemory`)."""
    positions = [layout.base, *layout.units]
    parts: dict[str, Any] = {}
    binding = Binding(
        positions, device, lambda unit: parts["host"].host_of(unit), lambda u, on: parts["edits"].found(u, on)
    )
    host = HostCopies(layout.base, layout.units, device, binding, shared)
    device_copies = DeviceCopies(model, layout, device, host, binding)
    edits = Edits(host, device_copies, binding)
    parts.update(host=host, edits=edits)
    return Copies(host, device_copies, binding, edits)


class SetUpContext(Protocol):
    """What set-up works on: the handle's model, parts and boundary calls (the handle is one)."""

    model: nn.Module
    config: OffloadConfig
    device: torch.device
    cuda: bool
    units: list[Unit]
    fingerprint: dict[str, Any]
    host: HostCopies
    device_copies: DeviceCopies
    binding: Binding
    planning: Planning
    setup_times: SetupTimes
    calls: BoundaryCalls

    @property
    def budget_bytes(self) -> int: ...

    def editing(self) -> AbstractContextManager[None]: ...


class SetUp:
    """Runs the set-up steps for ``handle`` and undoes them."""

    def __init__(self, handle: SetUpContext, raw_home: RawHome | None = None) -> None:
        self.handle = handle
        self.boundaries = Boundaries()
        self.cast_guard = CastGuard(handle.model)  # model.to(dtype) and kin refused while offloaded
        self.payload_cache: PayloadCache | None = None  # compression_cache: the file of the compressed copies
        self._raw_home = raw_home  # compressed only: where raw bytes go (None: `_home_in_cache_dir`)
        self._folder: Path | None = None  # `cache_folder`, checked once
        self._state_dict_hooks: list[Any] = []

    def run(self) -> None:
        """Each step as the storage plan (`OffloadConfig.storage`) says."""
        h, plan = self.handle, self.handle.config.storage
        if plan.writes_cache_files:  # a cache_dir refused before anything is packed: the model as it was
            self._cache_folder()
        h.host.form.open(h.fingerprint["sha256"], len(h.device_copies.loose))  # its files (shared memory's) first
        pin = h.cuda and h.config.pin_memory
        if plan.packs_progressively:
            h.host.start_progressive_packing(pin, self._packed)
            self._finish()
            return
        background = encodes_between_forwards(plan, h.budget_bytes, h.units)
        if background:
            h.host.compressed.budget_bytes = h.budget_bytes  # the device encoder's bound
        if background and plan.compressed_only:  # a payload file to read is read as the units are packed
            if not self._home_then_encode_between_forwards(pin):
                self._pack_and_encode(pin)
            self._finish()
            return
        if plan.may_read_payloads_later:
            self.payload_cache = self._payload_cache()  # named before packing moves tensors
            if background:  # the file checked once packing is over: read then, or (missing, refused) encoded
                # one unit over the budget: refused now, not at the forward that finds no payload file
                refuse_without_room(largest_to_encode(h.units), 0, h.budget_bytes, h.device)
                h.host.compressed.start_arrival_else_encoding(self.payload_cache, pin)
            if background or h.host.compressed.start_arrival(self.payload_cache, pin):
                h.host.start_progressive_packing(pin, self._packed_then_read_payloads)
                self._finish()
                return
        if background:  # no file to read: encode between forwards, while the model runs raw
            if plan.compression_cache and self.payload_cache is None:
                self.payload_cache = self._payload_cache()
            h.host.compressed.start_encoding(self.payload_cache, pin)
            h.host.start_progressive_packing(pin, self._packed)
            self._finish()
            return
        self._pack_and_encode(pin)
        self._finish()

    def _pack_and_encode(self, pin: bool) -> None:
        """Every unit packed before set-up returns, and with compression encoded as it is packed (or read from the
        payload file); compressed only, each unit's raw bytes leave RAM for its raw home once its payload is made."""
        h, plan = self.handle, self.handle.config.storage
        compressed_only = plan.compressed_only
        homes = h.host.keep_raw_in(self._raw_home or self._home_in_cache_dir()) if compressed_only else None
        window = PACKING_WINDOW if compressed_only and h.cuda else None  # the CPU encoder asks for all at once
        pin_now = pin and not compressed_only
        start = time.perf_counter()
        if plan.compressed and plan.compression_cache and self.payload_cache is None:
            self.payload_cache = self._payload_cache()  # named before packing moves tensors
        packing = h.host.start_packing(pin=pin_now, window=window)
        try:
            if plan.compressed:  # units are compressed as they are packed
                h.host.compressed.file = self.payload_cache
                h.host.compressed.budget_bytes = h.budget_bytes  # the device encoder's bound
                h.host.compressed.make(pin, self.payload_cache, settled=homes.settle if homes is not None else None)
                h.setup_times.compress = 1e3 * (time.perf_counter() - start)
        finally:
            h.setup_times.pack = 1e3 * packing.finish()
        if homes is not None:  # raw bytes left RAM as encoding went: what stays is page-locked now
            homes.set_up_done()
            if pin:
                homes.pin_the_rest()
            given = h.planning.profiles.given
            h.planning.check_budget(h.budget_bytes, given.profile if given is not None else None)  # staging room now

    def _home_then_encode_between_forwards(self, pin: bool) -> bool:
        """Compressed only, encoding between forwards, when there is no usable payload file (False: there is one, and
        set-up reads it as it packs, `_pack_and_encode`; or, ``raw_copies="none"``, a unit is not still the pages of
        its weight files, and set-up encodes it all first, `_pack_and_encode`, since that unit's payload is to be its
        only host copy): each unit whose tensors are still the pages of the
        weight files it was loaded from waits there with nothing read (`RawHomes.settle_as_loaded`); every other
        one is packed and its raw bytes handed to its raw home at once (the weight files, compared byte for byte;
        else the raw cache file), the packing a few units ahead, so that RAM holds a few raw units at most and
        set-up encodes nothing. The model then streams its raw bytes from the raw home while the units are encoded
        between its forwards (`CompressedCopies.start_encoding`); an edit meanwhile begins the encoding again."""
        h, plan = self.handle, self.handle.config.storage
        if plan.compression_cache:
            self.payload_cache = self._payload_cache()  # named before packing moves tensors
            if h.host.compressed.set_up.usable_records(self.payload_cache):
                return False
        homes = h.host.keep_raw_in(self._raw_home or self._home_in_cache_dir())
        every_unit = plan.between_forwards_needs_weight_files
        moved = homes.settle_as_loaded(every_unit)  # still their weight files' pages: nothing to read
        if moved is None:  # payloads only: a unit the files do not hold has no raw bytes to stream meanwhile
            logger.warning(
                "%s is encoded before enable returns, not between forwards: with raw_copies='none' a block its weight "
                "files do not hold as loaded (weights built or edited in memory) keeps its compressed copy only; "
                "raw_copies='disk' streams it from a cache file meanwhile",
                type(h.model).__name__,
            )
            return False  # the set-up encoder measures its own need (this formula's bound would refuse too soon)
        # one unit over the budget: refused now, before anything is packed (the handle undoes the moves)
        refuse_without_room(largest_to_encode(h.units), 0, h.budget_bytes, h.device)
        as_loaded = frozenset(moved)
        packing = h.host.start_packing(pin=False, window=PACKING_WINDOW, skip=as_loaded)
        try:
            for unit in h.units:  # in order: the window packs only a few units past the one asked for
                if unit.index + 1 not in as_loaded:
                    h.host.host_of(unit)
                    homes.home_raw(unit.index)
        finally:
            h.setup_times.pack = 1e3 * packing.finish()
        if pin:
            homes.pin_the_rest()
        h.host.compressed.start_encoding(self.payload_cache, pin, restart_on_edit=True)
        return True

    def _finish(self) -> None:
        """The steps after packing began: edit counts recorded, shared weights published, boundaries hooked."""
        h = self.handle
        h.binding.record()  # packing re-points tensors without counting; edits count from here
        h.host.form.publish(h.fingerprint["sha256"])
        hooking = time.perf_counter()
        self._hook()
        self.cast_guard.install()
        h.setup_times.hooks = 1e3 * (time.perf_counter() - hooking)

    def _packed(self, seconds: float) -> None:
        """Progressive packing is over (the last unit adopted and page-locked): the time it took, for the report."""
        self.handle.setup_times.pack = 1e3 * seconds

    def _packed_then_read_payloads(self, seconds: float) -> None:
        """Progressive packing is over: the payload file's reads begin now (`CompressedCopies.begin_arrival`)."""
        self._packed(seconds)
        self.handle.host.compressed.begin_arrival()

    def undo(self) -> None:
        """Undo what set-up added besides packing: boundaries, the cast guard, state-dict hooks, the claim on the
        payload file's name (the files the host copies' form kept, shared or raw, went with the host copies:
        `HostForm.restored`)."""
        self.boundaries.remove()
        self.cast_guard.remove()
        for hook in self._state_dict_hooks:
            hook.remove()
        self._state_dict_hooks = []
        if self.payload_cache is not None:
            self.payload_cache.close()

    def _home_in_cache_dir(self) -> RawHome:
        """The raw home when the caller gave none: ``raw_copies="none"``, none at all (the payloads are the host copy,
        nothing is written); ``"disk"``, a cache file in ``cache_dir``."""
        h = self.handle
        if h.config.storage.raw_copies == "none":
            return PayloadsOnlyHome()
        name = f"{type(h.model).__name__}-{h.fingerprint['sha256'][:16]}-{os.getpid()}-{id(h):x}.raw"
        return RawCacheFile(self._cache_folder() / name, h.host.positions)

    def _payload_cache(self) -> PayloadCache:
        """This model's payload file: named by its structure and sampled bytes of every unit."""
        h = self.handle
        key = weights_key(h.fingerprint["sha256"], h.units)
        return PayloadCache(self._cache_folder(), type(h.model).__name__, key)

    def _cache_folder(self) -> Path:
        """``cache_dir`` (or this user's cache folder), made and checked once (`config.cache_folder`)."""
        if self._folder is None:
            self._folder = cache_folder(self.handle.config.cache_dir)
        return self._folder

    def _hook(self) -> None:
        """Route the model's calls, its entry methods' and its units' through the handle; edit methods run
        inside ``editing()``; ``state_dict`` reads host copies."""
        h, boundaries, calls = self.handle, self.boundaries, self.handle.calls
        workload = Crossing(hidden(calls.enter_forward), hidden(calls.exit_workload), hidden(calls.fail_workload))
        boundaries.border(h.model, workload)
        for name in h.config.entry_methods:
            entry = Crossing(enter=hidden(calls.entry(name)), exit=workload.exit, fail=workload.fail)
            boundaries.wrap_entry(h.model, name, entry)
        for name in h.config.edit_methods:
            if callable(getattr(h.model, name, None)):
                boundaries.wrap_edit(h.model, name, h.editing)
        unit_failed = hidden(calls.unit_failed)
        for unit in h.units:
            enter, exit_ = hidden(calls.unit_entry(unit.index)), hidden(calls.unit_exit(unit.index))
            boundaries.border_unit(unit.module, Crossing(enter, exit_, unit_failed, calls.units_compiled))
        self._state_dict_hooks = [
            unit.module._register_state_dict_hook(self._state_dict_hook(unit)) for unit in h.host.positions
        ]

    def _state_dict_hook(self, unit: Unit) -> Callable[..., None]:
        """``state_dict()`` reads host copies, the weights' truth, after an edit made in a device copy reached
        them; units still arriving from disk are waited for. Each tensor in a storage of its own, as natively
        (`own_storage_view`)."""
        h = self.handle

        def hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
            if unit.host is None:
                return
            h.binding.check(unit)
            host = h.host.readable(unit)  # payloads only: decoded, into buffers the values keep alive
            for rel, value in unit.values_in(host, lambda packed: own_storage_view(packed, host)).items():
                if prefix + rel in state_dict:
                    state_dict[prefix + rel] = value

        return hook


def own_storage_view(packed: PackedTensor, host: Any) -> torch.Tensor:
    """``packed``'s bytes in the host copy ``host``, not copied, as a tensor whose storage spans just them.

    Native ``state_dict()`` gives each weight's own storage; a view of the unit's flat buffer would give the whole
    buffer's. ``torch.save`` writes a tensor's whole storage, once per storage: views would write every unit's
    buffer, padding included, and a model loaded from that file would find its weights sharing storages (refused
    by offloading, which cannot pack them apart without un-sharing them). Wrapping the bytes in a storage of their
    own (``torch.frombuffer``, which keeps the host buffer alive) costs no memory and writes what native writes."""
    span = host[packed.offset : packed.offset + packed.nbytes]
    if span.numel():
        span = torch.frombuffer(span.numpy(), dtype=torch.uint8)
    return span.view(packed.dtype).as_strided(packed.shape, packed.stride)
