"""A host-memory budget for a pipeline: components whose host copies do not fit in RAM wait on disk.

A diffusers pipeline runs its components one after the other (Wan2.2: the text encoder once, the
high-noise expert for the first steps, the low-noise expert after the boundary, the VAE), and
only the active component needs its weights in host RAM, to stream them to the GPU. So the host
copies of the components that are not running can wait on disk: `HostTier` keeps as many
components in (pinned) RAM as ``host_budget`` allows; before a component on disk becomes active it
moves the least recently used ones out until the component fits, and reads it back.

Where a component waits:

* **its own weight files** when it was loaded with ``from_pretrained`` from a local folder and every
  packed tensor's bytes are in the folder's ``*.safetensors`` files, unconverted (`weight_files`):
  moving it out writes nothing, its tensors become views of private copy-on-write mappings of
  those files, and reading it back is large ``preadv`` reads. The files are stamped when offload is
  enabled; a changed file is refused before it is read. An edit made since (``load_state_dict``, a
  LoRA) means the files no longer hold its bytes: from the next move out on, it waits in a cache file.
* **a cache file** in ``cache_dir`` otherwise, written when it first moves out and kept, unwritten
  again, until an edit.

A component on disk becomes active at once and is read back unit by unit while it computes
(`read_back`); while one runs, the ones expected after it are read ahead as far as the budget allows
(`read_ahead`).

The host budget bounds the process's anonymous and page-locked memory (RssAnon + RssShmem), not only
the host copies: what the process holds besides them comes off the top (`host_budget.HostOverhead`),
and the host copies get the rest, ``weights_budget``. The host copies' share counts what the package
allocates for host copies (page-locked or not), what is read back and what is read ahead (reserved
before it is read, so the share holds at all times); mappings of files are file-backed pages the kernel
may drop at any time. Not bounded: an edit made while a component waits in its weight files (anonymous
copy-on-write pages until it is read back), what the process allocates after enabling beyond the
reserve, and on the CPU device the "device" copies (bounded by the GPU budget).

The parts, each owning one thing; `HostTier` wires them and holds the one lock around their state:

* `placement.Placement`: where each component's host copies are (RAM, its weight files, a cache file),
  what RAM they hold against the budget, and which move out to make room (least recently active first).
* `read_back.ReadBack`: the active component's read back, its units adopted through its gate, and the
  `records.Switch` that records it.
* `read_ahead.ReadAheads`: the reads of the components expected next (`order.ComponentOrder`).
* `hand_over.HandOver`: an expert's payloads let go during its last forward, into the next one's read ahead.
* `pool_room.PoolRoom`: the locked pool (`storage.locked_pool`: payload buffers handed on from the units let go to
  the units read, with no driver call) held to the budget.
* `forecast`: what each switch from disk is expected to wait, and the warning of a slow one.
* `report`: the tier's report and its lines in the offload report.

Everything logs under this package's logger (its modules' loggers are children of it), so one logger
configures (or captures) all of the host tier's messages.

Not built yet: streaming single blocks from disk for a component larger than the host budget,
O_DIRECT / GPUDirect Storage (kvikio) reads, and finding the weight files of a pipeline loaded from
a hub id (only local folders are looked up).
"""

from ..weight_files import pipeline_folder
from .forecast import SwitchForecast
from .order import offload_order
from .placement import kept_in_ram_bytes
from .report import format_host_tier
from .tier import HostTier

__all__ = [
    "HostTier",
    "SwitchForecast",
    "format_host_tier",
    "kept_in_ram_bytes",
    "offload_order",
    "pipeline_folder",
]
