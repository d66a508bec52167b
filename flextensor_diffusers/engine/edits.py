"""Edits of an offloaded model's weights: they land in the host copies, the weights' truth, and every copy
made from those follows.

Two ways in. **Explicitly**, inside `Edits.editing` (``handle.editing()``; diffusers' ``fuse_lora`` and
``load_state_dict`` are wrapped in it): the model is released, every tensor views its host copy while the edit
runs, a tensor whose ``.data`` the edit replaced is copied into its host buffer (one whose shape or dtype
changed is put back and the edit refused), and the compressed copies are made again. **Found afterwards**:
an in-place write made anywhere else is found by the `Binding`'s version counts and reported to `Edits.found`,
which makes the copies that predate it (a slot loaded ahead, the compressed copy, the spill file) follow.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from .binding import Binding
from .device_copies import DeviceCopies
from .errors import FlexTensorError
from .host_copies import HostCopies
from .load_checks import LoadChecks
from .units import Unit

logger = logging.getLogger(__name__)


class Edits:
    """Runs explicit edits and makes the copies follow edits found in place."""

    def __init__(self, host: HostCopies, device: DeviceCopies, binding: Binding) -> None:
        self.host = host
        self.device = device
        self.binding = binding
        #: With ``verify_loads``: told of every edit, so that the fingerprints of edited units are taken again.
        self.load_checks: LoadChecks | None = None

    def found(self, unit: Unit, on_device: bool) -> None:
        """An in-place edit of ``unit`` was found; its host copy holds it now (copied back when it was made in
        a device copy). What was copied from the host copy before is stale."""
        if unit.index >= 0:
            logger.info("%s was edited in place outside editing(); its copies follow", unit.name)
        self.host.edited(unit)
        self.device.stale_copies_of(unit, on_device)
        if self.load_checks is not None:
            self.load_checks.forget(unit)

    @contextmanager
    def editing(self) -> Iterator[None]:
        """Run an edit of the weights so that it lands in the host copies (see the module docstring). The
        caller activates the model again afterwards."""
        self.device.release()
        if self.device.cuda:  # no copy issued before may still be reading a host buffer the edit writes
            torch.cuda.synchronize(self.device.device)
        self.host.gate_all()  # the edit lands in the final host copies, not in stand-ins about to be replaced
        self.host.mark_spill_stale()  # the RAM copies may change: the next spill writes them
        self.host.compressed.cancel_arrival("an edit of the weights")  # payloads still being read: of the old ones
        with torch.no_grad(), torch.inference_mode(False):
            for t, _ in self.device.find_foreign():  # adapters come to the host too: one device for the edit
                t.data = t.data.to("cpu") if t.device.type != "cpu" else t.data
        try:
            yield
        finally:
            with torch.no_grad(), torch.inference_mode(False):
                self._adopt_replaced()
            if self.host.raw_homes is not None:  # compressed only: edited raw bytes leave copy-on-write pages
                self.host.raw_homes.rehome_written()
            if self.host.encoded:  # the compressed copies must say what the edited host copies say
                self.host.compressed.make(self.host.compressed.pinned, at_set_up=False)
            self.binding.record()  # every copy was made again from the edited host copies
            if self.load_checks is not None:
                self.load_checks.forget()

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
            for wrapper in unit.wrappers:  # a quantized weight's inner tensors swapped for others
                refused.extend(wrapper.adopt_replaced(f"{unit.name}.{wrapper.names[0]}"))
        if refused:
            raise FlexTensorError(
                f"an edit changed the shape or dtype of streamed weights ({', '.join(refused[:3])}); they were put "
                "back as they were. Disable offload, make the edit, and enable it again"
            )
