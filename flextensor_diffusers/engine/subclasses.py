"""Tensor subclasses (quantized weights): streamed through the plain tensors they compute from.

A weight may be a *wrapper* subclass (torchao's quantized tensors, quanto's ``QTensor``): it has no bytes of its
own and computes from inner tensors that it holds as attributes and names with ``__tensor_flatten__``; an inner
tensor may be a wrapper in turn. Or it may be a subclass with bytes of its own and some Python metadata (diffusers'
``GGUFParameter``, which holds the GGUF blocks as ``uint8``).

**Packing sees only plain leaves.** A weight is flattened, recursively, into the plain tensors at the bottom
(`flatten`), and each leaf is packed as any plain tensor is (its alignment class, its strides: `units`); a subclass
with bytes of its own is a leaf itself. Leaves are re-pointed with ``.data`` like plain tensors, so no object is
ever rebuilt while streamed: a weight keeps its identity, its type and its metadata (the ``ctx`` of
``__tensor_flatten__``, ``quant_type``), and compiled regions see the same tensors. Only a wrapper's own tensor
metadata names a device, which its leaves do not follow by themselves: when they move, `Wrapper.follow` gives it
theirs with ``.data = shell`` (a wrapper of its type and shape without inner tensors, made once per device), which
changes nothing but that metadata. ``state_dict()`` and the like get a wrapper rebuilt over the leaves' host
copies (`Wrapper.rebuilt`, through ``__tensor_unflatten__``).

**Refused** (`UnsupportedTensorError`, before anything is changed), each with the module's parameter named: a
subclass with no bytes of its own and no ``__tensor_flatten__``; a subclass that holds a tensor in an attribute
without naming it in ``__tensor_flatten__`` (its bytes would stay where they are); an inner tensor that is not a
tensor, or that is also held elsewhere (another weight, a module). Inner tensors that share storage are refused
where layouts are planned (`units`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..storage.read_guard import REFUSED_TYPES
from .errors import UnsupportedTensorError

#: Tensor types that hold their bytes themselves and carry no metadata of their own (a plain tensor's reads refused
#: between calls is one: `read_guard`).
PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter, *REFUSED_TYPES)

#: What a refusal tells the user to do: a refused weight would be packed wherever it sits (an excluded module's
#: weights are packed with the resident ones), so the fix is in the weight itself.
FIX = "dequantize it before offloading (or leave the model that holds it out of the offload)"
#: The fix for tensors that share memory: packing gives every tensor bytes of its own.
UNSHARE = "give each its own memory (tensor.data = tensor.data.clone()), or dequantize it before offloading"
#: The fix for a subclass that does not name the tensors it holds.
NAME_THEM = "name every tensor it computes from in its __tensor_flatten__ / __tensor_unflatten__, or dequantize it"


def is_plain(t: torch.Tensor) -> bool:
    return type(t) in PLAIN_TYPES


@dataclass
class Wrapper:
    """A wrapper subclass of the model (a weight, or an inner tensor of another one) and its inner tensors.

    ``inner``: its flattened attributes in ``__tensor_flatten__``'s order, each a plain leaf or a `Wrapper`.
    ``names``: the names modules hold it by, relative to its unit (none for an inner wrapper). Invariant: its
    device metadata is its leaves' device once `follow` has run after they moved (`Unit.bind`, `restore_unit`).
    """

    tensor: torch.Tensor
    inner: dict[str, torch.Tensor | Wrapper]
    origin_device: torch.device
    names: list[str] = field(default_factory=list)
    _shells: dict[torch.device, torch.Tensor] = field(default_factory=dict, repr=False)

    def leaves(self) -> Iterable[torch.Tensor]:
        for part in self.inner.values():
            yield from part.leaves() if isinstance(part, Wrapper) else (part,)

    def follow(self, device: torch.device) -> None:
        """Give the wrapper, and the wrappers inside it, the device their leaves are on now (a no-op where each
        says that device already)."""
        for part in self.inner.values():
            if isinstance(part, Wrapper):
                part.follow(device)
        if self.tensor.device != device:
            with torch._C.DisableTorchFunctionSubclass():  # the library's __torch_function__ never sees it
                self.tensor.data = self._shell(device)

    def _shell(self, device: torch.device) -> torch.Tensor:
        shell = self._shells.get(device)
        if shell is None:
            t = self.tensor
            shell = torch.Tensor._make_wrapper_subclass(  # a torch private: the constructor wrappers are made with
                type(t), t.shape, strides=t.stride(), dtype=t.dtype, layout=t.layout, device=device, requires_grad=False
            )
            self._shells[device] = shell
        return shell

    def rebuilt(self, leaf_copy: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """A new wrapper of the same type and metadata over ``leaf_copy(leaf)`` of each leaf (its host copy):
        what ``state_dict()`` gives for it."""
        inner = {
            name: part.rebuilt(leaf_copy) if isinstance(part, Wrapper) else leaf_copy(part)
            for name, part in self.inner.items()
        }
        _, ctx = self.tensor.__tensor_flatten__()
        return type(self.tensor).__tensor_unflatten__(inner, ctx, self.tensor.shape, self.tensor.stride())

    def adopt_replaced(self, name: str) -> list[str]:
        """After an edit: an inner tensor the edit replaced with another object (``weight.qdata = new``), at any
        depth, has its new values copied into the leaves this wrapper held, which are put back in place (they
        view the host copy). A replacement of another shape, dtype or structure is undone too, and its name
        (``name`` is this wrapper's) returned: the caller refuses the edit."""
        refused = []
        for attr, part in self.inner.items():
            held = part.tensor if isinstance(part, Wrapper) else part
            now = getattr(self.tensor, attr, None)
            if now is not held:
                if not copy_leaves(now, held):
                    refused.append(f"{name}.{attr}")
                setattr(self.tensor, attr, held)
            elif isinstance(part, Wrapper):
                refused.extend(part.adopt_replaced(f"{name}.{attr}"))
        return refused


def copy_leaves(source: object, target: torch.Tensor) -> bool:
    """Copy ``source``'s values into ``target``'s leaves where both are alike (`_structure`: types, metadata, leaf
    shapes and dtypes), which an edit that swapped one for the other left unchanged in meaning; else False."""
    if not isinstance(source, torch.Tensor):
        return False
    try:
        alike = _structure(source) == _structure(target)
    except (UnsupportedTensorError, TypeError, ValueError):  # a ctx that cannot be compared: not alike
        return False
    if alike:
        new, old = flatten(source, "edit").leaves, flatten(target, "edit").leaves
        with torch._C.DisableTorchFunctionSubclass():
            for (_, src), (_, dst) in zip(new, old, strict=True):
                dst.copy_(src)
    return bool(alike)


def _structure(t: torch.Tensor) -> object:
    """What must match for ``t``'s leaves to be copied into another's: its type, its ``ctx`` at every level and its
    leaves' shapes and dtypes."""
    if not is_traceable_wrapper_subclass(t):
        return (type(t), t.shape, t.dtype)
    attrs, ctx = t.__tensor_flatten__()
    return (type(t), ctx, t.shape, [(attr, _structure(getattr(t, attr))) for attr in attrs])


@dataclass(frozen=True)
class Flattened:
    """A module's tensor as packing sees it: its plain leaves by dotted path below it ('' for the tensor itself)
    and, for a wrapper, the `Wrapper` (None for a plain tensor or a subclass with bytes of its own)."""

    leaves: list[tuple[str, torch.Tensor]]
    wrapper: Wrapper | None


def flatten(t: torch.Tensor, name: str) -> Flattened:
    """``t`` (held by a module as ``name``) as plain leaves; refused with `UnsupportedTensorError` where its bytes
    cannot all be reached (see the module docstring)."""
    if is_plain(t):
        return Flattened([("", t)], None)
    if not is_traceable_wrapper_subclass(t):
        _check_own_bytes(t, name)
        return Flattened([("", t)], None)
    wrapper = _flatten_wrapper(t, name)
    leaves = []
    _collect(wrapper, "", leaves)
    ids = [id(leaf) for _, leaf in leaves]
    if len(set(ids)) != len(ids):
        raise UnsupportedTensorError(
            f"{name!r} ({type(t).__name__}) holds one inner tensor under two names: it cannot be laid out as "
            f"separate tensors; {UNSHARE}"
        )
    return Flattened(leaves, wrapper)


def _collect(wrapper: Wrapper, prefix: str, out: list[tuple[str, torch.Tensor]]) -> None:
    for attr, part in wrapper.inner.items():
        path = f"{prefix}.{attr}" if prefix else attr
        if isinstance(part, Wrapper):
            _collect(part, path, out)
        else:
            out.append((path, part))


def _flatten_wrapper(t: torch.Tensor, name: str) -> Wrapper:
    kind = type(t).__name__
    try:
        attrs, _ = t.__tensor_flatten__()
    except Exception as exc:  # a library's own code: whatever it raises, the weight is refused in one line
        raise UnsupportedTensorError(f"{name!r} ({kind}): its __tensor_flatten__ failed ({exc}); {FIX}") from exc
    if not attrs:
        raise UnsupportedTensorError(f"{name!r} ({kind}): its __tensor_flatten__ names no inner tensor; {FIX}")
    inner: dict[str, torch.Tensor | Wrapper] = {}
    for attr in attrs:
        part = getattr(t, attr, None)
        if not isinstance(part, torch.Tensor):
            raise UnsupportedTensorError(
                f"{name!r} ({kind}) names {attr!r} in __tensor_flatten__ but holds no tensor there; {FIX}"
            )
        if is_plain(part):
            inner[attr] = part
        elif is_traceable_wrapper_subclass(part):
            inner[attr] = _flatten_wrapper(part, f"{name}.{attr}")
        else:
            raise UnsupportedTensorError(
                f"{name!r} ({kind}) holds {attr!r} as a {type(part).__name__}, a subclass that is not a wrapper: "
                f"its metadata could not be kept; {FIX}"
            )
    unnamed = [key for key, value in vars(t).items() if _holds_tensor(value) and key not in inner]
    if unnamed:
        raise UnsupportedTensorError(
            f"{name!r} ({kind}) holds tensor(s) {', '.join(map(repr, unnamed))} that its __tensor_flatten__ does not "
            f"name, so they could not be streamed; {NAME_THEM}"
        )
    return Wrapper(tensor=t, inner=inner, origin_device=t.device)


def _check_own_bytes(t: torch.Tensor, name: str) -> None:
    """A subclass that is not a traceable wrapper is a leaf only when its bytes are its storage's and it holds no
    other tensor."""
    kind = type(t).__name__
    if t.device.type != "meta":
        try:
            with torch._C.DisableTorchFunctionSubclass():
                t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError) as exc:
            raise UnsupportedTensorError(
                f"{name!r} ({kind}) is a tensor subclass with no bytes of its own and no __tensor_flatten__ "
                f"naming the tensors it computes from; {NAME_THEM}"
            ) from exc
    held = [key for key, value in vars(t).items() if _holds_tensor(value)]
    if held:
        raise UnsupportedTensorError(
            f"{name!r} ({kind}) holds tensor(s) {', '.join(map(repr, held))} in attributes, which would not be "
            f"streamed; {NAME_THEM}"
        )


