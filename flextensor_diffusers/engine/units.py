"""Units: the modules that are streamed, each packed into one flat host buffer.

A *unit* is the outermost module whose name matches an include pattern. All its parameters and
buffers are copied into one ``uint8`` host buffer and the tensors become views of that buffer.
Streaming a unit is then one host→device copy into a slot laid out like the host buffer.

**Every view keeps the placement its tensor had natively**, because kernels pick their code path by
it: on a CPU with MKL, an FP32 or FP64 matrix-vector product (``F.linear`` with one input row) sums
in another order when its weight's address changes modulo 16, and a transposed or strided weight
runs other kernels than a contiguous one (docs/guide.md, "Where weights sit"). A weight that ``from_pretrained``
left at an unaligned address (a view of a mapped safetensors file) must therefore sit at the same
address, modulo what the kernels tell apart, in every buffer it computes from, with the same strides:

* its *alignment class* is its address modulo the device's `class_modulus` (`CPU_ALIGNMENT`, 64, on
  the CPU; `ALIGNMENT`, 512, on CUDA) when it is already on the compute device (any CPU tensor, when
  computing on the CPU), else 0: where ``.to(device)`` puts it, a fresh allocation;
* its strides are its own when it is already there, else those ``.to(device)`` gives. A strided view
  keeps its gaps and an expanded one its stride 0: the flat buffer holds the *span* of memory the
  view reaches, not ``numel`` elements;
* its offset in the flat buffer is ≡ its class, and every buffer a unit is copied into starts at a
  multiple of `ALIGNMENT` (host buffers are page aligned, device buffers come from `aligned_buffer`),
  so the view's address has the class.

Each tensor takes a `room` with space for any class it may have, so a unit's size depends only on its
tensors' shapes, dtypes and strides, never on where they happened to sit: budgets, saved profiles and
shared files agree between runs and processes, and a model on the meta device lays out as large as its
loaded self. Weights in shared host memory are laid out alike in every process (a follower's model is
on the meta device): contiguous, at class 0.

`restore_unit` gives every tensor back its strides and its address modulo `ALIGNMENT` on the device it
came from, in storage of its own, bit-exact.

Tensors are re-pointed with ``tensor.data = view``: the ``Parameter`` objects themselves never
change, so tied weights, optimiser references and ``named_parameters()`` all keep working.

A tensor subclass (a quantized weight) is packed through the plain tensors it computes from, each laid out by the
rules above, and follows them to each device (`subclasses`).
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from operator import itemgetter

import torch
from torch import nn

from ..storage.host_bytes import Flat, HostBytes, InRam, InSharedMemory
from ..storage.host_memory import host_buffer, pin_in_place, unpin_in_place
from ..storage.read_guard import NoRawBytes, refuse_reads
from .errors import FlexTensorError, PatternError, UnsupportedTensorError
from .subclasses import UNSHARE, Flattened, Wrapper, as_type_of, copy_leaves, flatten, is_plain

logger = logging.getLogger(__name__)

#: Alignment of every flat buffer, and the modulus of a tensor's alignment class on CUDA: the caching
#: allocator's block alignment, so a tensor moved there natively is at class 0.
ALIGNMENT = 512
#: The modulus of a tensor's alignment class on the CPU: the widest vector a CPU kernel loads (AVX-512)
#: and a cache line. The CPU allocator aligns every allocation to it, so freshly allocated tensors are at
#: class 0 and two runs of one model lay it out alike (a payload cache written by one fits the next).
CPU_ALIGNMENT = 64


def align(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


def class_modulus(device: torch.device) -> int:
    """The modulus of alignment classes on ``device`` (see `ALIGNMENT`, `CPU_ALIGNMENT`)."""
    return CPU_ALIGNMENT if device.type == "cpu" else ALIGNMENT


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def span_nbytes(shape: Sequence[int], stride: Sequence[int], itemsize: int) -> int:
    """Bytes from a strided view's first element to the end of its last (strides are never negative)."""
    if any(size == 0 for size in shape):
        return 0
    return (1 + sum((size - 1) * step for size, step in zip(shape, stride, strict=True))) * itemsize


