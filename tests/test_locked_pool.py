"""The locked pool hands page-locked buffers on from one read to the next (`storage.locked_pool`): no driver call per
read once buffers are about, each buffer lent to one owner at a time, the host budget's room respected, and no lock
left behind when the tier goes."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

import flextensor_diffusers as ft
from flextensor_diffusers.storage import disk_reads, host_memory
from flextensor_diffusers.storage.compressed_copies import CompressedCopies
from flextensor_diffusers.storage.disk_reads import HowToRead, ReadJob
from flextensor_diffusers.storage.host_memory import HUGE_PAGE
from flextensor_diffusers.storage.host_tier.pool_room import PoolRoom
from flextensor_diffusers.storage.locked_pool import LockedPool, fits, rounded
from tests.models import set_host_overhead, wan_latents
from tests.test_compressed_tier import enable_one_expert_in_ram, saved  # noqa: F401 (a fixture)
from tests.test_host_tier import load

MB = 1 << 20


class DriverCalls:
    """Stands in for ``cudaHostRegister`` and ``cudaHostUnregister``: counts them, by buffer address."""

    def __init__(self) -> None:
        self.locked: list[int] = []
        self.unlocked: list[int] = []

    def lock(self, buffer: torch.Tensor) -> bool:
        self.locked.append(buffer.data_ptr())
        return True

    def unlock(self, buffer: torch.Tensor) -> None:
        self.unlocked.append(buffer.data_ptr())


@pytest.fixture
def calls() -> DriverCalls:
    return DriverCalls()


def pool_of(calls: DriverCalls, slack_room: int = 0) -> LockedPool:
    pool = LockedPool(lock=calls.lock, unlock=calls.unlock)
    pool.allow_slack(slack_room)
    return pool


def test_a_buffer_given_back_serves_the_next_read_without_a_driver_call(calls: DriverCalls) -> None:
    """The owner gives back the usual way (``unpin_in_place``): the buffer stays locked, idle, and the next read of
    about its size gets it; one lent is never lent again before it comes back."""
    pool = pool_of(calls)
    first, lent = pool.take(40 * MB)
    assert lent and first.numel() == 40 * MB and len(calls.locked) == 1
    second, _ = pool.take(40 * MB)
    assert second.data_ptr() != first.data_ptr() and len(calls.locked) == 2  # the first is still lent
    host_memory.unpin_in_place(first)
    assert not calls.unlocked and pool.report()["idle"] == 1
    third, lent = pool.take(40 * MB - 4096)  # a little smaller: the same pages
    assert lent and third.data_ptr() == first.data_ptr() and len(calls.locked) == 2
    stats = pool.report()
    assert (stats["reused"], stats["locked"], stats["unlocked"], stats["lent"], stats["idle"]) == (1, 2, 0, 2, 0)


def test_a_read_takes_only_a_buffer_that_holds_it_and_wastes_little(calls: DriverCalls) -> None:
    """A buffer larger than the read's pages by more than a 64th of it, or too small, is not lent for it: the read
    gets a new buffer, made in the place of the idle one (freed), so that the pool holds no more than before."""
    pool = pool_of(calls, slack_room=1 << 30)
    big, _ = pool.take(64 * MB)
    host_memory.unpin_in_place(big)
    small, _ = pool.take(32 * MB)  # half the size: wasteful
    assert small.data_ptr() != big.data_ptr() and calls.unlocked == [big.data_ptr()] and pool.idle_bytes == 0
    host_memory.unpin_in_place(small)
    larger, _ = pool.take(32 * MB + HUGE_PAGE)  # does not fit the idle 32 MB
    assert larger.data_ptr() != small.data_ptr() and len(calls.locked) == 3 and len(calls.unlocked) == 2
    assert fits(64 * MB, 64 * MB - MB) and not fits(64 * MB, 60 * MB) and not fits(64 * MB, 64 * MB + 1)
    assert rounded(64 * MB + 1) == 64 * MB + HUGE_PAGE


def test_an_idle_buffer_freed_for_a_new_one_is_gone_before_the_new_one_is_made() -> None:
    """A read no idle buffer fits gets a new one in the place of idle ones: their pages must be gone before the new
    buffer is made and locked, or the process holds both for a moment: one ~0.49 GB Wan2.2 payload over, the
    likeliest cause of call S (H100) sampling 0.19 GB over its 32 GiB host budget."""
    made: list[weakref.ref] = []
    alive_when_locking: list[int] = []

    def lock(buffer: torch.Tensor) -> bool:
        alive_when_locking.append(sum(ref() is not None for ref in made))
        made.append(weakref.ref(buffer))
        return True

    pool = LockedPool(lock=lock, unlock=lambda buffer: None)
    view, _ = pool.take(32 * MB)
    host_memory.unpin_in_place(view)
    del view
    larger, _ = pool.take(64 * MB)  # the idle 32 MB buffer does not hold it: freed in its place
    assert pool.report()["unlocked"] == 1 and alive_when_locking == [0, 0]
    host_memory.unpin_in_place(larger)
    pool.close()


def test_new_buffers_take_the_largest_size_expected_only_while_the_budget_has_room(calls: DriverCalls) -> None:
    """Told of the largest read, a new buffer for a read close to it is made that large, so that any such read fits
    it later; not when the budget leaves no room for the difference (``allow_slack``)."""
    largest, smaller = 260 * MB + 512 * 1024, 257 * MB  # 262 MB of pages against 258
    pool = pool_of(calls, slack_room=0)
    pool.expect([largest, smaller, 8 * MB])
    assert pool.slack_for([smaller, largest, 8 * MB]) == rounded(largest) - rounded(smaller)
    tight, _ = pool.take(smaller)
    assert pool.report()["lent_bytes"] == rounded(smaller) and pool.slack_bytes == 0
    pool.allow_slack(64 * MB)
    roomy, _ = pool.take(smaller)
    assert pool.slack_bytes == rounded(largest) - rounded(smaller) == 4 * MB
    host_memory.unpin_in_place(roomy)
    reused, _ = pool.take(largest)  # the largest fits the buffer made for a smaller read
    assert reused.data_ptr() == roomy.data_ptr() and pool.slack_bytes == 0
    host_memory.unpin_in_place(tight)
    host_memory.unpin_in_place(reused)


def test_idle_buffers_beyond_the_room_are_unlocked_and_none_outlives_the_pool(calls: DriverCalls) -> None:
    """``trim`` frees the oldest idle buffers first, down to the room given; ``close`` frees the rest, and a buffer
    given back after that is unlocked at once: every lock made is undone."""
    pool = pool_of(calls)
    views = [pool.take(40 * MB)[0] for _ in range(3)]
    for view in views:
        host_memory.unpin_in_place(view)
    pool.trim(2 * 40 * MB)
    assert calls.unlocked == [views[0].data_ptr()] and pool.idle_bytes == 2 * 40 * MB
    still_lent, _ = pool.take(40 * MB)
    pool.close()
    assert sorted(calls.unlocked) == sorted(v.data_ptr() for v in views if v.data_ptr() != still_lent.data_ptr())
    host_memory.unpin_in_place(still_lent)
    assert sorted(calls.unlocked) == sorted(calls.locked)
    assert all(owner is not pool for owner in host_memory.lent_by_pool.values())


def test_a_payload_locked_in_place_is_adopted_and_any_other_is_left_to_its_owner(calls, monkeypatch) -> None:
    """``keep``: a payload page-locked in place over all its bytes (one made at set-up) joins the idle buffers at its
    size; a pageable one is not the pool's to keep."""
    pool = pool_of(calls)
    payload = host_memory.host_buffer(40 * MB)
    assert not pool.keep(payload)
    monkeypatch.setattr(host_memory, "locked_in_place", lambda buffer: buffer.data_ptr() == payload.data_ptr())
    assert pool.keep(payload) and pool.report()["adopted"] == 1
    view, _ = pool.take(40 * MB - 1000)
    assert view.data_ptr() == payload.data_ptr() and not calls.locked
    host_memory.unpin_in_place(view)


