"""Units: the modules that are streamed, each packed into one flat host buffer.

A *unit* is the outermost module whose name matches an include pattern. All its parameters and
buffers are copied into one ``uint8`` host buffer, each tensor at an offset aligned to 512 bytes
(what the CUDA caching allocator guarantees for a native tensor), and the tensors become views of
that buffer. Streaming a unit is then one host→device copy, and because the same offsets are used
inside the GPU slot, every kernel sees the alignment it sees natively and picks the same algorithm.

Tensors are re-pointed with ``tensor.data = view``: the ``Parameter`` objects themselves never
change, so tied weights, optimiser references and ``named_parameters()`` all keep working.
"""

from __future__ import annotations

import difflib
import fnmatch
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from .errors import FlexTensorError, PatternError
from .host_memory import host_buffer, pin_in_place, unpin_in_place

logger = logging.getLogger(__name__)

#: Alignment of every tensor inside a flat buffer; the CUDA caching allocator's block alignment.
ALIGNMENT = 512


def align(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class PackedTensor:
    """One parameter or buffer of a unit: where it lives in the flat buffer and where it came from."""

    tensor: torch.Tensor  # the Parameter / buffer object whose ``.data`` we re-point
    names: list[str]  # names relative to the unit (several when tied inside the unit)
    offset: int
    nbytes: int
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    origin_device: torch.device
    persistent: bool  # appears in state_dict()

    def view_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This tensor as a view of ``flat`` (a uint8 buffer laid out like the host buffer)."""
        return flat[self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)


@dataclass
class Unit:
    """A streamed module and its flat host buffer."""

    index: int
    name: str
    module: nn.Module
    tensors: list[PackedTensor] = field(default_factory=list)
    nbytes: int = 0  # size of the flat buffer (aligned)
    host: torch.Tensor | None = None  # flat uint8 host buffer, pinned when streaming to CUDA
    pinned_in_place: bool = False  # registered with cudaHostRegister (must be unregistered)

    def bind(self, flat: torch.Tensor) -> None:
        """Point every tensor of the unit at its bytes inside ``flat`` (host buffer, slot or resident copy)."""
        for packed in self.tensors:
            packed.tensor.data = packed.view_of(flat)


# --------------------------------------------------------------------------------------------- finding


def find_units(model: nn.Module, include: Sequence[str], exclude: Sequence[str] = ()) -> list[tuple[str, nn.Module]]:
    """The outermost modules whose names match ``include`` (fnmatch) and not ``exclude``.

    An empty ``include`` selects nothing: the whole model is then one resident block, moved in and
    out as a whole (what a small component such as a VAE needs).

    Raises `PatternError` for a pattern that matches nothing (listing close names), for a match on
    the root, and for a container without ``forward`` (ModuleList/ModuleDict), whose children run
    without passing through it and so could never be streamed correctly.
    """
    names = [name for name, _ in model.named_modules()]
    used: set[str] = set()
    selected: list[tuple[str, nn.Module]] = []
    excluded: list[str] = []  # an excluded module stays whole: its children are never units either
    for name, module in model.named_modules():
        hits = [p for p in include if fnmatch.fnmatchcase(name, p)]
        used.update(hits)
        if any(fnmatch.fnmatchcase(name, p) for p in exclude):
            excluded.append(name)
            continue
        if not hits or any(name.startswith(parent + ".") for parent in excluded):
            continue
        if name == "":
            raise PatternError(
                f"pattern {hits[0]!r} matches the whole model; stream its blocks instead, e.g. 'blocks.*'"
            )
        if any(name.startswith(parent + ".") for parent, _ in selected):
            continue  # inside a unit already chosen: the outermost match wins
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            raise PatternError(
                f"pattern {hits[0]!r} matches {name!r}, a {type(module).__name__} that is never called "
                f"itself; match its children instead, e.g. '{name}.*'"
            )
        selected.append((name, module))
    unmatched = [p for p in include if p not in used]
    if unmatched:
        pattern = unmatched[0]
        stem = pattern.replace("*", "").replace("?", "").strip(".")
        close = difflib.get_close_matches(stem, [n for n in names if n], n=5, cutoff=0.3)
        hint = f" Close module names: {', '.join(close)}." if close else ""
        raise PatternError(f"include pattern {pattern!r} matched no module of {type(model).__name__}.{hint}")
    if include and not selected:
        raise PatternError("the include patterns matched only excluded modules: nothing would be streamed")
    return selected


def _owned_tensors(module: nn.Module) -> Iterable[tuple[str, torch.Tensor, bool]]:
    """(local name, tensor, persistent) of the parameters and buffers a module holds directly."""
    for name, p in module._parameters.items():
        if p is not None:
            yield name, p, True
    non_persistent = getattr(module, "_non_persistent_buffers_set", set())
    for name, b in module._buffers.items():
        if b is not None:
            yield name, b, name not in non_persistent


@dataclass
class UnitLayout:
    """What packing will do, computed without touching the model.

    ``base`` packs every tensor outside the units (and those shared between places) the same way
    as a unit: it is on the device whenever the model is active, and its pinned host copy makes
    releasing and re-activating the model cheap. ``loose`` tensors share a storage with another
    tensor, so packing would un-share them: they are moved with ``.to()`` instead.
    """

    units: list[Unit]
    base: Unit
    loose: list[torch.Tensor]

    @property
    def resident_bytes(self) -> int:
        return self.base.nbytes + sum(tensor_nbytes(t) for t in self.loose)


def plan_layout(model: nn.Module, selected: list[tuple[str, nn.Module]], meta_ok: bool = False) -> UnitLayout:
    """Assign every tensor of ``model`` to one unit or to the resident set, and lay out each unit.

    A tensor used by two units, or by a unit and a module outside any unit (tied embeddings, say),
    stays resident, so that it remains one tensor. Distinct tensors sharing one storage are kept
    resident too: packing would silently un-share them. ``meta_ok``: the model may be on the meta
    device (its bytes come from shared host memory), where storages cannot be compared.
    """
    unit_of_module: dict[int, int] = {}
    for i, (_, module) in enumerate(selected):
        for sub in module.modules():
            unit_of_module.setdefault(id(sub), i)

    # Where each tensor is used: the set of unit indices (-1: outside any unit).
    places: dict[int, set[int]] = {}
    tensor_by_id: dict[int, torch.Tensor] = {}
    qualified: dict[int, str] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        place = unit_of_module.get(id(module), -1)
        for local, t, _ in _owned_tensors(module):
            places.setdefault(id(t), set()).add(place)
            tensor_by_id[id(t)] = t
            qualified.setdefault(id(t), f"{mod_name}.{local}" if mod_name else local)

    storages: dict[int, set[int]] = {}
    for tid, t in tensor_by_id.items():
        if t.device.type == "meta":
            if meta_ok:
                continue
            raise FlexTensorError(
                f"tensor {qualified[tid]!r} is on the meta device: load the weights before offloading "
                "(or attach to weights another process packed: SharedHostMemory(..., create=False))"
            )
        storages.setdefault(t.untyped_storage().data_ptr(), set()).add(tid)
    storage_shared = {tid for ids in storages.values() if len(ids) > 1 for tid in ids}

    base_ids: set[int] = set()
    loose: list[torch.Tensor] = []
    shared_names: list[str] = []
    unit_tensor_ids: list[set[int]] = [set() for _ in selected]
    for tid, where in places.items():
        if tid in storage_shared:
            loose.append(tensor_by_id[tid])
            shared_names.append(qualified[tid])
        elif len(where) == 1 and -1 not in where:
            unit_tensor_ids[next(iter(where))].add(tid)
        else:
            base_ids.add(tid)
            if len(where) > 1:
                shared_names.append(qualified[tid])
    if shared_names:
        logger.info("kept resident because shared between modules: %s", ", ".join(sorted(shared_names)))

    units = []
    for i, (name, module) in enumerate(selected):
        unit = _lay_out(Unit(index=i, name=name, module=module), unit_tensor_ids[i])
        if not unit.tensors:
            raise PatternError(
                f"unit {name!r} holds no weights of its own (all shared or none): leave it out of the patterns"
            )
        units.append(unit)
    base = _lay_out(Unit(index=-1, name="(outside units)", module=model), base_ids)
    return UnitLayout(units=units, base=base, loose=loose)


def _lay_out(unit: Unit, tensor_ids: set[int]) -> Unit:
    """Give each of the unit's tensors (those in ``tensor_ids``) its aligned offset, in module order."""
    by_id: dict[int, PackedTensor] = {}
    offset = 0
    for sub_name, sub in unit.module.named_modules(remove_duplicate=False):
        for local, t, persistent in _owned_tensors(sub):
            if id(t) not in tensor_ids:
                continue
            rel = f"{sub_name}.{local}" if sub_name else local
            if id(t) in by_id:
                by_id[id(t)].names.append(rel)
                by_id[id(t)].persistent |= persistent
                continue
            if not t.is_contiguous():
                logger.debug("%s.%s is not contiguous; it is streamed contiguous", unit.name, rel)
            packed = PackedTensor(
                tensor=t,
                names=[rel],
                offset=offset,
                nbytes=tensor_nbytes(t),
                shape=t.shape,
                stride=t.stride(),
                dtype=t.dtype,
                origin_device=t.device,
                persistent=persistent,
            )
            by_id[id(t)] = packed
            unit.tensors.append(packed)
            offset = align(offset + packed.nbytes)
    unit.nbytes = offset
    return unit


# --------------------------------------------------------------------------------------------- packing


def unpin_unit(unit: Unit) -> None:
    """Undo `pin_unit`'s in-place registration (a pinned copy is simply dropped with its buffer)."""
    if unit.pinned_in_place:
        assert unit.host is not None
        unpin_in_place(unit.host)
        unit.pinned_in_place = False


def pack_unit(unit: Unit, host: torch.Tensor | None = None, filled: bool = False) -> None:
    """Copy the unit's tensors into one flat host buffer and make them views of it.

    Tensors are moved one by one, so the original of each is freed as soon as it is copied (when
    nothing else holds it): host memory grows by at most one unit during set-up. ``host`` is a
    buffer to use instead of a new one (shared memory); ``filled``: it already holds this unit's
    bytes (another process packed them), so the tensors are only pointed at it.
    """
    if host is None:
        host = host_buffer(unit.nbytes)
    for packed in unit.tensors:
        view = packed.view_of(host)
        if not filled:
            view.copy_(packed.tensor.data)
        if packed.tensor.device.type == "meta":  # ``.data`` cannot leave the meta device; swap in place
            new = nn.Parameter(view, packed.tensor.requires_grad) if isinstance(packed.tensor, nn.Parameter) else view
            torch.utils.swap_tensors(packed.tensor, new)
        else:
            packed.tensor.data = view
    unit.host = host


def pin_unit(unit: Unit, attached: bool = False) -> None:
    """Page-lock a packed unit's host buffer, in place where CUDA allows, else as a pinned copy.

    Only page-locked memory copies to the GPU asynchronously and at full PCIe speed. ``attached``:
    the buffer holds weights another process packed (shared memory), so a private copy would
    defeat the sharing.
    """
    assert unit.host is not None
    if pin_in_place(unit.host):
        unit.pinned_in_place = True
    elif attached:
        raise FlexTensorError("cudaHostRegister failed on the shared weights: they cannot be pinned in place")
    else:
        unit.host = unit.host.pin_memory()
        unit.bind(unit.host)


def restore_unit(unit: Unit) -> None:
    """Give every tensor its own storage again, on the device it came from, bit-exact.

    Tensors of a model built on the meta device (attached to shared weights) come back on the CPU.

    All new tensors are allocated before any is assigned, so a failure (out of memory) leaves the
    unit exactly as it was: still packed and streamable.
    """
    assert unit.host is not None
    fresh = []
    for packed in unit.tensors:
        device = packed.origin_device if packed.origin_device.type != "meta" else torch.device("cpu")
        t = torch.empty_strided(packed.shape, packed.stride, dtype=packed.dtype, device=device)
        t.copy_(packed.view_of(unit.host))
        fresh.append(t)
    for packed, t in zip(unit.tensors, fresh, strict=True):
        packed.tensor.data = t
    unpin_unit(unit)
    unit.host = None
