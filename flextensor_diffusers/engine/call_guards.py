"""Calls of streamed units that could not stay bitwise native, refused at the first one with the fix.

A streamed unit computes in a slot that the next unit loaded into it overwrites. So it may not be differentiated
through (backward would read the overwritten weights), return a view of its own weights (the view would change),
or call another unit while it runs (that unit's load could overwrite it). Each is found at the call that would
go wrong, before anything is wrong.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from .config import format_bytes
from .errors import FlexTensorError, InferenceOnlyError, MeasuringOutOfMemoryError


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors of a call's arguments or output: the value itself, or the items of a tuple, list or dict."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def nested_call_error(inner: str, outer: str) -> FlexTensorError:
    return FlexTensorError(
        f"unit {inner!r} was called inside unit {outer!r}, which holds it through a plain reference, not as a "
        f"submodule: loading {inner!r} could overwrite the weights {outer!r} is computing with. Stream only one "
        f"of them: exclude_patterns=[{inner!r}] (or [{outer!r}])"
    )


def refuse_autograd(name: str, grads: list[nn.Parameter], streamed: bool, args: tuple, kwargs: dict) -> None:
    """Called with autograd on: weights that require grad are refused; a streamed unit whose inputs require
    grad is refused too (only resident units keep the weights backward reads)."""
    if grads and any(p.requires_grad for p in grads):
        raise InferenceOnlyError(
            f"unit {name!r} has parameters that require grad and autograd is on: streamed weights "
            "are for inference only. Run under torch.no_grad() or torch.inference_mode(), or call "
            "model.requires_grad_(False)"
        )
    if streamed and any(t.requires_grad for t in tensors_in([*args, *kwargs.values()])):
        raise InferenceOnlyError(
            f"autograd records through unit {name!r} (an input requires grad), which streams through a reused "
            "GPU slot: backward would read weights another block has overwritten. Run it under torch.no_grad() or "
            f"torch.inference_mode(), or keep it on the device: exclude_patterns=[{name!r}]"
        )


def refuse_views_of(slot: torch.Tensor, name: str, output: Any) -> None:
    """A streamed unit's output must not be a view of its slot, which the next unit it holds overwrites."""
    storage = slot.untyped_storage().data_ptr()
    if any(t.untyped_storage().data_ptr() == storage for t in tensors_in(output)):
        raise FlexTensorError(
            f"unit {name!r} returned a view of its own weights or buffers, which live in a GPU slot that the "
            f"next streamed unit overwrites: keep it on the device with exclude_patterns=[{name!r}], or return "
            "a copy (.clone())"
        )


def outside_a_call_error(model: str, exc: BaseException) -> FlexTensorError:
    """What a device mismatch in a forward means here: a streamed unit's weights were used outside its call."""
    return FlexTensorError(
        f"{model} used weights of a streamed unit outside that unit's call ({exc}); between its calls a streamed "
        "unit's weights stay in host memory. Call the unit as a module (block(x), not block.forward(x)), or keep "
        "it on the device with exclude_patterns=[...]"
    )


#: The caching allocator's settings, read from the environment when CUDA starts.
ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
#: Memory the caching allocator holds reserved but unallocated when an out-of-memory is raised, from which on it is
#: fragmentation worth naming (a fixed-size cache of freed blocks is normal; a gigabyte on a small card is not).
FRAGMENTED_BYTES = 256 * 2**20


def measuring_out_of_memory_error(
    model: str, budget: int, room: int, exc: BaseException, reserved_free: int = 0
) -> MeasuringOutOfMemoryError:
    """What an out-of-memory in a measuring forward means: the activations, not yet measured, need more than
    ``room`` (the budget less the weights outside units and two slots), or the device holds less than the budget.
    Where ``reserved_free`` bytes (reserved by the caching allocator, not allocated) are many and the allocator does
    not expand its segments, the card's room was lost to fragmentation: the fix that needs no other budget is said
    first (call E of issue 47: refused under a 5 GB card with 1.46 GiB reserved but free)."""
    fix = (
        "Shrink the workload (fewer frames, smaller resolution, VAE tiling) or raise gpu_budget."
        if reserved_free < FRAGMENTED_BYTES or "expandable_segments:True" in os.environ.get(ALLOC_CONF, "")
        else f"{format_bytes(reserved_free)} were reserved but free (fragmentation): start Python with "
        f"{ALLOC_CONF}=expandable_segments:True, or shrink the workload, or raise gpu_budget."
    )
    return MeasuringOutOfMemoryError(
        f"{model}: the GPU ran out of memory while measuring this workload's first forward under gpu_budget "
        f"{format_bytes(budget)}: its activations need more than the {format_bytes(max(room, 0))} the budget leaves "
        f"beside the weights outside units and 2 slots (or the device holds less than the budget). {fix} "
        f"({(str(exc).splitlines() or [''])[0][:120]})"
    )
