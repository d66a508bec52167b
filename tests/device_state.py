"""A CUDA device state of a test's own: what earlier tests left behind in the process is given back first.

On CUDA a budget bounds the whole process's peak, so whatever is still allocated when a test measures its smallest
budget (`tests.models.measured_smallest`) counts as that test's activations: tensors of earlier tests kept alive
only by reference cycles (a handle and its phases, an exception's traceback and the frames it holds), and cuBLAS
workspaces, which torch allocates per cuBLAS handle and stream (each thread has its own handles) and keeps for the
process's life (32 MiB each on Hopper). After an earlier test those can double the smallest budget of a small
model, which then keeps all its units resident where the test expects them streamed (issue 46: five refusals of
`test_promises` "DID NOT RAISE" after other tests on an H100, and were refused when run alone)."""

from __future__ import annotations

import gc

import torch

import flextensor_diffusers as ft


def settle_cuda() -> None:
    """Collect garbage, give back the cuBLAS workspaces and the allocator's cached blocks, and start the process's
    peak over (`flextensor_diffusers.reset_peak_memory_stats`). Nothing on the CPU."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    gc.collect()
    torch.cuda.synchronize()
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # torch's own tests use it
    if clear_workspaces is not None:
        clear_workspaces()
    torch.cuda.empty_cache()
    ft.reset_peak_memory_stats()
