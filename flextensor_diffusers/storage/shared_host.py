"""One host copy of the weights for every process on a host (ranks of one job, or replicas).

Each process streams to its own GPU, but the packed unit buffers they stream from can be the
same pages: the creating process (local rank 0) packs every unit into a file on a RAM-backed
filesystem (``/dev/shm``), mapped shared; the other processes map the same files and point their
tensors at them without copying. Their model may be built on the meta device, so it never holds
weights of its own. Every process page-locks its own mapping (``cudaHostRegister`` is per
process; the physical pages are shared), so host RAM holds the weights once, not N times.

Protocol: the creator writes ``manifest.json`` last, after every unit is filled, so a process
that attaches either finds complete weights for the same model or a clear error. Use
`offload_shared` under ``torch.distributed``: it orders creator, barrier, followers.

The processes are this user's: the folder is made 0700 by the creator and refused by every process when it is a
link, another user's or writable by others (``/dev/shm`` is writable by all); its files are new, 0600, never made
nor opened through a link (`private_files`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from ..engine.errors import FlexTensorError
from .host_memory import shared_file_buffer
from .private_files import (
    SHARED_FOLDER,
    check_private_folder,
    create_new,
    open_own_file,
    private_folder,
    temporary_name,
)

MANIFEST = "manifest.json"


class SharedHostMemory:
    """Unit buffers as shared files under ``root/flextensor-<namespace>/``, one per unit."""

    def __init__(self, namespace: str, create: bool, root: str | Path = "/dev/shm") -> None:
        if not namespace or "/" in namespace:
            raise FlexTensorError(f"shared host memory needs a plain, non-empty namespace, got {namespace!r}")
        self.namespace = namespace
        self.create = create
        self.dir = Path(root) / f"flextensor-{namespace}"
        self._sizes: dict[int, int] = {}
        self._owns_files = False  # set once this creator has made the folder: only then does it delete it

    def open(self, fingerprint: str, sizes: dict[int, int]) -> None:
        """Creator: start an empty segment set. Follower: check the creator's is complete and the same model."""
        self._sizes = dict(sizes)
        manifest = self.dir / MANIFEST
        if self.create:
            if manifest.exists():
                raise FlexTensorError(
                    f"shared weights {self.dir} already exist: another job uses namespace {self.namespace!r} "
                    "(pick another) or a crashed one left them (delete the folder)"
                )
            self.dir.parent.mkdir(parents=True, exist_ok=True)
            needed, free = sum(sizes.values()), shutil.disk_usage(self.dir.parent).free
            if needed > free:  # writing past a full tmpfs kills the process (SIGBUS) instead of raising
                raise FlexTensorError(
                    f"shared weights need {needed / 2**30:.2f} GiB in {self.dir.parent}, which has "
                    f"{free / 2**30:.2f} GiB free: enlarge it (e.g. docker --shm-size) or pick another root"
                )
            private_folder(self.dir, SHARED_FOLDER)
            self._owns_files = True
            return
        if not manifest.exists():
            raise FlexTensorError(
                f"no shared weights at {self.dir}: the process with create=True must finish offload() first "
                "(offload_shared() waits for it with torch.distributed.barrier())"
            )
        check_private_folder(self.dir, SHARED_FOLDER)
        with open(open_own_file(manifest), "rb") as file:
            theirs = json.loads(file.read())
        if theirs["fingerprint"] != fingerprint or {int(k): v for k, v in theirs["sizes"].items()} != self._sizes:
            raise FlexTensorError(
                f"the shared weights at {self.dir} were packed from another model or unit selection "
                f"(digest {theirs['fingerprint'][:12]}, this model {fingerprint[:12]}): use the same model, "
                "patterns and dtype in every process"
            )

    def buffer(self, index: int) -> torch.Tensor:
        """The flat uint8 buffer of unit ``index`` (-1: the base), mapped shared."""
        path = self.dir / f"unit{index + 1}.bin"
        if not self.create and path.stat().st_size != self._sizes[index]:
            raise FlexTensorError(f"{path} is not {self._sizes[index]} bytes: the shared weights are incomplete")
        # a lock on it cannot outlive the mapping
        return shared_file_buffer(path, self._sizes[index], create=self.create)

    def publish(self, fingerprint: str) -> None:
        """Creator: every unit is filled; followers may attach."""
        tmp = temporary_name(self.dir / MANIFEST)
        with open(tmp, "w", opener=create_new) as file:
            file.write(json.dumps({"fingerprint": fingerprint, "sizes": self._sizes, "pid": os.getpid()}))
        tmp.replace(self.dir / MANIFEST)

    def unlink(self) -> None:
        """Creator: delete the files. Mappings stay valid in every process until it drops its tensors."""
        if self._owns_files:
            shutil.rmtree(self.dir, ignore_errors=True)
            self._owns_files = False
