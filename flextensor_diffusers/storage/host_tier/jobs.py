"""Making a read job of a component waiting on disk, and telling when a read's bytes may no longer be its own.

Shared by the read back and the read ahead: a read ahead becomes the read back when its component becomes
active, so both must read the same way from the same place.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from ..disk_reads import HowToRead, ReadJob, read_order
from ..weight_files import WeightSource

if TYPE_CHECKING:
    from ...engine import OffloadHandle


def how_to_read(source: WeightSource | None, current: bool) -> HowToRead:
    """Straight from the weight files when they still hold the component's bytes (``current``: no
    edit through ``editing`` since it moved out; and no direct write into the views its tensors
    point at), else by copying from those views."""
    if source is None:
        return HowToRead(None, False)
    written = not source.views_unwritten()
    return HowToRead(source.read_into if current and not written else None, written)


def read_job(name: str, handle: OffloadHandle, source: WeightSource | None, pin: bool) -> ReadJob:
    """A read of ``name``'s units (on disk now), in the order it will need them; nothing allowed yet. How to
    read is decided on the reader thread (`how_to_read` reads ``/proc/self/smaps``: no main-thread time), with
    whether an edit came since it moved out as it is now."""
    host_copies = handle.host
    plan = functools.partial(how_to_read, source, host_copies.spill_is_current)
    return ReadJob(name, host_copies, read_order(handle), plan, pin)


def is_stale(job: ReadJob, source: WeightSource | None) -> bool:
    """A read ahead whose bytes may no longer be the component's: an edit since it began (the edit is in
    the stand-ins), a direct write into the weight-file views it did not read from, or a failure."""
    if job.error is not None or not job.host_copies.spill_is_current:
        return True
    how = job.how
    if how is None or how.read is None or source is None:
        return False
    return not source.views_unwritten()