def adopt_payloads_made_at_set_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make this CPU run as a GPU host does at set-up: every payload kept is taken as page-locked in place (a CUDA
    set-up locks each one it makes), so that the pool adopts the payloads of a component that moves out."""
    real_make = CompressedCopies.make

    def make(self, *args, **kwargs):
        real_make(self, *args, **kwargs)
        for encoded in self.encoded.values():  # each one locked in place, as the CUDA encoder leaves it
            self.locks.mark_locked(encoded.payload)

    monkeypatch.setattr(CompressedCopies, "make", make)
    monkeypatch.setattr(host_memory, "locked_in_place", lambda buffer: True)


@pytest.mark.parametrize("adopting", [False, True], ids=["cpu", "adopting-set-up-payloads"])
def test_the_tier_hands_buffers_on_between_experts_bitwise_and_leaves_no_lock(saved, tmp_path, monkeypatch, adopting):  # noqa: F811
    """The experts take turns in RAM, each handing its payloads over during its last forward: reads reuse the
    buffers let go, three generations are bitwise, the budget holds with what the buffers hold beyond their
    payloads and the idle ones counted, and once offload is disabled every buffer the pool made is freed. Also with
    the payloads made at set-up adopted as a GPU host's are: the expert moved out at set-up must not keep its
    payloads' RAM as idle buffers beside the next one's (call P: 43.9 GB of a 34.4 GB budget)."""
    set_host_overhead(monkeypatch, own=0, reserve=0)
    if adopting:
        adopt_payloads_made_at_set_up(monkeypatch)
    folder, reference = saved
    pipe = load(folder)
    host_budget = enable_one_expert_in_ram(pipe, tmp_path / "cache")
    tier = ft.pipeline_offload(pipe).host_tier
    pool = tier.locked_pool
    assert all(torch.equal(wan_latents(pipe), reference) for _ in range(3))
    report = tier.report()
    assert report["peak_host_ram_bytes"] <= host_budget
    assert report["locked_pool"]["reused"] > 0 and report["locked_pool"]["lent"] > 0
    pipe.disable_flextensor_offload()
    assert torch.equal(wan_latents(pipe), reference)
    stats = pool.report()
    assert stats["lent"] == stats["idle"] == 0 and stats["locked"] + stats["adopted"] == stats["unlocked"]
    assert (stats["adopted"] > 0) == adopting


def test_idle_buffers_are_counted_as_held_while_a_read_holds_its_own(calls: DriverCalls, monkeypatch) -> None:
    """A unit under way holds the buffer it took (lent, counted in its read's reservation): the idle buffers counted
    as held beyond the reads (`PoolRoom.held_beyond`) are those no unit still to begin will take. Three idle
    buffers, a read of two units, the first under way: one idle buffer is the second unit's, the other is held
    beyond. Counted among the units to come, the unit under way left that buffer uncounted (0 here), in the peak
    and when making room: up to two units a read, ~1 GB for Wan2.2-A14B."""
    monkeypatch.setattr(disk_reads, "UNITS_IN_FLIGHT", 1)
    pool = pool_of(calls)
    for view in [pool.take(40 * MB)[0] for _ in range(3)]:
        host_memory.unpin_in_place(view)
    under_way, release = threading.Event(), threading.Event()

    def read_unit(
        position: int, host: object, pin: bool, read: object, pieces: object, buffered: Callable[[], None]
    ) -> SimpleNamespace:
        buffer, _ = pool.take(40 * MB, buffered)
        under_way.set()
        release.wait(timeout=30)
        return SimpleNamespace(index=position - 1, nbytes=40 * MB, host=buffer)

    host_copies = SimpleNamespace(
        spilled_hosts=lambda: [None] * 3, arrival_bytes=lambda: [0, 40 * MB, 40 * MB], read_unit=read_unit
    )
    job = ReadJob("expert", host_copies, [1, 2], lambda: HowToRead(None, False), pin=False)
    job.allow(80 * MB)
    room = PoolRoom(pool, SimpleNamespace(weights_budget=1 << 30), lambda: 0, lambda: [SimpleNamespace(job=job)])
    threads = SimpleNamespace(submit=lambda fn, *args: threading.Thread(target=fn, args=args).start())
    reader = threading.Thread(target=job.run, args=(SimpleNamespace(units=threads, pieces=None),))
    reader.start()
    assert under_way.wait(timeout=30)
    assert pool.report()["lent"] == 1 and pool.idle_bytes == 2 * 40 * MB
    assert job.unbuffered_bytes == 40 * MB and room.held_beyond(0) == 40 * MB
    release.set()
    job.wait_for(2)
    reader.join(timeout=30)
    assert job.finished and job.unbuffered_bytes == 0 and room.held_beyond(0) == pool.idle_bytes == 40 * MB


def test_a_pool_dropped_unclosed_lets_its_buffers_go_as_any_others(calls: DriverCalls) -> None:
    """A pipeline dropped with offload on drops its tier's pool unclosed: nothing keeps the pool, nor its buffers,
    alive, and a buffer it had lent is no longer routed back to it (its owner unlocks it as any other)."""
    pool = pool_of(calls)
    view, _ = pool.take(40 * MB)
    assert host_memory.lent_by_pool.get(view.data_ptr()) is pool
    owner = weakref.ref(pool)
    del pool
    gc.collect()
    assert owner() is None and view.data_ptr() not in host_memory.lent_by_pool
