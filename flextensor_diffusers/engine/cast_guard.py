"""`CastGuard`: a cast or a move of an offloaded model (``model.to(dtype)``, ``.half()``, ``.cuda()``) refused at once.

Between calls an offloaded model's tensors view its host copies, and each call binds them to device copies made
from those. ``Module._apply``, under every cast and move, gives each parameter new data that nothing copies from:
the next call binds the old bytes again and the cast is undone without a word (a buffer swapped for another object
is refused at the next call, but a parameter's new data is not seen). So the offloaded model's own ``_apply`` is
guarded while it is offloaded: a call that would change a tensor is refused before any tensor changes, naming the
fix; one that changes none (diffusers' LoRA loading calls ``text_encoder.to(device=its device, dtype=its dtype)``)
changes nothing and returns the model. Only the model's root is guarded: diffusers' layerwise casting casts its leaf
layers with ``.to()`` inside every call, and the engine keeps those calls bitwise (`binding`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .errors import OffloadStateError

#: The name of the method the guard stands in for on the model (an instance attribute shadows the class's).
GUARDED = "_apply"


class CastGuard:
    """Guards ``model``'s ``_apply`` from `install` until `remove` (an instance attribute shadowing the method)."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._installed = False

    def install(self) -> None:
        model = self._model
        name = type(model).__name__

        def guarded_apply(fn: Callable[[torch.Tensor], Any], recurse: bool = True) -> nn.Module:
            for tensor in [*model.parameters(), *model.buffers()]:
                if fn(tensor) is not tensor:
                    raise OffloadStateError(
                        f"{name}.to() (or .half(), .float(), .cuda() and the like) would cast or move the weights of "
                        "an offloaded model, and its next call would load the old ones: disable offload "
                        "(disable_flextensor_offload(), or handle.remove()), cast or move, then enable it again"
                    )
            return model  # every tensor already as asked: nothing to change

        object.__setattr__(model, GUARDED, guarded_apply)
        self._installed = True

    def remove(self) -> None:
        if self._installed:
            vars(self._model).pop(GUARDED, None)
            self._installed = False
