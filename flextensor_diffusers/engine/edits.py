"""Edits of an offloaded model's weights: they land in the host copies, the weights' truth, and every copy
made from those follows.

Two ways in. **Explicitly**, inside `Edits.editing` (``handle.editing()``; diffusers' ``fuse_lora``,
``load_state_dict`` and LoRA methods are wrapped in it): the model is released, every tensor views its host copy
while the edit runs, a tensor whose ``.data`` the edit replaced is copied into its host buffer (one whose shape or
dtype changed is put back and the edit refused), and the compressed copies are made again. An edit may also take
packed tensors out of the model (`Edits._settle_taken_out`): one whose name now holds another tensor of its
shape and dtype (``load_state_dict(assign=True)``) takes that tensor's values and its place back, so it keeps
streaming; any other (an adapter packed at set-up, then unloaded or deleted; a tensor replaced by one of another
shape) is the model's no more, and its bytes stay unread in the host copy. **Found afterwards**: an in-place
write made anywhere else is found by the `Binding`'s version counts and reported to `Edits.found`, which makes
the copies that predate it (a slot loaded ahead, the compressed copy, the spill file) follow.

Edits nest: peft's ``load_lora_adapter`` injects the adapter's layers (on the meta device with
``low_cpu_mem_usage``) and then calls the model's ``load_state_dict``, both wrapped. An edit inside another is part
of it: the copies follow once, when the outermost one ends.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..storage.host_bytes import DecodedPayload, InPayloadsOnly
from ..storage.host_copies import HostCopies
from .binding import Binding
from .device_copies import DeviceCopies
from .errors import FlexTensorError, OffloadStateError
from .load_checks import LoadChecks
from .units import PackedTensor, Unit

logger = logging.getLogger(__name__)


class Edits:
    """Runs explicit edits and makes the copies follow edits found in place."""

    def __init__(self, host: HostCopies, device: DeviceCopies, binding: Binding) -> None:
        self.host = host
        self.device = device
        self.binding = binding
        #: With ``verify_loads``: told of every edit, so that the fingerprints of edited units are taken again.
        self.load_checks: LoadChecks | None = None
        self._open = False  # an edit is under way: one inside it is part of it

    def found(self, unit: Unit, on_device: bool) -> None:
        """An in-place edit of ``unit`` was found; its host copy holds it now (copied back when it was made in
        a device copy: a unit kept as payloads only was decoded into RAM for it, and its payload is made again). What
        was copied from the host copy before is stale. One made where a unit kept as payloads only has no bytes (its
        tensors refuse reads and writes there, so only code that bypasses that can) reached nothing: refused."""
        if not on_device and isinstance(unit.stored, InPayloadsOnly):
            self.binding.accept(unit)
            raise OffloadStateError(
                f"an in-place write to {unit.name!r} outside its call reached no bytes (its weights are kept as their "
                "compressed copy only) and was not applied: make edits inside handle.editing()"
            )
        if unit.index >= 0:
            logger.info("%s was edited in place outside editing(); its copies follow", unit.name)
        self.host.edited(unit)
        self.device.stale_copies_of(unit, on_device)
        if self.load_checks is not None:
            self.load_checks.forget(unit)
        self._payloads_made_again([unit])

    @contextmanager
    def editing(self) -> Iterator[None]:
        """Run an edit of the weights so that it lands in the host copies (see the module docstring). The
        caller activates the model again afterwards."""
        if self._open:  # inside another edit, which makes the copies follow when it ends
            yield
            return
        self._open = True
        try:
            with self._outermost():
                yield
        finally:
            self._open = False

    @contextmanager
    def _outermost(self) -> Iterator[None]:
        self.device.release()
        if self.device.cuda:  # no copy issued before may still be reading a host buffer the edit writes
            torch.cuda.synchronize(self.device.device)
        self.host.gate_all()  # the edit lands in the final host copies, not in stand-ins about to be replaced
        self.host.mark_spill_stale()  # the RAM copies may change: the next spill writes them
        self.host.compressed.cancel_arrival("an edit of the weights")  # payloads still being read: of the old ones
        self.host.form.decode_all(f"an edit of {type(self.device.model).__name__}")  # payloads only: raw bytes to edit
        with torch.no_grad(), torch.inference_mode(False):
            for t, _ in self.device.unpacked.find_foreign():  # adapters come to the host too: one device for the edit
                if t.device.type not in ("cpu", "meta"):  # meta: no bytes yet, the edit gives them
                    t.data = t.data.to("cpu")
        try:
            yield
        finally:
            with torch.no_grad(), torch.inference_mode(False):
                self._settle_taken_out()
                self._adopt_replaced()
                self._drop_quantized_taken_out()
            self.host.form.edit_ended()  # compressed only: edited raw bytes leave copy-on-write pages
            if self.host.encoded:  # the compressed copies must say what the edited host copies say
                self.host.compressed.make(self.host.compressed.pinned, at_set_up=False)
            self.binding.record()  # every copy was made again from the edited host copies
            if self.load_checks is not None:
                self.load_checks.forget()
            self._payloads_made_again(None)

    def _payloads_made_again(self, units: list[Unit] | None) -> None:
        """The payloads of ``units`` (None: all) were made again from their host copies (their fingerprints
        forgotten): those decoded into RAM for the edit (payloads only) give ``verify_loads`` their fingerprints now,
        while their bytes are at hand, and go back to their payloads alone (`HostForm.close_decoded`)."""
        for unit in self.host.units if units is None else units:
            if self.load_checks is not None and isinstance(unit.stored, DecodedPayload):
                self.load_checks.note_packed(unit, unit.stored.tensor)
        self.host.form.close_decoded(units)

    def _adopt_replaced(self) -> None:
        refused: list[str] = []
        for unit in self.host.positions:
            if unit.host is None:
                continue
            for packed in unit.tensors:
                view = packed.view_of(unit.host)
                current = packed.tensor.data
                if current.data_ptr() == view.data_ptr():
                    continue
                if current.shape != packed.shape or current.dtype != packed.dtype:
                    refused.append(f"{unit.name}.{packed.names[0]}")
                    packed.tensor.data = view  # back as it was
                    continue
                view.copy_(current)
                packed.tensor.data = view
            refused.extend(unit.adopt_replaced_subclasses())  # quantized weights swapped for alike ones
        if refused:
            raise FlexTensorError(
                f"an edit changed the shape or dtype of streamed weights ({', '.join(refused[:3])}); they were put "
                "back as they were. Disable offload, make the edit, and enable it again"
            )

    def _drop_quantized_taken_out(self) -> None:
        """Quantized weights still out of the model once alike replacements were adopted (`_adopt_replaced`): the
        edit took them out (their module replaced), so their leaves' bytes stay unread, as a dropped tensor's."""
        present = {id(t) for t in [*self.device.model.parameters(), *self.device.model.buffers()]}
        for unit in self.host.positions:
            for wrapper in unit.wrappers if unit.host is not None else ():
                if id(wrapper.tensor) not in present:
                    self.device.dropped.add(id(wrapper.tensor))

    def _settle_taken_out(self) -> None:
        """Packed tensors the edit took out of the model: each takes back the place of a newcomer of its shape and
        dtype under one of its names, with the newcomer's values, or is dropped (see the module docstring)."""
        model = self.device.model
        named = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
        uses = Counter(id(t) for t in named.values())
        for unit in self.host.positions:
            if unit.host is None:
                continue
            for packed in unit.tensors:
                if packed.inside or id(packed.tensor) in uses or id(packed.tensor) in self.device.dropped:
                    continue  # leaves of a quantized weight are held by it, never by the model
                names = [f"{unit.name}.{rel}" if unit.index >= 0 else rel for rel in packed.names]
                newcomers = {name: named[name] for name in names if name in named}
                distinct = {id(t): t for t in newcomers.values()}  # tied names given one tensor stay tied
                elsewhere = any(uses[i] > len(newcomers) for i in distinct)  # tied to a name not ours: stays so
                if len(distinct) != 1 or elsewhere or not _fits(packed, *distinct.values()):
                    self.device.dropped.add(id(packed.tensor))
                    continue
                packed.view_of(self.host.host_of(unit)).copy_(*distinct.values())
                for name in newcomers:
                    _put_back(model, name, packed.tensor)


def _fits(packed: PackedTensor, newcomer: torch.Tensor) -> bool:
    """``newcomer`` can live in ``packed``'s place in the host copy: same shape and dtype, a plain tensor."""
    plain = type(newcomer) in (torch.Tensor, torch.nn.Parameter) and newcomer.device.type != "meta"
    return plain and newcomer.shape == packed.shape and newcomer.dtype == packed.dtype


def _put_back(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Make ``tensor`` the model's parameter or buffer ``name`` again, in place of the one an edit put there."""
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if leaf in owner._parameters:
        owner._parameters[leaf] = tensor
    else:
        owner._buffers[leaf] = tensor
