"""Exceptions raised by the engine.

Every error names the fix in its message, so that a user who reads only the last line of a
traceback knows what to change.
"""

from __future__ import annotations

import torch


class FlexTensorError(RuntimeError):
    """Base class of every error this package raises on purpose."""


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its class name when it has none): what a one-line error quotes of
    the fault under it."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


class PatternError(FlexTensorError, ValueError):
    """An include pattern matched no module, or matched the whole model."""


class BudgetError(FlexTensorError, ValueError):
    """The GPU budget cannot hold what streaming needs at minimum.

    ``required_bytes``, when known, is the smallest workable budget (for a pipeline: the largest
    of its components' minimums, since every component gets the whole budget), so that a command
    line can name the value of its own flag instead of the Python parameter.
    """

    def __init__(self, message: str, required_bytes: int | None = None) -> None:
        super().__init__(message)
        self.required_bytes = required_bytes


class HostBudgetError(BudgetError):
    """The host-memory budget cannot hold the largest component; ``required_bytes`` is the least that can."""


class MeasuringOutOfMemoryError(BudgetError, torch.OutOfMemoryError):
    """The GPU ran out of memory during a measuring (discovery or profiling) forward, before the planner had
    the activation peak it checks the budget against: the workload's activations do not fit beside the
    weights outside units and two slots. Both a `BudgetError` (it names the fix) and a
    ``torch.OutOfMemoryError`` (what it is: code that catches out-of-memory keeps working)."""


class UnsupportedTensorError(FlexTensorError, TypeError):
    """A weight's representation (a tensor subclass) cannot be streamed bit-exact: refused at set-up, naming the
    parameter and the fix (`engine.subclasses`)."""


class ProfileMismatchError(FlexTensorError):
    """A saved profile was recorded for another model, device, dtype or workload."""


class OffloadStateError(FlexTensorError):
    """The module is already offloaded, or the handle was already removed."""


class InferenceOnlyError(FlexTensorError):
    """Autograd would need the streamed weights; streaming is for inference only."""


class NoCudaDeviceError(FlexTensorError):
    """A CUDA device was asked for but none is visible."""