def _holds_tensor(value: object) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple)):
        return any(isinstance(v, torch.Tensor) for v in value)
    if isinstance(value, dict):
        return any(isinstance(v, torch.Tensor) for v in value.values())
    return False


def storage_leaves(tensors: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]:
    """The tensors that hold the bytes of ``tensors``: each one's leaves (a representation that cannot be flattened
    has none here; set-up refuses it)."""
    for t in tensors:
        try:
            yield from (leaf for _, leaf in flatten(t, "").leaves)
        except UnsupportedTensorError:
            continue


def representation(t: torch.Tensor) -> str:
    """What a saved profile must tell apart beyond a tensor's shape and dtype: '' for a plain tensor, else its type
    and its leaves' dtypes and shapes (an int8 weight computes and allocates otherwise than its bf16 original, whose
    outer shape and dtype it shows)."""
    if is_plain(t):
        return ""
    try:
        leaves = flatten(t, "").leaves
    except UnsupportedTensorError:
        return type(t).__qualname__
    return f"{type(t).__qualname__}[{','.join(f'{path}:{leaf.dtype}{tuple(leaf.shape)}' for path, leaf in leaves)}]"


def as_type_of(original: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """``view`` (a plain view of a leaf's bytes) as ``original``'s type with its metadata: for a subclass with bytes
    of its own (``GGUFParameter``), what ``state_dict()`` gives for it; ``view`` itself for a plain tensor."""
    if is_plain(original):
        return view
    rebuilt = view.as_subclass(type(original))
    rebuilt.__dict__.update({k: v for k, v in vars(original).items() if k != "_is_param"})
    return rebuilt
