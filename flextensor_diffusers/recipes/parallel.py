"""``--gpus N``: one generation split across N GPUs of this host, each rank streaming its weights.

The recipe re-launches itself under ``torchrun`` (one process per GPU). Every rank builds or
loads the pipeline, but only local rank 0 keeps real weights: the others build it on the meta
device (random weights) and attach to rank 0's packed copy in shared memory, so host RAM holds the
weights once. The transformers are split with diffusers' context parallelism (Ulysses attention
across the ranks, ``ContextParallelConfig``); each rank streams its own copy of their blocks to
its own GPU under the budget. Only rank 0 writes the video and the summary.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import torch

from ..engine.errors import FlexTensorError, NoCudaDeviceError
from .options import RecipeOptions

#: Components split by context parallelism, where the pipeline has them.
PARALLEL_COMPONENTS = ("transformer", "transformer_2")


@dataclass
class Rank:
    """Where this process stands in a ``--gpus N`` run (world size 1 when not under torchrun)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def creator(self) -> bool:
        """The process that packs the weights into shared memory (the others attach)."""
        return self.local_rank == 0


@dataclass(frozen=True)
class Placement:
    """What `set_up` decided for this process: its rank, device and how it gets its weights."""

    rank: Rank
    #: The device this rank computes on; None: the one ``--device`` names (one process).
    device: str | None = None
    #: Shared-memory namespace of the job's one host copy of the weights (None: private weights).
    shared_host: str | None = None
    #: True on ranks that build on the meta device and attach to the creator's shared copy.
    attach_to_shared: bool = False


def current() -> Rank:
    env = os.environ
    if "LOCAL_RANK" not in env:
        return Rank()
    return Rank(rank=int(env["RANK"]), local_rank=int(env["LOCAL_RANK"]), world_size=int(env["WORLD_SIZE"]))


def torchrun_command(module: str, argv: list[str], gpus: int) -> list[str]:
    """The command that runs ``python -m module argv`` once per GPU."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}"]
    return [*launcher, "-m", module, *argv]


def launch_if_needed(options: RecipeOptions, module: str, argv: list[str]) -> None:
    """With ``--gpus N > 1`` outside torchrun: check the GPUs and replace this process by torchrun."""
    if options.gpus <= 1 or "LOCAL_RANK" in os.environ:
        return
    found = torch.cuda.device_count()
    if found < options.gpus:
        raise NoCudaDeviceError(
            f"--gpus {options.gpus} needs {options.gpus} CUDA devices on this host; found {found}. "
            "Drop --gpus to run on one device (or the CPU)"
        )
    cmd = torchrun_command(module, argv, options.gpus)
    os.execv(cmd[0], cmd)


def set_up(options: RecipeOptions) -> Placement:
    """Inside torchrun: the process group, this rank's device and the shared-weights namespace."""
    me = current()
    if me.world_size == 1:
        return Placement(rank=me)
    import torch.distributed as dist

    if not torch.cuda.is_available():
        raise NoCudaDeviceError("--gpus needs CUDA devices: context parallelism runs on NCCL")
    torch.cuda.set_device(me.local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", me.local_rank))
    device = f"cuda:{me.local_rank}"
    if options.no_offload:  # natively every rank holds its own weights on its GPU
        return Placement(rank=me, device=device)
    # One namespace per job: torchrun gives every job its own run id.
    namespace = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}-{os.environ.get('MASTER_PORT', '0')}"
    return Placement(rank=me, device=device, shared_host=namespace, attach_to_shared=not me.creator)


def split_transformers(pipe: Any, me: Rank) -> list[str]:
    """Context parallelism (Ulysses over all ranks) on the pipeline's transformers; their names."""
    if me.world_size == 1:
        return []
    from diffusers import ContextParallelConfig

    split = []
    for name in PARALLEL_COMPONENTS:
        model = getattr(pipe, name, None)
        if model is None:
            continue
        if getattr(model, "_cp_plan", None) is None:
            raise FlexTensorError(
                f"{type(model).__name__} has no context-parallel plan in diffusers: run it with --gpus 1"
            )
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=me.world_size))
        split.append(name)
    return split


def finish() -> None:
    if current().world_size > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