def is_dense(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Every byte of the span belongs to exactly one element of the view (contiguous, transposed,
    channels-last): an elementwise copy then fills the whole span. False for gaps and repeats."""
    if any(size == 0 for size in shape):
        return True
    expected = 1
    for size, step in _dims_by_stride(shape, stride):
        if step != expected:
            return False
        expected *= size
    return True


def repeats_beyond_expansion(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Two elements of the view may share memory other than along a stride-0 dimension (an ``expand``):
    a layout only ``as_strided`` makes, which an elementwise copy cannot write. Conservative: dimensions
    taken by increasing stride must each step past everything the smaller ones reach."""
    reach = 1
    for size, step in _dims_by_stride(shape, stride):
        if step == 0:
            continue
        if step < reach:
            return True
        reach += (size - 1) * step
    return False


def _dims_by_stride(shape: Sequence[int], stride: Sequence[int]) -> list[tuple[int, int]]:
    """(size, stride) of the dimensions longer than 1, by increasing stride."""
    return sorted(((size, step) for size, step in zip(shape, stride, strict=True) if size > 1), key=itemgetter(1))


@dataclass(frozen=True)
class Placement:
    """How a tensor's elements sit in memory: its strides, and its alignment class, the address of its first
    element modulo `ALIGNMENT`, which the kernels of some machines choose their code path by.
    ``from_address``: the class comes from the tensor's address, not 0 by rule (moved, or canonical)."""

    stride: tuple[int, ...]
    alignment_class: int
    from_address: bool

    @classmethod
    def native(cls, t: torch.Tensor) -> Placement:
        """Where ``t`` sits now (class 0 on the meta device, which has no addresses)."""
        address = t.data_ptr() if t.device.type != "meta" else 0
        alignment_class = address % ALIGNMENT
        if alignment_class % t.element_size():  # a view of a flat buffer cannot start inside an element
            logger.warning(
                "a %s tensor %s sits at an address that is not a multiple of its element size: it computes "
                "from the nearest lower one once offloaded",
                t.dtype,
                tuple(t.shape),
            )
            alignment_class -= alignment_class % t.element_size()
        return cls(tuple(t.stride()), alignment_class, from_address=t.device.type != "meta")

    @classmethod
    def moved(cls, t: torch.Tensor) -> Placement:
        """Where ``t.to(another_device)`` puts it: a fresh allocation (class 0), with the strides its
        preserve-format copy takes (its own when it is dense, else contiguous)."""
        return cls(tuple(torch.empty_like(t, device="meta").stride()), 0, from_address=False)

    @classmethod
    def canonical(cls, t: torch.Tensor) -> Placement:
        """Contiguous at class 0: the same in every process, whatever its tensors' placements."""
        return cls(tuple(torch.empty(t.shape, device="meta").stride()), 0, from_address=False)

    def on(self, device: torch.device) -> Placement:
        """This placement as the kernels of ``device`` tell classes apart (modulo its `class_modulus`)."""
        return dataclasses.replace(self, alignment_class=self.alignment_class % class_modulus(device))


def room(span: int, itemsize: int, placement: Placement, device: torch.device) -> int:
    """Bytes a tensor of ``span`` bytes at ``placement`` takes in a flat buffer for ``device``, from a multiple of
    the device's `class_modulus` on: room for any class where one may come from an address, so that a unit's
    size depends on its tensors' shapes, dtypes and strides, never on their addresses. On the CPU that is every
    tensor (one not there yet gets the room too, so a model on the meta device lays out as large as once
    loaded: budgets estimated before loading hold); on CUDA only a tensor already there, since one moved there
    is at class 0, as ``.to()`` puts it."""
    modulus = class_modulus(device)
    any_class = placement.from_address or device.type == "cpu"
    return align(span + (modulus - itemsize if any_class else 0), modulus)


def aligned_buffer(nbytes: int, device: torch.device, alignment_class: int = 0) -> torch.Tensor:
    """A new uninitialised uint8 buffer of ``nbytes`` on ``device`` whose address is ≡ ``alignment_class``
    (mod `ALIGNMENT`): over-allocated and sliced, unless the allocator's block is aligned already (CUDA's
    caching allocator aligns its blocks to 512 bytes; the CPU allocator only to 64)."""
    if alignment_class == 0 and device.type == "cuda":
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if buffer.data_ptr() % ALIGNMENT == 0:
            return buffer
        del buffer
    raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8, device=device)
    start = (alignment_class - raw.data_ptr()) % ALIGNMENT
    return raw[start : start + nbytes]


