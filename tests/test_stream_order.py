"""The steady schedule's stream ordering, checked on the CPU against CUDA's rules (`tests.stream_model`): no slot or
staging buffer is read and written by two streams in an order left to timing, including around the loads the
compute stream makes itself (on demand) and the calls it makes outside a planned forward.

The schedule runs here as it does on a GPU, on streams and events of the model; `FakeCopies` enqueues, for each
load, the reads and writes `DeviceCopies` enqueues (a payload into the slot's staging buffer, its decode into the
slot, or a raw copy into the slot), and each call reads its unit's slot on the compute stream. The GPU tests at
the end run the same situations on a device, with the compute stream held back so that a race would show."""

from __future__ import annotations

import pytest
import torch

import flextensor_diffusers as ft
from flextensor_diffusers.engine.device_copies import DeviceCopies
from flextensor_diffusers.engine.phases import Phase
from flextensor_diffusers.engine.planner import Call, Plan, schedule_loads
from flextensor_diffusers.engine.profiler import Clock
from flextensor_diffusers.engine.schedule import SteadySchedule, TransferTotals
from tests.stream_model import StreamModel

#: Five units through two slots, unit 1 called again at the end (as `tests.models.Stack` calls its block 1).
ORDER = [0, 1, 2, 3, 4, 1]
SLOT_OF: list[int | None] = [0, 1, 0, 1, 0]


class FakeCopies:
    """What `SteadySchedule` asks of `DeviceCopies`, enqueuing on the model's current stream the accesses the real
    loads enqueue; ``load_now`` is `DeviceCopies.load_now`'s on-demand load (counted in ``compute_loads``, as
    there)."""

    cuda = True
    device = torch.device("cuda", 0)

    def __init__(self, model: StreamModel, decoding: frozenset[int]) -> None:
        self.model = model
        self.units = list(range(len(SLOT_OF)))
        self.slot_owner: list[int | None] = [None, None]
        self.decoding = decoding
        self.compute_loads = 0

    def evict(self, slot: int | None) -> None:
        pass

    def stage(self, index: int, slot: int) -> bool:
        if index in self.decoding:
            self.model.access(f"staging {slot}", True, f"unit {index}'s payload copied in")
            return True
        self.model.access(f"slot {slot}", True, f"unit {index} copied in raw")
        return False

    def decode_staged(self, index: int, slot: int) -> None:
        self.model.access(f"staging {slot}", False, f"unit {index}'s payload decoded")
        self.model.access(f"slot {slot}", True, f"unit {index} decoded")

    def note_load(self, slot: int, index: int) -> None:
        self.slot_owner[slot] = index

    def load_now(self, index: int) -> None:
        slot = SLOT_OF[index]
        assert slot is not None
        if self.slot_owner[slot] == index:
            return
        self.compute_loads += 1
        if self.stage(index, slot):
            self.decode_staged(index, slot)
        self.note_load(slot, index)


