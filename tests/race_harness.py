"""A stress harness for the host tier's threads on the CPU (issue 48: one GPU run of the compressed host tier gave
latents that were not bitwise, every payload read back having passed its CRC-32 check).

Under a host budget with compression, four kinds of thread touch the payloads: the model's thread (gates, takes,
loads, switches), the reader threads (a payload read from the payload file into a buffer the locked pool lends, in
pieces on several threads, then checked against its CRC-32), the hand-over's thread (a payload let go once the event
of its unit's last call completed, its buffer given back to the pool) and the payload file's background write.
`install_delays` puts a seeded delay at each place where one of them hands something to another (`Delays`: 21
sites), with a short GIL switch interval, so that a run explores other interleavings than the machine's natural
one; `install_ledger` checks two things at once:

* **Content.** Every buffer given back to the pool, or adopted by it, is overwritten with a poison pattern at once,
  and every payload a load copies to the device is compared with its CRC-32 taken at enable: a buffer read after it
  was given back, or refilled under a payload still kept, shows as a mismatch (and as latents that differ).
* **GPU asynchrony** (`BufferLedger`). On the CPU a payload's copy to the device is synchronous; on a GPU it runs on
  the copy stream some time after the model's thread issued it, and the host learns it is done only by waiting for
  an event recorded after the call that computed with it (the hand-over's thread) or by synchronising the device.
  The ledger records each such copy (the payload's host buffer, the unit it loads), the call that consumed it, and
  each event recorded and waited for (the hand-over's events are `ModelEvent`s: the CPU path passes none and lets
  go at once, so without them the hand-over's thread would not run), and the payload file's write while it reads
  the payloads; it reports every buffer given back to the pool, adopted, lent to a new read or unmapped while such
  a read of it may still be under way.

`run` drives the tiny Wan2.2 pipeline (saved and loaded from its folder, both experts taking turns on disk under
the smallest host budget that runs) through a few generations of a `Scenario` and compares the latents with
native, bitwise. The committed test (`tests/test_host_tier_races.py`) runs a few; a longer soak:

    python -m tests.race_harness --seeds 0-199 --generations 3 [--always-last] [--event-ms 30] [--layers 8]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import random
import sys
import tempfile
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import flextensor_diffusers as ft
from flextensor_diffusers.engine.device_copies import DeviceCopies
from flextensor_diffusers.storage import disk_reads, file_reads, host_memory, payload_cache
from flextensor_diffusers.storage.disk_reads import FillGate, ReadHooks, ReadJob
from flextensor_diffusers.storage.host_copies import HostCopies
from flextensor_diffusers.storage.host_tier import HostTier
from flextensor_diffusers.storage.host_tier.hand_over import HandOver, LastForwardForecast
from flextensor_diffusers.storage.host_tier.read_back import ReadBack
from flextensor_diffusers.storage.locked_pool import LockedPool
from flextensor_diffusers.storage.payload_cache import BackgroundWrite, PayloadCache
from flextensor_diffusers.storage.payload_records import PayloadLocks
from flextensor_diffusers.storage.waiting_payloads import WaitingPayloads

#: What a buffer given back to the pool is filled with (no payload byte pattern the codec makes from random weights).
POISON = 0xA5


class Delays:
    """Seeded delays by site: the n-th delay at a site depends only on the seed, the site and n, whatever thread asks
    and in whatever order, so a seed replays the same delays (the interleaving still depends on the machine)."""

    def __init__(self, seed: int, most_s: float, share: float = 0.5, long_share: float = 0.05) -> None:
        self.seed = seed
        self.most_s = most_s
        self.share = share
        self.long_share = long_share  # of the delays, those up to `LONG` times longer (a forward's length)
        self.event_most_s = most_s  # the hand-over's events: a GPU's may complete a forward or more later
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()

    #: How much longer a long delay may be.
    LONG = 20

    def __call__(self, site: str, most_s: float | None = None) -> None:
        """A delay at ``site``: up to ``most_s`` (default: the harness's), for a share of the calls."""
        with self._lock:
            n = self.counts.get(site, 0)
            self.counts[site] = n + 1
        rng = random.Random(f"{self.seed}:{site}:{n}")
        most = self.most_s if most_s is None else most_s
        if most > 0 and rng.random() < self.share:
            most *= self.LONG if rng.random() < self.long_share else 1
            time.sleep(rng.uniform(0, most))


@dataclass
class DeviceRead:
    """A read of host bytes ``[start, end)`` that may still be under way: a copy of ``unit``'s payload (a model's key
    and a unit index) to the device, issued at tick ``issued`` and consumed by the call that began at ``consumed``
    (None: no call yet), or the payload file's write (``by``), until it ends; ``done`` once the host knows it is over.
    ``kind``: the buffer's (lent by the pool, a buffer of its own, other)."""

    start: int
    end: int
    unit: tuple[int, int]
    issued: int
    by: str = "a copy to the device"
    kind: str = ""
    consumed: int | None = None
    done: bool = False


def buffer_kind(address: int) -> str:
    if address in host_memory.lent_by_pool:
        return "lent by the pool"
    return "a buffer of its own" if address in host_memory._mappings else "a file's mapping or torch's"


@dataclass
class BufferLedger:
    """The GPU's asynchronous payload copies, modelled on the CPU (see the module docstring), and the payload file's
    write, which reads payloads on a thread of its own. Ticks order what the threads do; an event recorded at tick
    ``t`` covers the copies consumed by calls that began before ``t`` (a call waits for its load's *ready* event,
    and the event is recorded after the call); waiting for it tells the host they are done, and so does
    synchronising the device (every copy issued). ``hazards`` lists every buffer given back, adopted, lent or
    unmapped while a read of it was not known to be over; ``mismatches`` every load of a payload whose bytes were
    not those it had at enable (``crcs``)."""

    reads: list[DeviceRead] = field(default_factory=list)
    hazards: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    crcs: dict[tuple[int, int], int] = field(default_factory=dict)  # each payload's CRC-32 at enable
    copies: int = 0
    _tick: int = 0
    _lock: threading.RLock = field(default_factory=threading.RLock)  # a buffer's finalizer may run inside

    def _next(self) -> int:
        self._tick += 1
        return self._tick

    def copy_issued(self, unit: tuple[int, int], payload: torch.Tensor) -> None:
        """The model's thread enqueues a copy of ``payload`` (``unit``'s) to the device; its bytes are checked."""
        start = payload.data_ptr()
        crc = zlib.crc32(memoryview(payload.numpy())) if payload.numel() else 0
        with self._lock:
            self.copies += 1
            self.reads.append(DeviceRead(start, start + payload.numel(), unit, self._next(), kind=buffer_kind(start)))
            if unit in self.crcs and crc != self.crcs[unit]:
                self.mismatches.append(f"unit {unit[1]} of model {unit[0]:#x}: its payload's bytes differ at a load")

    def host_reads(self, by: str, payloads: dict[int, torch.Tensor]) -> list[DeviceRead]:
        """A thread reads ``payloads`` (by unit index) until `host_reads_ended`."""
        with self._lock:
            began = self._next()
            reads = [
                DeviceRead(p.data_ptr(), p.data_ptr() + p.numel(), (0, i), began, by, buffer_kind(p.data_ptr()), began)
                for i, p in payloads.items()
            ]
            self.reads.extend(reads)
            return reads

    def host_reads_ended(self, reads: list[DeviceRead]) -> None:
        with self._lock:
            for read in reads:
                read.done = True
            self._prune()

    def call_began(self, unit: tuple[int, int]) -> None:
        """A call of ``unit`` begins: it consumes every copy of its payload not consumed yet."""
        with self._lock:
            now = self._next()
            for read in self.reads:
                if read.unit == unit and read.consumed is None:
                    read.consumed = now

    def event_recorded(self) -> int:
        with self._lock:
            return self._next()

    def event_waited(self, recorded: int) -> None:
        """The host waited for an event recorded at tick ``recorded``."""
        with self._lock:
            for read in self.reads:
                if read.by == DeviceRead.by and read.consumed is not None and read.consumed < recorded:
                    read.done = True
            self._prune()

    def device_synchronized(self) -> None:
        with self._lock:
            for read in self.reads:
                read.done = read.done or read.by == DeviceRead.by
            self._prune()

    def _prune(self) -> None:
        self.reads = [read for read in self.reads if not read.done]

    def buffer_released(self, buffer: torch.Tensor, what: str) -> None:
        """``buffer`` goes to the pool (``what``) or to a new read: no read of its bytes may still be under way."""
        self.range_released(buffer.data_ptr(), buffer.data_ptr() + buffer.numel(), what)

    def range_released(self, start: int, end: int, what: str) -> None:
        """Host bytes ``[start, end)`` given back, adopted, lent or unmapped (`buffer_released`)."""
        with self._lock:
            for read in [r for r in self.reads if not r.done and r.start < end and start < r.end]:
                if read.by != DeviceRead.by:
                    when = "still under way"
                else:
                    when = "not consumed by a call yet" if read.consumed is None else "its call's event not waited for"
                self.hazards.append(f"{what}: {read.by} of unit {read.unit[1]}'s payload ({read.kind}), {when}")
                read.done = True  # told once
            self._prune()


class ModelEvent:
    """The event of a unit's last call given to the hand-over, as on a GPU (the CPU path gives none): recorded now,
    done at once on the device; its ``synchronize`` (on the hand-over's thread) takes a seeded delay, then tells the
    ledger. ``held``, when given, is waited for first (a test holds every event)."""

    def __init__(self, ledger: BufferLedger, delays: Delays, held: threading.Event | None = None) -> None:
        self.ledger = ledger
        self.delays = delays
        self.held = held
        self.recorded = ledger.event_recorded()

    def synchronize(self) -> None:
        if self.held is not None:
            self.held.wait()
        self.delays("event.synchronize", self.delays.event_most_s)
        self.ledger.event_waited(self.recorded)


def unit_key(host: HostCopies, index: int) -> tuple[int, int]:
    return id(host), index


def _around(
    monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, before: Callable[..., None] | None = None, after=None
) -> None:
    """Wrap ``owner.name`` (a method or a module function): ``before(*args, **kwargs)`` first, then
    ``after(result, *args, **kwargs)``."""
    real = getattr(owner, name)

    @functools.wraps(real)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if before is not None:
            before(*args, **kwargs)
        result = real(*args, **kwargs)
        if after is not None:
            after(result, *args, **kwargs)
        return result

    monkeypatch.setattr(owner, name, wrapped)


def delay_at(delays: Delays, site: str) -> Callable[..., None]:
    return lambda *_, **__: delays(site)


class DelayedReads(ReadHooks):
    """Reader threads: a delay before and after each unit's read, and at every change of a job."""

    def __init__(self, delays: Delays) -> None:
        self.delays = delays

    def read(self, job: ReadJob, position: int, read: Callable[[], Any]) -> Any:
        self.delays("reader.before_unit")
        unit = read()
        self.delays("reader.after_unit")  # checked against its CRC-32, not delivered yet
        return unit

    def changed(self, job: ReadJob) -> None:
        self.delays("reader.changed")


def install_delays(monkeypatch: pytest.MonkeyPatch, delays: Delays) -> None:
    """A delay at each hand-off between the host tier's threads (see the module docstring)."""
    monkeypatch.setattr(disk_reads, "read_hooks", DelayedReads(delays))
    monkeypatch.setattr(disk_reads, "READ_THREADS", 8)  # as on a 16-core GPU host: pieces on 8 threads at once
    # reader threads: a buffer lent and not yet filled (`install_ledger`), each piece, a payload filled and not yet
    # checked, checked and not yet delivered
    monkeypatch.setattr(file_reads, "MIN_PIECE_BYTES", 4096)  # tiny payloads in several pieces, on several threads
    monkeypatch.setattr(file_reads, "PIECE_ALIGN", 4096)
    _around(monkeypatch, file_reads, "read_spans", delay_at(delays, "reader.piece"))
    _around(monkeypatch, PayloadCache, "read_payload", delay_at(delays, "reader.before_fill"))
    _around(monkeypatch, payload_cache, "crc32_of", delay_at(delays, "reader.before_crc"))  # the write's sums too
    _around(monkeypatch, ReadJob, "_landed", delay_at(delays, "reader.landed"))
    # the model's thread: the gates, adoption, switches, hand-overs
    _around(monkeypatch, FillGate, "__call__", delay_at(delays, "main.fill_gate"))
    _around(monkeypatch, ReadBack, "_arrive", delay_at(delays, "main.arrive"))
    _around(monkeypatch, WaitingPayloads, "take", delay_at(delays, "main.take"), delay_at(delays, "main.taken"))
    _around(monkeypatch, HostTier, "bring_in", delay_at(delays, "main.bring_in"))
    _around(monkeypatch, HostTier, "hand_over", delay_at(delays, "main.hand_over"))
    _around(monkeypatch, HandOver, "gate", delay_at(delays, "main.hand_over_gate"))
    # the hand-over's thread: before a payload is let go (its buffer given back)
    _around(monkeypatch, HandOver, "_let_go", delay_at(delays, "hand_over.let_go"))
    # the background write: before its file is taken as written (its beginning and end: `install_ledger`)
    _around(monkeypatch, BackgroundWrite, "held", delay_at(delays, "write.waited"))


def install_ledger(
    monkeypatch: pytest.MonkeyPatch, ledger: BufferLedger, delays: Delays, held: threading.Event | None = None
) -> None:
    """The ledger's view of the engine, the pool and the payload file's write (see `BufferLedger`), and the poison of
    buffers given back. As on a GPU, the payloads made at set-up count as page-locked in place, so that the pool
    adopts them when they leave RAM (`tests.test_locked_pool.adopt_payloads_made_at_set_up`); every host buffer
    unmapped is checked too."""
    from tests.test_locked_pool import adopt_payloads_made_at_set_up

    def copy_issued(encoded: Any, host: HostCopies, unit: Any, **_: Any) -> None:
        ledger.copy_issued(unit_key(host, unit.index), encoded.payload)

    _around(monkeypatch, HostCopies, "payload_of", after=copy_issued)  # a load copies what this returns
    _around(
        monkeypatch, DeviceCopies, "bind_for_call", after=lambda _, c, i, **__: ledger.call_began(unit_key(c.host, i))
    )
    real_unit_done = HandOver.unit_done
    monkeypatch.setattr(
        HandOver, "unit_done", lambda self, unit, event: real_unit_done(self, unit, ModelEvent(ledger, delays, held))
    )

    def unlocking(locks: PayloadLocks, payloads: list[torch.Tensor], copies_done: bool = False, **_: Any) -> None:
        ids = {id(p) for p in payloads}
        if not copies_done and any(id(p) in ids for p in locks._in_place):
            ledger.device_synchronized()  # `PayloadLocks.unlock` synchronises the device here on a GPU

    _around(monkeypatch, PayloadLocks, "unlock", before=unlocking)

    def giving_back(pool: LockedPool, view: torch.Tensor, **_: Any) -> None:
        lent = pool._lent.get(view.data_ptr())
        whole = view if lent is None else lent.whole
        ledger.buffer_released(whole, "a buffer given back to the locked pool")
        whole.fill_(POISON)
        delays("pool.give_back")

    _around(monkeypatch, LockedPool, "give_back", before=giving_back)

    def keeping(pool: LockedPool, payload: torch.Tensor, **_: Any) -> None:
        if not pool.lends(payload) and host_memory.locked_in_place(payload):  # adopted as an idle buffer
            ledger.buffer_released(payload, "a payload adopted by the locked pool")
            payload.fill_(POISON)

    _around(monkeypatch, LockedPool, "keep", before=keeping)

    def lent(result: tuple[torch.Tensor, bool], pool: LockedPool, nbytes: int, *_: Any, **__: Any) -> None:
        ledger.buffer_released(result[0], "a buffer lent to a new read")
        delays("reader.lent")  # had, not filled yet

    _around(monkeypatch, LockedPool, "take", after=lent)
    adopt_payloads_made_at_set_up(monkeypatch)

    def mapped(buffer: torch.Tensor, region: Any, nbytes: int, alignment: int) -> None:
        start = buffer.data_ptr()
        if nbytes:
            gone = weakref.finalize(
                host_memory._mappings[start], ledger.range_released, start, start + nbytes, "unmapped"
            )
            gone.atexit = False

    _around(monkeypatch, host_memory, "_owned_view", after=mapped)
    real_write = PayloadCache.write

    def write(cache: PayloadCache, encoded: dict[int, Any], *args: Any, **kwargs: Any) -> bool:
        reads = ledger.host_reads("the payload file's write", {i: e.payload for i, e in encoded.items()})
        try:
            delays("write.begin")
            return real_write(cache, encoded, *args, **kwargs)
        finally:
            delays("write.end")
            ledger.host_reads_ended(reads)

    monkeypatch.setattr(PayloadCache, "write", write)


@dataclass
class Scenario:
    """One run of the harness: the delays' ``seed`` and longest delay (``most_s``; ``event_most_s`` for the
    hand-over's events, a GPU's may complete a forward or more later), ``generations`` compared with native, a
    forecast that calls every forward an expert's last (``always_last``: units let go are taken back, events
    overtaken by newer tellings), events ``held`` until the generations are over, ``change`` to the code (a
    positive control: a fault the harness must see), and the GIL's switch interval."""

    seed: int
    generations: int = 2
    most_s: float = 0.002
    event_most_s: float | None = None
    always_last: bool = False
    held: threading.Event | None = None
    change: Callable[[pytest.MonkeyPatch], None] | None = None
    switch_interval_s: float = 1e-4


@dataclass
class RunResult:
    """What one scenario's generations gave: each one's latents equal to native's (or its error), what the ledger
    found, and how much of the host tier's threads' work ran."""

    seed: int
    bitwise: list[bool]
    errors: list[str]
    hazards: list[str]
    mismatches: list[str]
    copies: int
    let_go_units: int
    taken_back_units: int
    reads_from_disk: int
    pool_reused: int
    delays: dict[str, int]

    @property
    def clean(self) -> bool:
        return all(self.bitwise) and not self.errors and not self.hazards and not self.mismatches

    def line(self) -> str:
        return (
            f"seed {self.seed}: {'clean' if self.clean else 'NOT CLEAN'} bitwise={self.bitwise} "
            f"hazards={len(self.hazards)} mismatches={len(self.mismatches)} errors={len(self.errors)} "
            f"loads={self.copies} let_go={self.let_go_units} taken_back={self.taken_back_units} "
            f"disk_reads={self.reads_from_disk} pool_reused={self.pool_reused} delays={sum(self.delays.values())}"
        )


def payload_crcs(pipe: Any, ledger: BufferLedger) -> None:
    """Each payload's CRC-32 now (those on disk through their file's mapping): what every load must copy."""
    for handle in ft.pipeline_offload(pipe).handles.values():
        for index, encoded in handle.host.encoded.items():
            ledger.crcs[unit_key(handle.host, index)] = zlib.crc32(memoryview(encoded.payload.numpy()))


@contextlib.contextmanager
def switching_every(seconds: float) -> Iterator[None]:
    """The GIL's switch interval set to ``seconds``: shorter than its 5 ms, the threads interleave at more points."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Torch's kernels on one thread: its worker threads spinning beside the tier's threads (and other processes)
    made a run several times slower on 2 cores. A reference to compare with is computed the same way."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run(folder: Path, reference: torch.Tensor, cache: Path, host_budget: int, scenario: Scenario) -> RunResult:
    """The tiny pipeline loaded from ``folder``, offloaded with compression under ``host_budget`` (one expert in RAM
    at a time: `tests.test_compressed_tier.smallest_host_budget`) with a new ``cache`` (set-up encodes and writes
    the payload file in the background), the delays and the ledger installed: ``scenario``'s generations compared
    with ``reference`` (computed in `one_torch_thread`), bitwise."""
    from tests.models import set_host_overhead, wan_latents
    from tests.test_compressed_tier import BUDGET
    from tests.test_host_tier import load

    delays, ledger = Delays(scenario.seed, scenario.most_s), BufferLedger()
    if scenario.event_most_s is not None:
        delays.event_most_s = scenario.event_most_s
    bitwise, errors = [], []
    with pytest.MonkeyPatch.context() as patch, switching_every(scenario.switch_interval_s), one_torch_thread():
        set_host_overhead(patch, own=0, reserve=0)
        pipe = load(folder)
        install_delays(patch, delays)
        install_ledger(patch, ledger, delays, scenario.held)
        if scenario.always_last:
            patch.setattr(LastForwardForecast, "is_last", lambda self, name: True)
        if scenario.change is not None:
            scenario.change(patch)
        enable = dict(budget=BUDGET, device="cpu", compression="lossless", host_budget=host_budget, cache_dir=cache)
        pipe.enable_flextensor_offload(**enable)
        payload_crcs(pipe, ledger)
        for _ in range(scenario.generations):
            try:
                bitwise.append(torch.equal(wan_latents(pipe), reference))
            except Exception as exc:  # a poisoned payload may not even decode
                bitwise.append(False)
                errors.append(f"{type(exc).__name__}: {exc}")
        if scenario.held is not None:
            scenario.held.set()
        tier = ft.pipeline_offload(pipe).host_tier.report()
        pipe.disable_flextensor_offload()
    hand_overs = tier["hand_overs"]
    return RunResult(
        scenario.seed,
        bitwise,
        errors,
        ledger.hazards,
        ledger.mismatches,
        ledger.copies,
        sum(h["let_go_units"] for h in hand_overs),
        sum(h["taken_back_units"] for h in hand_overs),
        len(tier["disk_reads_s"]),
        tier["locked_pool"]["reused"],
        dict(delays.counts),
    )


def _seeds(text: str) -> list[int]:
    first, _, last = text.partition("-")
    return list(range(int(first), int(last or first) + 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0-19", help="a seed or a range, e.g. 0-199")
    parser.add_argument("--generations", type=int, default=3)
    parser.add_argument("--most-ms", type=float, default=2.0, help="the longest delay at a site")
    parser.add_argument("--event-ms", type=float, default=None, help="the longest delay of a hand-over's event")
    parser.add_argument("--always-last", action="store_true", help="every forward forecast as an expert's last")
    parser.add_argument("--switch-ms", type=float, default=0.1, help="the GIL's switch interval (Python's: 5)")
    parser.add_argument("--layers", type=int, default=0, help="blocks per expert (0: the tiny config's)")
    args = parser.parse_args()
    from tests.models import set_host_overhead, wan_latents
    from tests.test_compressed_tier import smallest_host_budget
    from tests.test_host_tier import load, save

    work = Path(tempfile.mkdtemp(prefix="race_harness_"))
    folder = save(work / "wan22", "200KB", {"num_layers": args.layers} if args.layers else None)
    with one_torch_thread():
        reference = wan_latents(load(folder))
    with pytest.MonkeyPatch.context() as patch:
        set_host_overhead(patch, own=0, reserve=0)
        host_budget = smallest_host_budget(load(folder), work / "probe")
    seeds, bad, started = _seeds(args.seeds), 0, time.perf_counter()
    event_s = None if args.event_ms is None else args.event_ms / 1e3
    for seed in seeds:
        scenario = Scenario(
            seed,
            args.generations,
            args.most_ms / 1e3,
            event_s,
            args.always_last,
            switch_interval_s=args.switch_ms / 1e3,
        )
        result = run(folder, reference, work / f"cache{seed}", host_budget, scenario)
        bad += not result.clean
        print(result.line(), flush=True)
        for line in [*result.errors, *result.hazards, *result.mismatches][:5]:
            print("   ", line, flush=True)
    print(f"{bad} of {len(seeds)} seeds not clean, {time.perf_counter() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