@dataclass
class PackedTensor:
    """One parameter or buffer of a unit: where it lives in the flat buffer and where it came from.

    ``offset`` ≡ its alignment class on the compute device (modulo the device's `class_modulus`),
    ``nbytes`` is its span there and ``stride`` its strides in every flat buffer; ``origin`` is its
    placement on ``origin_device`` when it was packed, which `restore_unit` gives back.
    """

    tensor: torch.Tensor  # the Parameter / buffer object whose ``.data`` we re-point
    names: list[str]  # names relative to the unit (several when tied inside the unit)
    offset: int
    nbytes: int
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    origin_device: torch.device
    origin: Placement
    persistent: bool  # appears in state_dict()
    inside: bool = False  # a leaf inside a wrapper subclass: no module holds it (`subclasses`)

    def view_of(self, flat: Flat) -> torch.Tensor:
        """This tensor as a view of ``flat`` (a uint8 buffer laid out like the host buffer)."""
        return flat[self.offset : self.offset + self.nbytes].view(self.dtype).as_strided(self.shape, self.stride)


@dataclass
class Unit:
    """A streamed module and its flat host buffer."""

    index: int
    name: str
    module: nn.Module
    tensors: list[PackedTensor] = field(default_factory=list)
    nbytes: int = 0  # size of the flat buffer (a multiple of ALIGNMENT)
    #: Its host bytes: where they are and in what form (`storage.host_bytes`); None before packing and once
    #: restored. Only the host copies' owner (`storage.host_copies`) and packing set it.
    stored: HostBytes | None = None
    pinned_in_place: bool = False  # registered with cudaHostRegister (must be unregistered)
    wrappers: list[Wrapper] = field(default_factory=list)  # the unit's tensor subclasses held by its modules
    #: Its tensors view a `NoRawBytes` and refuse reads (`read_guard`): set and cleared by `bind` only.
    reads_refused: bool = False

    @property
    def host(self) -> Flat | None:
        """What the unit's tensors view while they view its host copy (the flat buffer, pinned when streaming to
        CUDA, or a stand-in for it); None when it has none."""
        return self.stored.flat if self.stored is not None else None

    @property
    def buffer(self) -> torch.Tensor | None:
        """Its host bytes as one flat uint8 tensor; None when it has none, or a stand-in holds them."""
        return self.stored.buffer if self.stored is not None else None

    def held(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of each tensor the unit's modules hold: its packed tensors, a subclass in place of its
        leaves."""
        plain = [(packed.names[0], packed.tensor) for packed in self.tensors if not packed.inside]
        return plain + [(wrapper.names[0], wrapper.tensor) for wrapper in self.wrappers]

    def values_in(
        self, flat: torch.Tensor, view: Callable[[PackedTensor], torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """Each name the unit's modules hold a tensor by (tied ones: each), with that tensor's value in ``flat``:
        a view of it (``view``: how each packed tensor is viewed, by default `PackedTensor.view_of`), of the
        tensor's type (a subclass rebuilt over views of its leaves). What ``state_dict()`` gives, read from the
        host copy."""
        values = {}
        views = {id(packed.tensor): view(packed) if view else packed.view_of(flat) for packed in self.tensors}
        for packed in self.tensors:
            if not packed.inside:
                value = as_type_of(packed.tensor, views[id(packed.tensor)])
                values.update(dict.fromkeys(packed.names, value))
        for wrapper in self.wrappers:
            values.update(dict.fromkeys(wrapper.names, wrapper.rebuilt(lambda leaf: views[id(leaf)])))
        return values

    def adopt_replaced_subclasses(self) -> list[str]:
        """After an edit, with the unit viewing its host copy: a subclass weight the edit replaced, in a module
        (quanto's ``load_state_dict`` makes a new ``QTensor``) or inside another (``weight.qdata = new``), has its
        values copied into the tensors packed here, which are put back, so the host copy holds the edit. The names
        of replacements that are not alike (another type, metadata, shape or dtype), put back too: to refuse."""
        refused = []
        present = {id(t) for t in [*self.module.parameters(), *self.module.buffers()]}
        for wrapper in self.wrappers:
            for rel in wrapper.names if id(wrapper.tensor) not in present else ():  # held still (peft: base_layer)
                owner_name, _, attr = rel.rpartition(".")
                owner = self.module.get_submodule(owner_name)
                held = owner._parameters if attr in owner._parameters else owner._buffers
                if attr not in held:  # its module was replaced: the weight left the model (`Edits` drops it)
                    continue
                if held.get(attr) is not wrapper.tensor:
                    if not copy_leaves(held.get(attr), wrapper.tensor):
                        refused.append(f"{self.name}.{rel}")
                    held[attr] = wrapper.tensor
            refused.extend(wrapper.adopt_replaced(f"{self.name}.{wrapper.names[0]}"))
        return refused

    def bind(self, flat: Flat) -> None:
        """Point every tensor of the unit at its bytes inside ``flat`` (host buffer, slot or resident copy). Pointed at
        a `NoRawBytes` (a unit kept as payloads only, between its calls) its tensors refuse reads until pointed at
        real bytes again (`read_guard`)."""
        if isinstance(flat, torch.Tensor):  # a stand-in for a spilled host copy has no address of its own
            assert flat.data_ptr() % ALIGNMENT == 0, f"a flat buffer of {self.name} is not {ALIGNMENT}-byte aligned"
        with torch._C.DisableTorchFunctionSubclass():  # a subclass's __torch_function__ has no say in re-pointing
            for packed in self.tensors:
                packed.tensor.data = packed.view_of(flat)
        refused = isinstance(flat, NoRawBytes)
        if refused != self.reads_refused:
            refuse_reads((packed.tensor for packed in self.tensors), refused)
            self.reads_refused = refused
        for wrapper in self.wrappers:
            wrapper.follow(getattr(flat, "device", _CPU))


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


_CPU = torch.device("cpu")


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


def plan_layout(
    model: nn.Module,
    selected: list[tuple[str, nn.Module]],
    device: torch.device,
    meta_ok: bool = False,
    canonical: bool = False,
) -> UnitLayout:
    """Assign every tensor of ``model`` to one unit or to the resident set, and lay out each unit.

    A tensor used by two units, or by a unit and a module outside any unit (tied embeddings, say),
    stays resident, so that it remains one tensor. Distinct tensors sharing one storage are kept
    resident too: packing would silently un-share them. ``device``: the compute device, on which every
    tensor keeps its placement (see the module docstring). ``canonical``: lay every tensor out the same
    way in every process instead (weights in shared host memory). ``meta_ok``: the model may be on the
    meta device (its bytes come from shared host memory), where storages cannot be compared.
    """
    uses = _tensor_uses(model, selected)
    storage_shared = _storage_shared(uses, meta_ok)
    unit_tensor_ids, base_ids, loose = _assign_tensors(uses, storage_shared, len(selected))
    units = []
    for i, (name, module) in enumerate(selected):
        unit = _lay_out(Unit(index=i, name=name, module=module), unit_tensor_ids[i], uses.flat, device, canonical)
        if not unit.tensors:
            raise PatternError(
                f"unit {name!r} holds no weights of its own (all shared or none): leave it out of the patterns"
            )
        units.append(unit)
    base = _lay_out(Unit(index=-1, name="(outside units)", module=model), base_ids, uses.flat, device, canonical)
    return UnitLayout(units=units, base=base, loose=loose)


@dataclass
class _TensorUses:
    """Every plain tensor of a model by ``id`` (a subclass's leaves: `subclasses.flatten`), in the order the model's
    modules hold them: the tensor, its first qualified name (for messages) and the set of units using it (-1: a
    module outside any unit). ``flat``: each tensor modules hold, by ``id``, flattened; ``within``: the subclass
    holding a leaf, by the leaf's ``id`` (absent for a tensor modules hold themselves)."""

    tensor: dict[int, torch.Tensor] = field(default_factory=dict)
    name: dict[int, str] = field(default_factory=dict)
    places: dict[int, set[int]] = field(default_factory=dict)
    flat: dict[int, Flattened] = field(default_factory=dict)
    within: dict[int, Wrapper] = field(default_factory=dict)

    def add(self, t: torch.Tensor, qualified: str, place: int) -> None:
        """``t``, held by a module as ``qualified`` in ``place``: its leaves used there."""
        flat = self.flat.get(id(t))
        if flat is None:
            flat = self.flat[id(t)] = flatten(t, qualified)
        for path, leaf in flat.leaves:
            holder = self.within.get(id(leaf))
            if id(leaf) in self.places and holder is not flat.wrapper:
                raise UnsupportedTensorError(
                    f"{qualified!r} ({type(t).__name__}) and {self.name[id(leaf)]!r} hold the same tensor, inside a "
                    f"tensor subclass and elsewhere: it could not be streamed as one; {UNSHARE}"
                )
            self.places.setdefault(id(leaf), set()).add(place)
            self.tensor[id(leaf)] = leaf
            self.name.setdefault(id(leaf), f"{qualified}.{path}" if path else qualified)
            if flat.wrapper is not None:
                self.within[id(leaf)] = flat.wrapper


def _tensor_uses(model: nn.Module, selected: list[tuple[str, nn.Module]]) -> _TensorUses:
    """Where each tensor of ``model`` is used. Modules are walked with duplicates, so a module (and so a tensor)
    reachable both inside and outside a unit is seen in every place; a submodule of several units belongs to
    the first that holds it."""
    unit_of_module: dict[int, int] = {}
    for i, (_, module) in enumerate(selected):
        for sub in module.modules():
            unit_of_module.setdefault(id(sub), i)
    uses = _TensorUses()
    for mod_name, module in model.named_modules(remove_duplicate=False):
        place = unit_of_module.get(id(module), -1)
        for local, t, _ in _owned_tensors(module):
            uses.add(t, f"{mod_name}.{local}" if mod_name else local, place)
    return uses


def _storage_shared(uses: _TensorUses, meta_ok: bool) -> set[int]:
    """Ids of the distinct tensors that share a storage with another: packing copies each tensor into bytes
    of its own, which would silently un-share them. Tensors on the meta device have no storage to compare;
    they are refused unless ``meta_ok``."""
    storages: dict[int, set[int]] = {}
    for tid, t in uses.tensor.items():
        if t.device.type == "meta":
            if meta_ok and is_plain(t) and tid not in uses.within:
                continue
            raise FlexTensorError(
                f"tensor {uses.name[tid]!r} is on the meta device: load the weights before offloading "
                "(or attach to weights another process packed: SharedHostMemory(..., create=False), which takes "
                "plain tensors only)"
            )
        storages.setdefault(t.untyped_storage().data_ptr(), set()).add(tid)
    shared = {tid for ids in storages.values() if len(ids) > 1 for tid in ids}
    inner = [tid for tid in shared if tid in uses.within]
    if inner:  # left loose, it would move with .to(): the subclass holding it would not follow
        raise UnsupportedTensorError(
            f"{uses.name[inner[0]]!r} shares its storage with another tensor, which packing would un-share; {UNSHARE}"
        )
    return shared


def _assign_tensors(
    uses: _TensorUses, storage_shared: set[int], n_units: int
) -> tuple[list[set[int]], set[int], list[torch.Tensor]]:
    """Each unit's tensor ids, the resident base's and the loose tensors (moved with ``.to()``): a tensor used
    by one unit only goes to it; one used in several places or outside units stays in the base, so that it
    remains one tensor; one sharing its storage stays loose. Logs the names of those kept resident for sharing."""
    base_ids: set[int] = set()
    loose: list[torch.Tensor] = []
    shared_names: list[str] = []
    unit_tensor_ids: list[set[int]] = [set() for _ in range(n_units)]
    for tid, where in uses.places.items():
        if tid in storage_shared:
            loose.append(uses.tensor[tid])
            shared_names.append(uses.name[tid])
        elif len(where) == 1 and -1 not in where:
            unit_tensor_ids[next(iter(where))].add(tid)
        else:
            base_ids.add(tid)
            if len(where) > 1:
                shared_names.append(uses.name[tid])
    if shared_names:
        logger.info("kept resident because shared between modules: %s", ", ".join(sorted(shared_names)))
    return unit_tensor_ids, base_ids, loose


def _lay_out(
    unit: Unit, tensor_ids: set[int], flat: dict[int, Flattened], device: torch.device, canonical: bool
) -> Unit:
    """Place each of the unit's tensors (those in ``tensor_ids``; a subclass's leaves, by ``flat``), in module
    order, each in its `room` at the offset ≡ its class on ``device``."""
    by_id: dict[int, PackedTensor | Wrapper] = {}
    offset = 0
    for sub_name, sub in unit.module.named_modules(remove_duplicate=False):
        for local, t, persistent in _owned_tensors(sub):
            leaves, wrapper = flat[id(t)].leaves, flat[id(t)].wrapper
            if id(leaves[0][1]) not in tensor_ids:  # a subclass's leaves all go where it goes
                continue
            rel = f"{sub_name}.{local}" if sub_name else local
            if id(t) in by_id:  # tied inside the unit
                by_id[id(t)].names.append(rel)
                if wrapper is None:
                    by_id[id(t)].persistent |= persistent  # type: ignore[union-attr]
                continue
            if wrapper is not None:
                by_id[id(t)] = wrapper
                wrapper.names.append(rel)
                unit.wrappers.append(wrapper)
            for path, leaf in leaves:
                name = f"{rel}.{path}" if path else rel
                packed, taken = _packed(leaf, name, persistent, wrapper is not None, unit, device, canonical, offset)
                if wrapper is None:
                    by_id[id(t)] = packed
                unit.tensors.append(packed)
                offset += taken
    unit.nbytes = align(offset)
    return unit


def _packed(
    t: torch.Tensor,
    rel: str,
    persistent: bool,
    inside: bool,
    unit: Unit,
    device: torch.device,
    canonical: bool,
    offset: int,
) -> tuple[PackedTensor, int]:
    """Plain tensor ``t`` (``rel`` in ``unit``) placed from ``offset`` on, and the bytes of its `room`."""
    origin = Placement.native(t)
    placement = _placement_on(device, canonical, t, origin, f"{unit.name}.{rel}" if unit.index >= 0 else rel)
    packed = PackedTensor(
        tensor=t,
        names=[rel],
        offset=offset + placement.alignment_class,
        nbytes=span_nbytes(t.shape, placement.stride, t.element_size()),
        shape=t.shape,
        stride=placement.stride,
        dtype=t.dtype,
        origin_device=t.device,
        origin=origin,
        persistent=persistent,
        inside=inside,
    )
    return packed, room(packed.nbytes, t.element_size(), placement, device)


def _placement_on(device: torch.device, canonical: bool, t: torch.Tensor, origin: Placement, name: str) -> Placement:
    """Where ``t`` (natively at ``origin``) sits in its unit's buffers for computing on ``device``: its own
    placement when it is there already, else that of ``t.to(device)``; canonical when asked."""
    if canonical:
        placement = Placement.canonical(t)
    elif t.device == device:
        placement = origin.on(device)
    else:
        placement = Placement.moved(t)
    if placement.stride != origin.stride and repeats_beyond_expansion(t.shape, origin.stride):
        where = "shared memory" if canonical else str(device)
        raise FlexTensorError(
            f"{name!r} has strides {origin.stride} under which elements share memory: it cannot be copied to "
            f"{where} and back bit-exact; make it contiguous before offloading "
            "(tensor.data = tensor.data.contiguous()) or exclude its module"
        )
    return placement


# --------------------------------------------------------------------------------------------- packing


def unpin_unit(unit: Unit) -> None:
    """Undo `pin_unit`'s in-place registration (a pinned copy is simply dropped with its buffer)."""
    if unit.pinned_in_place:
        assert unit.buffer is not None
        unpin_in_place(unit.buffer)
        unit.pinned_in_place = False


def pack_unit(unit: Unit, host: torch.Tensor | None = None, filled: bool = False) -> None:
    """Copy the unit's tensors into one flat host buffer and make them views of it.

    The originals are freed once every tensor is copied and re-pointed (when nothing else holds them): host
    memory holds this unit twice while it is packed, no longer. ``host`` is a
    buffer to use instead of a new one (shared memory); ``filled``: it already holds this unit's
    bytes (another process packed them), so the tensors are only pointed at it.
    """
    stored: HostBytes = InRam(host_buffer(unit.nbytes)) if host is None else InSharedMemory(host)
    host = stored.flat
    if not filled:
        copy_into(unit, host)
    for packed in unit.tensors:
        view = packed.view_of(host)
        if packed.tensor.device.type == "meta":  # ``.data`` cannot leave the meta device; swap in place
            new = nn.Parameter(view, packed.tensor.requires_grad) if isinstance(packed.tensor, nn.Parameter) else view
            torch.utils.swap_tensors(packed.tensor, new)
        else:
            packed.tensor.data = view
    unit.stored = stored


def copy_into(unit: Unit, host: torch.Tensor) -> None:
    """Copy the values of the unit's tensors into their places in ``host`` (a flat buffer laid out for the
    unit), leaving the tensors where they are."""
    for packed in unit.tensors:
        copy_tensor_into(packed, host)


def copy_tensor_into(packed: PackedTensor, host: torch.Tensor) -> None:
    """Copy the tensor's values into its place in ``host``: element by element where its layout there is
    dense; else (gaps, repeats: then it kept its native strides) the bytes of its storage span as they are."""
    with torch._C.DisableTorchFunctionSubclass():  # a subclass with bytes of its own is copied as plain bytes
        source = packed.tensor.data.as_subclass(torch.Tensor)
    if is_dense(packed.shape, packed.stride):
        packed.view_of(host).copy_(source)
        return
    storage = torch.empty(0, dtype=torch.uint8, device=source.device).set_(source.untyped_storage())
    start = source.storage_offset() * source.element_size()
    host[packed.offset : packed.offset + packed.nbytes].copy_(storage[start : start + packed.nbytes])


def pin_unit(unit: Unit, attached: bool = False) -> None:
    """Page-lock a packed unit's host buffer, in place where CUDA allows, else as a pinned copy.

    Only page-locked memory copies to the GPU asynchronously and at full PCIe speed. ``attached``:
    the buffer holds weights another process packed (shared memory), so a private copy would
    defeat the sharing.
    """
    buffer = unit.buffer
    assert buffer is not None
    if pin_in_place(buffer):
        unit.pinned_in_place = True
    elif attached:
        raise FlexTensorError("cudaHostRegister failed on the shared weights: they cannot be pinned in place")
    else:
        unit.stored = InRam(buffer.pin_memory())  # a copy of its own, even of shared weights
        unit.bind(unit.stored.flat)


def restore_unit(unit: Unit) -> None:
    """Give every tensor its own storage again, on the device it came from, with the strides and the
    alignment class it had there when it was packed, bit-exact.

    Tensors of a model built on the meta device (attached to shared weights) come back on the CPU.

    All new tensors are allocated before any is assigned, so a failure (out of memory) leaves the
    unit exactly as it was: still packed and streamable.
    """
    assert unit.host is not None
    fresh = [_restored(packed, unit.host) for packed in unit.tensors]
    with torch._C.DisableTorchFunctionSubclass():
        for packed, t in zip(unit.tensors, fresh, strict=True):
            packed.tensor.data = t
    if unit.reads_refused:
        refuse_reads((packed.tensor for packed in unit.tensors), False)
        unit.reads_refused = False
    for wrapper in unit.wrappers:
        wrapper.follow(wrapper.origin_device)
    unpin_unit(unit)
    unit.stored = None


def _restored(packed: PackedTensor, flat: Flat) -> torch.Tensor:
    """A copy of ``packed``'s values from ``flat`` in new storage, placed as it was on its origin device: the
    bytes of its span when its strides there are those it has in ``flat``, else element by element."""
    device = packed.origin_device if packed.origin_device.type != "meta" else torch.device("cpu")
    origin = packed.origin
    nbytes = span_nbytes(packed.shape, origin.stride, packed.dtype.itemsize)
    span = aligned_buffer(nbytes, device, origin.alignment_class)
    restored = span.view(packed.dtype).as_strided(packed.shape, origin.stride)
    if origin.stride == packed.stride:
        span.copy_(flat[packed.offset : packed.offset + packed.nbytes])
        return restored
    target, source = restored, packed.view_of(flat)
    for dim, (size, step) in enumerate(zip(packed.shape, origin.stride, strict=True)):
        if step == 0 and size > 1:  # an expanded dimension: its elements are one, written once
            target, source = target.narrow(dim, 0, 1), source.narrow(dim, 0, 1)
    target.copy_(source)
    return restored
