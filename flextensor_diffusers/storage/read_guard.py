"""Weights that have no raw bytes between their unit's calls, and every read of them refused.

A unit kept as *payloads only* (``raw_copies="none"``, the default under a host budget with compression for units
no weight file holds) has no raw host copy at all: its lossless payload is its host copy, and a load decodes it on
the device. Between its calls its parameters and buffers must still be tensors of the right shape, dtype and device
(diffusers reads a model's dtype and device from its parameters; the engine re-points them with ``.data``), but
there are no bytes for them to show. So they view `NoRawBytes`, a stand-in whose slices are of one buffer that is
never written nor read (its pages are never made), and their class is swapped for a subclass of their own
(`ReadRefusedParameter`, `ReadRefusedTensor`) whose ``__torch_function__`` answers metadata (`METADATA`: shape,
dtype, device, ``requires_grad``, ``detach``, ...) and refuses everything else with `WeightReadRefused`, one line
naming the fix: a read of a weight outside its unit's call is refused, never given zeros.

Changing ``__class__`` touches no storage and no autograd state: ``.data`` re-pointing, version counters, ``id``,
tied names and ``isinstance(p, nn.Parameter)`` stay as they were. `Unit.bind` swaps the classes when it points a
unit at a `NoRawBytes` and swaps them back when it points it at real bytes (a device copy for a call, the bytes an
edit, ``state_dict()`` or removal decodes), so the engine's own reads never meet the refusal. Only plain tensors
are swapped (`eligible`); a unit with a tensor subclass keeps its raw bytes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch import nn
from torch.overrides import resolve_name

from .host_memory import host_buffer

_CPU = torch.device("cpu")

#: What a refused tensor still answers: its metadata, and what keeps it in containers (no byte is read).
METADATA: frozenset[Callable[..., Any]] = frozenset(
    {
        torch.Tensor.shape.__get__,
        torch.Tensor.dtype.__get__,
        torch.Tensor.device.__get__,
        torch.Tensor.layout.__get__,
        torch.Tensor.ndim.__get__,
        torch.Tensor.requires_grad.__get__,
        torch.Tensor.is_leaf.__get__,
        torch.Tensor.grad.__get__,
        torch.Tensor.grad_fn.__get__,
        torch.Tensor.is_cuda.__get__,
        torch.Tensor.is_cpu.__get__,
        torch.Tensor.is_meta.__get__,
        torch.Tensor.is_sparse.__get__,
        torch.Tensor.is_quantized.__get__,
        torch.Tensor.itemsize.__get__,
        torch.Tensor.nbytes.__get__,
        torch.Tensor._version.__get__,
        torch.Tensor.__len__,
        torch.Tensor.__hash__,
        torch.Tensor.size,
        torch.Tensor.dim,
        torch.Tensor.numel,
        torch.Tensor.nelement,
        torch.Tensor.element_size,
        torch.Tensor.stride,
        torch.Tensor.is_contiguous,
        torch.Tensor.is_floating_point,
        torch.Tensor.is_complex,
        torch.Tensor.get_device,
        torch.Tensor.requires_grad_,
        torch.Tensor.detach,
        torch.is_floating_point,
        torch.is_complex,
        torch.numel,
    }
)


class WeightReadRefused(RuntimeError):
    """A weight of a unit kept as payloads only was read outside the unit's call (see the module docstring)."""


def _refuse_reads(cls: type, func: Callable[..., Any], types: tuple, args: tuple = (), kwargs: Any = None) -> Any:
    """``__torch_function__`` of the refused classes: metadata answered (a tensor result refused as well), anything
    else refused with one line naming the fix."""
    if func in METADATA:
        return torch.Tensor.__torch_function__.__func__(cls, func, types, args, kwargs or {})  # type: ignore[attr-defined]
    raise WeightReadRefused(
        f"{resolve_name(func) or repr(func)} read a weight outside its unit's call, and the weights of that unit have "
        "no raw bytes between calls (a host budget with compression keeps their compressed copy only): read them "
        "through state_dict(), change them inside handle.editing() (load_state_dict and the LoRA methods do), or pass "
        "raw_copies='disk' (--raw-copies disk) to keep a raw copy in a cache file"
    )


class ReadRefusedParameter(nn.Parameter):
    """An ``nn.Parameter`` whose reads are refused (`_refuse_reads`); only ever made by swapping ``__class__``."""

    __torch_function__: ClassVar[Any] = classmethod(_refuse_reads)


class ReadRefusedTensor(torch.Tensor):
    """A buffer whose reads are refused (`_refuse_reads`); only ever made by swapping ``__class__``."""

    __torch_function__: ClassVar[Any] = classmethod(_refuse_reads)


#: Each plain class and its refused counterpart, both ways.
_REFUSED: dict[type, type] = {nn.Parameter: ReadRefusedParameter, torch.Tensor: ReadRefusedTensor}
_PLAIN: dict[type, type] = {refused: plain for plain, refused in _REFUSED.items()}
#: The classes a tensor may have while its reads are refused: the engine treats them as plain (`subclasses`).
REFUSED_TYPES = tuple(_PLAIN)


def eligible(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every one of ``tensors`` is a plain ``nn.Parameter`` or ``torch.Tensor`` (or already refused), whose
    class can be swapped back and forth."""
    return all(type(t) in _REFUSED or type(t) in _PLAIN for t in tensors)


def refuse_reads(tensors: Iterable[torch.Tensor], refused: bool) -> None:
    """Swap each of ``tensors`` to its refused class (``refused``) or back to its plain one."""
    swap = _REFUSED if refused else _PLAIN
    for tensor in tensors:
        cls = swap.get(type(tensor))
        if cls is not None:
            tensor.__class__ = cls


class _NeverRead:
    """The one buffer every `NoRawBytes` slices: as large as the largest unit asked for, never written nor read, so
    no page of it is ever made (a larger one replaces it when needed; views of the old one keep it alive)."""

    def __init__(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._lock = threading.Lock()

    def at_least(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            if self._buffer.numel() < nbytes:  # an anonymous mapping of its own: untouched, it takes no RAM
                self._buffer = host_buffer(max(nbytes, 2 * self._buffer.numel()))
            return self._buffer


_NEVER_READ = _NeverRead()


class NoRawBytes:
    """Stands in for the flat host buffer of a unit kept as payloads only (``nbytes`` long): sliced at a tensor's
    range (`PackedTensor.view_of`) it gives a `ReadRefusedTensor` of the never-read buffer, whose bytes nobody
    reads: the engine slices it only to re-point tensors (`Unit.bind`, which then refuses their reads), and any other
    read of it is refused too."""

    device = _CPU

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def __getitem__(self, key: slice) -> torch.Tensor:
        return _NEVER_READ.at_least(self.nbytes)[: self.nbytes][key].as_subclass(ReadRefusedTensor)