class Harness:
    """A schedule following the plan of `ORDER` over `SLOT_OF` on the model's streams, and the calls of the engine
    around it (`calls.BoundaryCalls` and the steady phase, reduced to what they enqueue)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, decoding: frozenset[int], measure_stalls: bool) -> None:
        self.model = StreamModel()
        self.model.install(monkeypatch)
        self.copies = FakeCopies(self.model, decoding)
        loads, first = schedule_loads([Call(u, 1.0) for u in ORDER], SLOT_OF)
        plan = Plan(frozenset(), 2, 0, SLOT_OF, 0.0, 0.0, 0, 0, compressed=decoding, loads=loads, first_loads=first)
        totals = TransferTotals(unit_stall_ms=[0.0] * len(SLOT_OF))
        self.schedule = SteadySchedule(self.copies, Clock(torch.device("cpu")), measure_stalls, totals)  # type: ignore[arg-type]
        self.activate()
        self.schedule.follow(plan, ORDER)

    def activate(self) -> None:
        """New slots on the compute stream, and (as a plan with resident units fills them) a decode through
        staging buffer 0."""
        self.copies.slot_owner = [None, None]
        self.model.access("staging 0", True, "a resident unit's payload copied in")
        self.model.access("staging 0", False, "a resident unit's payload decoded")
        self.copies.compute_loads += 1

    def call(self, index: int, pos: int | None) -> None:
        """A unit call: on the plan at ``pos``, or (None) one the schedule does not follow (loaded on demand)."""
        if pos is not None:
            self.schedule.before(index)
        self.copies.load_now(index)  # `DeviceCopies.bind_for_call`: nothing when the schedule loaded it
        self.model.access(f"slot {SLOT_OF[index]}", False, f"unit {index} called")
        if pos is not None:
            self.schedule.after(index, pos)

    def forward(self, last: bool = False) -> None:
        if not self.schedule.primed:
            self.schedule.prime()
        self.schedule.last_forward = last
        for pos, index in enumerate(ORDER):
            self.call(index, pos)
        self.schedule.forward_ended()
        if last:
            self.schedule.end_last_forward()

    def assert_no_race(self) -> None:
        races = self.model.races()
        assert not races, "\n".join(f"{a!r}  /  {b!r}" for a, b in races[:5])


DECODING = {"compressed": frozenset(range(len(SLOT_OF))), "raw": frozenset(), "mixed": frozenset({0, 3})}


def test_the_model_sees_a_race_and_an_ordered_pair(monkeypatch) -> None:
    """The positive control: a write on one stream and a read on another race until the reader waits for an event
    recorded after the write; an event never recorded orders nothing."""
    model = StreamModel()
    model.install(monkeypatch)
    side = torch.cuda.Stream()
    never = torch.cuda.Event()
    model.access("slot 0", True, "written on compute")
    with torch.cuda.stream(side):
        side.wait_event(never)
        model.access("slot 0", False, "read on the side stream, unordered")
    assert len(model.races()) == 1
    done = torch.cuda.Event()
    done.record(model.compute)
    with torch.cuda.stream(side):
        side.wait_event(done)
        model.access("slot 0", False, "read on the side stream, after the event")
    assert len(model.races()) == 1


@pytest.mark.parametrize("decoding", DECODING.values(), ids=DECODING.keys())
@pytest.mark.parametrize("measure_stalls", [False, True])
def test_steady_forwards_leave_nothing_to_timing(monkeypatch, decoding: frozenset[int], measure_stalls: bool) -> None:
    """Forwards on the plan, a last forward before a switch (its next forward's loads not issued) and the next one
    primed again, and a forward after `leave`: every access ordered."""
    h = Harness(monkeypatch, decoding, measure_stalls)
    for _ in range(3):
        h.forward()
    h.forward(last=True)
    h.forward()  # the forecast was wrong: primed again
    h.schedule.leave()
    h.forward()
    h.assert_no_race()


@pytest.mark.parametrize("decoding", DECODING.values(), ids=DECODING.keys())
def test_a_unit_loaded_on_demand_before_the_schedule_primes_is_not_overwritten(monkeypatch, decoding) -> None:
    """After a last forward (not primed), a unit called on its own loads on demand on the compute stream and
    reads its slot; the next forward primes that slot with its first unit. The prime's copy and decode into the
    slot (and its staging buffer) wait for that call: no *free* event was recorded after it."""
    h = Harness(monkeypatch, decoding, False)
    h.forward()
    h.forward(last=True)
    h.call(3, None)  # slot 1 holds unit 1 now: unit 3 is loaded into it on demand
    h.forward()
    h.assert_no_race()


@pytest.mark.parametrize("decoding", DECODING.values(), ids=DECODING.keys())
def test_a_slot_reloaded_on_demand_mid_forward_is_not_overwritten_by_the_next_copy(monkeypatch, decoding) -> None:
    """An edit of a unit's host copy makes its planned load stale: `DeviceCopies.bind_for_call` loads it again, on
    the compute stream, through the slot's staging buffer. The slot's next planned copy into that staging buffer
    waits for the decode that reads it (*staged-free* is recorded on the decode stream only)."""
    h = Harness(monkeypatch, decoding, False)
    h.forward()
    for pos, index in enumerate(ORDER):
        if index != 2:
            h.call(index, pos)
            continue
        h.schedule.before(2)
        h.copies.slot_owner[0] = None  # `DeviceCopies.stale_copies_of`: the edit drops the slot's ownership
        h.call(2, None)
        h.schedule.after(2, pos)  # issues unit 4 into slot 0
    h.forward()
    h.assert_no_race()


@pytest.mark.parametrize("decoding", DECODING.values(), ids=DECODING.keys())
def test_a_call_that_raised_is_not_overwritten_by_the_next_prime(monkeypatch, decoding) -> None:
    """A unit call raised after reading its slot (its *free* event never recorded): the phase leaves the plan, and
    the next forward primes the slot again; the prime's loads wait for what that call enqueued."""
    h = Harness(monkeypatch, decoding, False)
    h.forward()
    for pos in range(4):
        h.call(ORDER[pos], pos)
    h.schedule.before(4)
    h.model.access("slot 0", False, "unit 4 called, then raised")
    h.schedule.leave()  # `PhaseBehaviour.fail`
    h.forward()
    h.assert_no_race()


def test_an_on_demand_load_tells_the_schedule(device: str = "cpu") -> None:
    """`DeviceCopies.load_now` (a load made now, on the compute stream) and resident fills count in ``compute_loads``,
    which the schedule's next load (or prime) answers by making its streams wait; a load the schedule made
    already sets nothing."""
    from tests.test_engine import UNITS, make, run

    model, x = make()
    budget = int(14_848 + 2.5 * UNITS["cpu", torch.float32]) + 2048
    handle = ft.offload(model, include_patterns=["blocks.*"], gpu_budget=budget, device="cpu")
    run(model, x, "cpu", 4)
    copies: DeviceCopies = handle.device_copies
    assert handle.plan is not None and handle.plan.streamed
    before = copies.compute_loads
    index = handle.plan.streamed[0]
    slot = copies.slot_of[index]
    owner = copies.slot_owner[slot]
    assert not copies.load_now(owner)  # the slot holds it: no load, nothing told
    assert copies.compute_loads == before
    other = next(i for i in handle.plan.streamed if copies.slot_of[i] == slot and i != owner)
    assert copies.load_now(other)
    assert copies.compute_loads == before + 1
    handle.remove()


# ------------------------------------------------------------------------------------ on a device


def _unit_primed_over(handle: ft.OffloadHandle) -> tuple[int, int]:
    """A streamed unit and its slot, after a last forward, that the next prime overwrites with another unit: one
    not yet in the slot when there is one (loaded on demand when called), else the slot's occupant."""
    copies, plan = handle.device_copies, handle.plan
    assert plan is not None
    for slot, first in plan.first_loads:
        owner = copies.slot_owner[slot]
        others = [u for u in plan.streamed if copies.slot_of[u] == slot and u not in (first, owner)]
        if others or (owner is not None and owner != first):
            return (others[0] if others else owner), slot  # type: ignore[return-value]
    pytest.skip("no slot is primed with another unit than the one it holds")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("compression", ["none", "lossless"])
def test_on_a_gpu_a_unit_called_before_the_prime_keeps_its_weights(compression: str, monkeypatch) -> None:
    """After a last forward (its next forward's loads not issued, as under a pipeline's hand-over), a streamed block
    called on its own loads on demand and computes on the compute stream, held back ~0.1 s; the next forward,
    enqueued meanwhile, primes that block's slot with another unit. The block computes with its own weights (as a
    copy of it run natively), the forward is native, and the load checks find nothing. Before the prime waited
    for the compute stream, the prime's copy or decode landed in the slot during the block's call."""
    import copy

    from tests.test_engine import native, run
    from tests.test_load_checks import make_for, offload_verified

    model, x = make_for(compression)
    twin = copy.deepcopy(model).to("cuda")
    ref = native(model, x, "cuda")
    handle = offload_verified(model, x, "cuda", compression, monkeypatch)
    for _ in range(6):  # discovery and profiling, then steady
        run(model, x, "cuda", 1)
        if handle.phase is Phase.STEADY and handle.schedule.primed:
            break
    assert handle.phase is Phase.STEADY and handle.plan is not None and handle.plan.streamed
    handle.schedule.last_forward = True
    run(model, x, "cuda", 1)
    handle.schedule.end_last_forward()
    index, _ = _unit_primed_over(handle)
    block = model.blocks[index]
    held = block.register_forward_pre_hook(lambda *_: torch.cuda._sleep(200_000_000))
    torch.manual_seed(1)
    hidden = torch.randn(2, 16, twin.embed.embedding_dim, dtype=twin.embed.weight.dtype, device="cuda")
    with torch.inference_mode():
        alone = block(hidden)
        outs = run(model, x, "cuda", 1)  # primes while the block's call waits on the device
        expected = twin.blocks[index](hidden)
    held.remove()
    assert torch.equal(alone.cpu(), expected.cpu())
    assert torch.equal(outs[0], ref)
    assert not handle.check_loads().faults
    handle.remove()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_decode_runs_on_its_devices_current_stream_whatever_device_is_current() -> None:
    """A payload decoded into cuda:1 while cuda:0 is the current device: the kernel runs on cuda:1's current stream
    (after the payload's copy there, held back ~0.1 s), not on cuda:0's, and gives the unit's bytes."""
    from flextensor_diffusers.storage.codec import Segment, decode_into, encode_unit

    torch.manual_seed(0)
    flat = torch.randn(1 << 20, dtype=torch.bfloat16).view(torch.uint8)
    encoded = encode_unit(flat, [Segment(0, flat.numel(), torch.bfloat16)])
    second = torch.device("cuda", 1)
    stream = torch.cuda.Stream(second)
    payload = torch.empty(encoded.payload.numel(), dtype=torch.uint8, device=second)
    out = torch.zeros(flat.numel(), dtype=torch.uint8, device=second)
    source = encoded.payload.pin_memory()
    try:
        torch.cuda.set_stream(stream)  # cuda:1's current stream
        torch.cuda.set_device(0)
        with torch.cuda.device(second):
            torch.cuda._sleep(200_000_000)  # on `stream`
        payload.copy_(source, non_blocking=True)  # on `stream`, after the sleep
        assert torch.cuda.current_device() == 0
        decode_into(encoded, payload, out)
        decoded = out.cpu()  # waits for `stream`
    finally:
        torch.cuda.set_stream(torch.cuda.default_stream(second))
        torch.cuda.set_device(0)
    assert torch.equal(decoded, flat)
