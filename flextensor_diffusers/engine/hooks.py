"""`HandleHooks`: what whoever offloads a model (a pipeline) is told by its handle, given once, at construction.

A handle on its own needs none of them. A pipeline offloads several components under one budget and must hear of
four moments: a component about to take device memory (the others give theirs back first), a forward beginning
(its host tier may hand a component's RAM over during its last forward before a switch), a workload call about
to begin (any component over budget refuses every component's call), and units about to be encoded between forwards
(its host tier makes room for their payloads). Each is a callable the handle calls, or
None; the handle reads them and never changes them, so what a handle does is fixed when it is made (not by
attributes set on it afterwards).

The hooks are generic in the handle they are called with, so that this module need not import the handle.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from .errors import BudgetError
from .units import Unit

#: Told that a unit made its last call of a forward, with an event that completes once that call is done on the
#: device (None on the CPU, where it is done already): see `HandleHooks.on_forward`.
UnitDone = Callable[[Unit, "torch.cuda.Event | None"], None]

HandleT = TypeVar("HandleT")


@dataclass(frozen=True)
class HandleHooks(Generic[HandleT]):
    """The handle's extension points (each None: not asked).

    Attributes:
        on_activate: called with the handle before it takes device memory (a pipeline releases the others).
        on_forward: called with the handle as each forward begins, and whether it follows a plan; what it returns
            for one that does, when not None, is told of each unit whose last call of that forward is done
            (`UnitDone`): a pipeline's host tier hands the RAM of a component's compressed copies over to the next
            component during its last forward before a switch.
        budget_refusal: asked as each workload call begins; an error it returns is raised instead of running the
            call. A pipeline refuses every component's calls once any of them is over budget, naming the smallest
            budget for them all. None: the handle refuses its own calls while it is over budget.
        encoding_room: called with the handle before units are encoded between its forwards; the context it returns
            gives how many of the units left may be encoded in that gap (None: no bound), holding the host RAM they
            take until it exits. A pipeline's host tier makes room for them within its host budget
            (`HostTier.encoding_room`). None: no bound.
    """

    on_activate: Callable[[HandleT], None] | None = None
    on_forward: Callable[[HandleT, bool], UnitDone | None] | None = None
    budget_refusal: Callable[[], BudgetError | None] | None = None
    encoding_room: Callable[[HandleT], AbstractContextManager[int | None]] | None = None
