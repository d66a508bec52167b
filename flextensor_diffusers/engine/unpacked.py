"""`UnpackedTensors`: the tensors of an offloaded model that have no host copy, and the check that the packed
ones are still the model's.

*Loose* tensors share storage with another tensor, so set-up could not pack them apart; *foreign* ones were added
after set-up (LoRA adapters). Neither streams: each follows the model with ``.to()``, to the device when it is
activated and back to where it came from when it is released, so that it is always on the device the model
computes on. Packed tensors an edit took out of the model (an adapter unloaded) are *dropped*: the model's no more,
so their absence is not a swap to refuse.
"""

from __future__ import annotations

import torch
from torch import nn

from ..storage.host_copies import HostCopies
from .errors import OffloadStateError


class UnpackedTensors:
    """``model``'s loose and foreign tensors, moved with ``.to()``; the packed tensors' identities, checked."""

    def __init__(self, model: nn.Module, loose: list[torch.Tensor], host: HostCopies, device: torch.device) -> None:
        self.model = model
        self.host = host
        self.device = device
        #: (tensor, device it came from) for tensors moved with ``.to()`` instead of packed.
        self.loose: list[tuple[torch.Tensor, torch.device]] = [(t, t.device) for t in loose]
        self._packed_ids = {id(t) for u in host.positions for _, t in u.held()} | {id(t) for t, _ in self.loose}
        self.foreign: list[tuple[torch.Tensor, torch.device]] = []
        #: Packed tensors an edit inside ``editing()`` took out of the model (an adapter unloaded) (`Edits`).
        self.dropped: set[int] = set()

    def to_device(self) -> None:
        """Loose tensors, and the foreign ones found now, onto the device (under ``no_grad``, by the caller)."""
        self.foreign = self.find_foreign()
        for t, _ in [*self.loose, *self.foreign]:
            t.data = t.data.to(self.device)

    def to_origin(self) -> None:
        """Loose and foreign tensors back to the device each came from (under ``no_grad``, by the caller)."""
        for t, origin in [*self.loose, *self.foreign]:
            t.data = t.data.to(origin)

    def restore_loose(self) -> None:
        """Removal: loose tensors back where they came from."""
        with torch.no_grad(), torch.inference_mode(False):
            for t, origin in self.loose:
                t.data = t.data.to(origin)

    def find_foreign(self) -> list[tuple[torch.Tensor, torch.device]]:
        """Tensors added to the model after set-up (adapters), with the device they are on when inactive."""
        found = {}
        for t in [*self.model.parameters(), *self.model.buffers()]:
            if id(t) not in self._packed_ids and id(t) not in found:
                found[id(t)] = (t, t.device if t.device != self.device else torch.device("cpu"))
        return list(found.values())

    def check_tensors_are_ours(self) -> None:
        """Refuse to go on when a packed tensor is no longer in the model: it was swapped for another object
        (in-place quantization, ``module.weight = nn.Parameter(...)``) outside ``editing()``, so its new value
        would never reach the device. Identity, not names: adapters re-wrap layers."""
        present = {id(t) for t in [*self.model.parameters(), *self.model.buffers()]}
        for unit in self.host.positions:
            if not self.host.offloaded(unit):
                continue
            for rel, t in unit.held():
                if id(t) not in present and id(t) not in self.dropped:
                    name = f"{unit.name}.{rel}" if unit.index >= 0 else rel
                    raise OffloadStateError(
                        f"{name!r} was replaced by another tensor while offloaded, so its new value would "
                        "never reach the device: make such edits inside handle.editing() (pipelines: the "
                        "LoRA/state-dict methods do it for you), or disable offload, edit, and enable again"
                    )
