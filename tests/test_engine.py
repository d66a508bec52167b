"""The streaming engine end to end on a small model: numerics, restore, profiles, bad input."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch

import flextensor_diffusers as ft
from flextensor_diffusers.engine import Phase
from flextensor_diffusers.engine.units import CPU_ALIGNMENT
from tests.models import Block, Stack, assert_same, device_headroom, snapshot

#: Bytes of one Block(32) in its flat buffer (checked below), by dtype and device: a 64-byte grid with room for
#: any alignment class on the CPU, a 512-byte grid on CUDA (weights moved there are at class 0).
UNITS = {("cpu", torch.float32): 35_328, ("cpu", torch.bfloat16): 18_432}
UNITS |= {("cuda", torch.float32): 37_376, ("cuda", torch.bfloat16): 20_992}
UNIT = UNITS["cpu", torch.float32]


def make(dtype: torch.dtype = torch.float32, depth: int = 6) -> tuple[Stack, torch.Tensor]:
    torch.manual_seed(0)
    return Stack(depth=depth, dtype=dtype), torch.randint(0, 50, (2, 16))


def native(model: Stack, x: torch.Tensor, device: str) -> torch.Tensor:
    model.to(device)
    with torch.no_grad():
        out = model(x.to(device)).cpu()
    model.to("cpu")
    return out


def run(model: Stack, x: torch.Tensor, device: str, n: int) -> list[torch.Tensor]:
    with torch.inference_mode():
        return [model(x.to(device)).cpu() for _ in range(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("budget_units", [2, 3.5, 5, 100])
def test_outputs_bitwise_equal_and_restore_exact(device: str, dtype: torch.dtype, budget_units: float) -> None:
    model, x = make(dtype)
    ref = native(model, x, device)
    before = snapshot(model)
    resident = 14_848 if dtype == torch.float32 else 7_680  # tied embedding + pos buffer, outside units
    budget = int(resident + budget_units * UNITS[device, dtype]) + device_headroom(device, model, x)
    handle = ft.offload(model, ft.OffloadConfig(include_patterns=["blocks.*"], gpu_budget=budget, device=device))
    assert handle.resident_weight_bytes == resident
    outs = run(model, x, device, 5)
    assert handle.phase is Phase.STEADY
    assert handle.counters["discovery"] == 1 and handle.counters["profiling"] == 1 and handle.counters["steady"] == 3
    for out in outs:
        assert torch.equal(out, ref)
    plan = handle.plan
    assert plan is not None and plan.memory_bytes <= budget
    if budget_units == 100:
        assert len(plan.resident) == 6 and plan.num_slots == 0
    elif budget_units == 2 and device == "cpu":
        assert len(plan.resident) == 0 and plan.num_slots == 2
    handle.remove()
    assert_same(before, model)


def test_unit_layout_aligned_and_mixed_dtypes() -> None:
    model, _ = make()
    handle = ft.offload(model, include_patterns=["blocks.*"], gpu_budget=10**9, device="cpu")
    unit = handle.units[0]
    assert unit.nbytes == UNIT
    assert all(p.offset % CPU_ALIGNMENT == p.tensor.data_ptr() % CPU_ALIGNMENT == 0 for p in unit.tensors)
    assert {p.dtype for p in unit.tensors} == {torch.float32, torch.int64}
    # every parameter of a unit is a view of one flat buffer: one copy per unit
    storages = {p.tensor.untyped_storage().data_ptr() for p in unit.tensors}
    assert len(storages) == 1
    handle.remove()


def test_order_records_repeated_unit_and_tied_weights_stay_shared() -> None:
    model, x = make()
    model.repeat = 2
    ref = native(model, x, "cpu")
    handle = ft.offload(model, include_patterns=["blocks.*"], gpu_budget=200_000, device="cpu")
    outs = run(model, x, "cpu", 4)
    assert all(torch.equal(o, ref) for o in outs)
    order = [c.unit for c in handle.profile.calls]
    assert order == [0, 1, 2, 3, 4, 5, 1, 1]
    assert model.head.weight is model.embed.weight
    handle.remove()
    assert model.head.weight is model.embed.weight


def test_order_change_is_detected_and_replanned(caplog: pytest.LogCaptureFixture) -> None:
    model, x = make()
    handle = ft.offload(model, include_patterns=["blocks.*"], gpu_budget=100_000, device="cpu")
    run(model, x, "cpu", 3)
    model.repeat = 3  # control flow changes: one more call of block 1
    ref = native_copy(model, x)
    with caplog.at_level(logging.WARNING):
        outs = run(model, x, "cpu", 4)
    assert all(torch.equal(o, ref) for o in outs)
    assert handle.counters["desyncs"] == 1
    assert handle.counters["plans"] == 2
    assert [c.unit for c in handle.profile.calls][-3:] == [1, 1, 1]
    assert "ran out of the planned order" in caplog.text
    handle.remove()


def native_copy(model: Stack, x: torch.Tensor) -> torch.Tensor:
    """Native output of an offloaded model, from a fresh copy of its weights."""
    clone = Stack(depth=len(model.blocks))
    clone.load_state_dict(model.state_dict())
    clone.repeat = model.repeat
    with torch.no_grad():
        return clone(x)


def test_state_dict_reads_host_weights_while_streaming() -> None:
    model, x = make()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    handle = ft.offload(model, include_patterns=["blocks.*"], gpu_budget=100_000, device="cpu")
    run(model, x, "cpu", 3)  # slots now hold the last units' weights
    got = model.state_dict()
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    handle.remove()


def test_input_shape_change_reprofiles() -> None:
    model, x = make()
    handle = ft.offload(model, include_patterns=["blocks.*"], gpu_budget=100_000, device="cpu")
    run(model, x, "cpu", 3)
    x2 = torch.randint(0, 50, (1, 24))
    ref = native_copy(model, x2)
    outs = run(model, x2, "cpu", 3)
    assert all(torch.equal(o, ref) for o in outs)
    assert handle.counters["profiling"] == 2 and handle.counters["plans"] == 2
    handle.remove()


def test_profile_round_trip_skips_discovery(tmp_path) -> None:
    path = tmp_path / "stack.json"
    model, x = make()
    ref = native(model, x, "cpu")
    config = ft.OffloadConfig(include_patterns=["blocks.*"], gpu_budget=100_000, device="cpu", profile=path)
    handle = ft.offload(model, config)
    run(model, x, "cpu", 2)
    assert path.exists()  # saved as soon as profiling finished
    first_plan = handle.plan.summary()
    handle.remove()

    handle = ft.offload(model, config)
    outs = run(model, x, "cpu", 2)
    assert all(torch.equal(o, ref) for o in outs)
    assert handle.counters["discovery"] == 0 and handle.counters["profiling"] == 0
    assert handle.counters["steady"] == 2
    assert handle.plan.summary()["resident_units"] == first_plan["resident_units"]
    handle.remove()


def test_profile_from_another_model_is_refused(tmp_path) -> None:
    path = tmp_path / "p.json"
    model, x = make(depth=6)
    handle = ft.offload(model, include_patterns=["blocks.*"], gpu_budget=100_000, device="cpu")
    run(model, x, "cpu", 2)
    handle.save_profile(path)
    handle.remove()

    other, _ = make(depth=5)
    before = snapshot(other)
    with pytest.raises(ft.ProfileMismatchError, match="another model"):
        ft.offload(other, include_patterns=["blocks.*"], gpu_budget=100_000, device="cpu", profile=path)
    assert_same(before, other)
    other_bf16, _ = make(dtype=torch.bfloat16)
    with pytest.raises(ft.ProfileMismatchError, match="dtypes"):
        ft.offload(other_bf16, include_patterns=["blocks.*"], gpu_budget=100_000, device="cpu", profile=path)
    # asked for: profile again instead
    handle = ft.offload(
        other, include_patterns=["blocks.*"], gpu_budget=100_000, device="cpu", profile=path, reprofile_on_mismatch=True
    )
    run(other, x, "cpu", 2)
    assert handle.counters["discovery"] == 1
    handle.remove()


def test_profile_for_other_inputs_is_refused(tmp_path) -> None:
    path = tmp_path / "p.json"
    model, x = make()
    config = ft.OffloadConfig(include_patterns=["blocks.*"], gpu_budget=100_000, device="cpu", profile=path)
    handle = ft.offload(model, config)
    run(model, x, "cpu", 2)
    handle.remove()
    handle = ft.offload(model, config)
    with pytest.raises(ft.ProfileMismatchError, match="recorded for inputs"):
        run(model, torch.randint(0, 50, (1, 8)), "cpu", 1)
    handle.remove()


def test_profile_from_another_device_is_refused(tmp_path) -> None:
    import json

    path = tmp_path / "p.json"
    model, x = make()
    handle = ft.offload(model, include_patterns=["blocks.*"], gpu_budget=100_000, device="cpu", profile=path)
    run(model, x, "cpu", 2)
    handle.remove()
    data = json.loads(path.read_text())
    data["device"] = "NVIDIA H200"
    path.write_text(json.dumps(data))
    with pytest.raises(ft.ProfileMismatchError, match="recorded on 'NVIDIA H200'"):
        ft.offload(model, include_patterns=["blocks.*"], gpu_budget=100_000, device="cpu", profile=path)


def test_out_of_memory_while_measuring_names_the_fix_and_the_model_recovers(monkeypatch: pytest.MonkeyPatch) -> None:
    """An out-of-memory in the first (measuring) forward comes before the planner has the activation peak to
    refuse the budget with: it is re-raised as MeasuringOutOfMemoryError, still a torch.OutOfMemoryError,
    saying what the budget left the activations and what to change; the next, smaller call is right."""
    model, x = make()
    ref = native_copy(model, x)
    handle = ft.offload(model, include_patterns=["blocks.*"], gpu_budget=100_000, device="cpu")
    forward = Block.forward

    def too_big(self: Block, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[1] > x.shape[1]:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.38 GiB.")
        return forward(self, hidden)

    monkeypatch.setattr(Block, "forward", too_big)
    longer = torch.randint(0, 50, (1, x.shape[1] + 8))
    with torch.no_grad(), pytest.raises(ft.MeasuringOutOfMemoryError, match=r"while measuring .* frames") as caught:
        model(longer)
    assert isinstance(caught.value, torch.OutOfMemoryError) and isinstance(caught.value, ft.BudgetError)
    assert "Tried to allocate 3.38 GiB" in str(caught.value)
    assert all(torch.equal(o, ref) for o in run(model, x, "cpu", 3))
    handle.remove()


def test_out_of_memory_with_much_reserved_but_free_names_expandable_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the allocator held much memory reserved but free when the measuring forward ran out (fragmentation,
    as issue 47's call E on a 5 GB card), the error names the allocator setting first; not where little was, nor
    where that setting is on already."""
    from flextensor_diffusers.engine.call_guards import FRAGMENTED_BYTES, measuring_out_of_memory_error

    exc = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 640.00 MiB.")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    fragmented = str(measuring_out_of_memory_error("M", 5 * 10**9, 3 * 2**30, exc, int(1.46 * 2**30)))
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in fragmented and "reserved but free" in fragmented
    assert "expandable" not in str(measuring_out_of_memory_error("M", 5 * 10**9, 3 * 2**30, exc, FRAGMENTED_BYTES - 1))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert "expandable" not in str(measuring_out_of_memory_error("M", 5 * 10**9, 3 * 2**30, exc, 2**31))


def test_budget_below_two_slots_names_smallest_budget() -> None:
    model, _ = make()
    before = snapshot(model)
    smallest = 14_848 + 2 * UNIT
    with pytest.raises(ft.BudgetError, match=f"gpu_budget >= {smallest}"):
        ft.offload(model, include_patterns=["blocks.*"], gpu_budget=smallest - 1, device="cpu")
    assert_same(before, model)
    ft.offload(model, include_patterns=["blocks.*"], gpu_budget=smallest, device="cpu").remove()
    assert_same(before, model)


def test_unknown_pattern_lists_close_names() -> None:
    model, _ = make()
    before = snapshot(model)
    with pytest.raises(ft.PatternError, match=r"'block\.\*' matched no module.*blocks"):
        ft.offload(model, include_patterns=["block.*"], gpu_budget=10**9, device="cpu")
    with pytest.raises(ft.PatternError, match="ModuleList"):
        ft.offload(model, include_patterns=["blocks"], gpu_budget=10**9, device="cpu")
    assert_same(before, model)


@pytest.mark.parametrize("value", ["lots", "-1GiB", 0, "12 parsecs"])
def test_bad_budget_strings(value: object) -> None:
    with pytest.raises(ft.BudgetError):
        ft.OffloadConfig(include_patterns=["blocks.*"], gpu_budget=value)


def test_budget_parsing() -> None:
    from flextensor_diffusers.engine.config import parse_bytes

    assert parse_bytes("24GiB") == 24 * 2**30
    assert parse_bytes("500MB") == 500 * 10**6
    assert parse_bytes("1.5 gib") == int(1.5 * 2**30)
    assert parse_bytes(1234) == 1234


def test_offloading_twice_is_refused() -> None:
    model, _ = make()
    handle = ft.offload(model, include_patterns=["blocks.*"], gpu_budget=10**9, device="cpu")
    with pytest.raises(ft.OffloadStateError, match="already offloaded"):
        ft.offload(model, include_patterns=["blocks.*"], gpu_budget=10**9, device="cpu")
    with pytest.raises(ft.OffloadStateError, match="already offloaded"):
        ft.offload(model.blocks[0], include_patterns=["ff"], gpu_budget=10**9, device="cpu")
    handle.remove()
    with pytest.raises(ft.OffloadStateError, match="already removed"):
        handle.remove()
    ft.offload(model, include_patterns=["blocks.*"], gpu_budget=10**9, device="cpu").remove()


@pytest.mark.parametrize(
    "cast",
    [lambda m: m.to(torch.float64), lambda m: m.half(), lambda m: m.to("meta"), lambda m: m.to(torch.bfloat16)],
    ids=["to-float64", "half", "to-meta", "to-bfloat16"],
)
def test_a_cast_or_move_of_an_offloaded_model_is_refused_before_anything_changes(cast) -> None:
    """``model.to(dtype)`` and kin would give each parameter new data that the next call's load would undo without
    a word (the cast dropped): refused at once in one line naming the fix, every tensor as it was, the outputs
    still native's; a ``.to()`` that changes nothing passes; once removed, the model casts as any module does."""
    model, x = make()
    reference = native(model, x, "cpu")
    handle = ft.offload(model, include_patterns=["blocks.*"], gpu_budget=10**9, device="cpu")
    before = snapshot(model)
    with pytest.raises(ft.OffloadStateError, match=r"disable offload .* cast or move, then enable it again"):
        cast(model)
    assert_same(before, model)
    assert model.to("cpu", torch.float32) is model  # as it is: nothing to change
    assert all(torch.equal(out, reference) for out in run(model, x, "cpu", 2))
    handle.remove()
    assert cast(model) is model and "_apply" not in vars(model)


def test_autograd_is_refused_with_the_fix() -> None:
    model, x = make()
    handle = ft.offload(model, include_patterns=["blocks.*"], gpu_budget=10**9, device="cpu")
    with pytest.raises(ft.InferenceOnlyError, match="no_grad"):
        model(x)
    model.requires_grad_(False)
    model(x)  # fine once nothing needs grad
    handle.remove()


@pytest.mark.parametrize("compression", ["none", "lossless"])
def test_failure_during_set_up_leaves_model_as_it_was(monkeypatch: pytest.MonkeyPatch, compression: str) -> None:
    """A unit that fails to pack ends set-up with its error and the model as it was; with compression the
    encoder is at work on the units packed meanwhile (it waits for each at the host gate). Raw copies pack
    before set-up returns here (as with shared weights); progressive packing's failures are tested below."""
    from flextensor_diffusers.storage import packing as runtime  # where set-up packs

    model, _ = make()
    before = snapshot(model)
    calls = itertools.count(1)  # packing runs on threads: next() counts each call once
    real = runtime.pack_unit

    def failing(unit, **kwargs):
        if next(calls) == 4:
            raise MemoryError("simulated: host memory exhausted while packing")
        real(unit, **kwargs)

    monkeypatch.setattr(runtime, "pack_unit", failing)
    with pytest.raises(MemoryError, match="simulated"):
        ft.offload(
            model,
            include_patterns=["blocks.*"],
            gpu_budget=10**9,
            device="cpu",
            compression=compression,
            progressive_packing=False,
        )
    assert_same(before, model)
    # torch private: no public way to list the hooks left on a module
    assert not model._forward_pre_hooks and not model.blocks[0]._forward_pre_hooks
    assert type(model) is Stack and type(model.blocks[0]) is Block  # boundary classes put back
    monkeypatch.setattr(runtime, "pack_unit", real)
    ft.offload(model, include_patterns=["blocks.*"], gpu_budget=10**9, device="cpu").remove()  # not "already"


def test_failure_during_remove_keeps_model_working(monkeypatch: pytest.MonkeyPatch) -> None:
    from flextensor_diffusers.storage import host_copies as runtime  # where removal restores

    model, x = make()
    ref = native(model, x, "cpu")
    before = snapshot(model)
    handle = ft.offload(model, include_patterns=["blocks.*"], gpu_budget=100_000, device="cpu")
    run(model, x, "cpu", 3)
    real = runtime.restore_unit
    calls = {"n": 0}

    def failing(unit):
        calls["n"] += 1
        if calls["n"] == 3:
            raise MemoryError("simulated: out of memory while restoring")
        real(unit)

    monkeypatch.setattr(runtime, "restore_unit", failing)
    with pytest.raises(ft.OffloadStateError, match="call remove\\(\\) again"):
        handle.remove()
    assert all(torch.equal(o, ref) for o in run(model, x, "cpu", 2))  # still correct, half restored
    monkeypatch.setattr(runtime, "restore_unit", real)
    handle.remove()
    assert_same(before, model)


def test_stats_report() -> None:
    model, x = make()
    handle = ft.offload(model, include_patterns=["blocks.*"], gpu_budget=100_000, device="cpu")
    run(model, x, "cpu", 4)
    stats = handle.stats()
    assert stats.phase == "steady"
    assert stats.bytes_streamed > 0 and stats.loads == sum(u.loads for u in stats.units)
    assert [u.calls_per_forward for u in stats.units] == [1, 2, 1, 1, 1, 1]
    assert all(u.placement.startswith("slot") for u in stats.units)
    text = str(stats)
    assert "blocks.5" in text and "plan:" in text
    assert stats.as_dict()["plan"]["num_slots"] == 2
    assert set(stats.setup_ms) == {"layout", "pack", "hooks"} and stats.setup_ms["pack"] > 0
    assert "set-up layout" in text
    handle.remove()


def test_no_cuda_device_error_names_the_fix() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(ft.NoCudaDeviceError, match="device='cpu'"):
        ft.offload(Stack(), include_patterns=["blocks.*"], gpu_budget=10**9, device="cuda")


def test_release_and_activate_keep_the_plan_and_the_numbers(device: str) -> None:
    model, x = make()
    ref = native(model, x, device)
    budget = 400_000 + device_headroom(device, model, x) - 2048
    handle = ft.offload(model, include_patterns=["blocks.*"], gpu_budget=budget, device=device)
    run(model, x, device, 3)
    plans = handle.counters["plans"]
    handle.release()
    assert not handle.active and all(p.device.type == "cpu" for p in model.parameters())
    buffers = handle.device_copies.buffers  # internal: the device buffers themselves are dropped (no public figure)
    assert buffers.slots == [] and buffers.base is None
    outs = run(model, x, device, 2)  # the forward re-activates
    assert handle.active and handle.counters["plans"] == plans and handle.counters["activations"] == 2
    assert all(torch.equal(o, ref) for o in outs)
    handle.remove()


def test_no_units_means_whole_module_moved_in_and_out() -> None:
    model, x = make()
    ref = native(model, x, "cpu")
    before = snapshot(model)
    handle = ft.offload(model, include_patterns=[], gpu_budget=10**9, device="cpu")
    assert handle.units == [] and handle.phase is Phase.STEADY
    assert all(torch.equal(o, ref) for o in run(model, x, "cpu", 2))
    handle.remove()
    assert_same(before, model)


def test_profile_dir_keeps_one_profile_per_workload(tmp_path) -> None:
    model, x = make()
    x2 = torch.randint(0, 50, (1, 24))
    config = ft.OffloadConfig(include_patterns=["blocks.*"], gpu_budget=100_000, device="cpu", profile_dir=tmp_path)
    handle = ft.offload(model, config)
    run(model, x, "cpu", 2)
    run(model, x2, "cpu", 2)
    handle.remove()
    files = sorted(tmp_path.glob("Stack-*-cpu-*.json"))
    assert len(files) == 2
    handle = ft.offload(model, config)
    run(model, x2, "cpu", 1)
    run(model, x, "cpu", 1)
    assert handle.counters["discovery"] == 0 and handle.counters["profiling"] == 0 and handle.counters["plans"] == 2
    handle.remove()


@pytest.mark.parametrize("compression", ["none", "lossless"])
@pytest.mark.parametrize("forward", [1, 2, 4], ids=["discovery", "profiling", "steady"])
def test_a_forward_interrupted_inside_a_block_leaves_later_forwards_native(
    device: str, forward: int, compression: str
) -> None:
    """Ctrl-C (or any exception) inside a streamed block, in each phase: it reaches the caller as it is, and
    every later forward is bitwise equal to native; removing the offload restores the weights exactly."""
    model, x = make(torch.bfloat16)
    ref = native(model, x, device)
    before = snapshot(model)
    calls = itertools.count(1)

    def interrupt(module: torch.nn.Module, args: tuple) -> None:
        if next(calls) == forward:
            raise KeyboardInterrupt

    room = device_headroom(device, model, x, compression=compression)
    budget = 7_680 + int(2.5 * UNITS[device, torch.bfloat16]) + room
    hook = model.blocks[3].register_forward_pre_hook(interrupt)  # after the probe copied the model
    handle = ft.offload(model, include_patterns=["blocks.*"], gpu_budget=budget, device=device, compression=compression)
    try:
        outs = []
        for _ in range(7):
            try:
                outs += run(model, x, device, 1)
            except KeyboardInterrupt:
                outs.append(None)
        assert [o is None for o in outs] == [n + 1 == forward for n in range(7)]
        assert all(torch.equal(o, ref) for o in outs if o is not None)
        assert handle.phase is Phase.STEADY
    finally:
        handle.remove()
        hook.remove()
    assert_same(before, model)


def test_ctrl_c_while_set_up_waits_for_the_packing_threads_leaves_every_tensor_in_its_own_storage(
    monkeypatch,
) -> None:
    """Ctrl-C reaches set-up while it waits for the threads that pack units (two at a time, the first packs held
    until the interrupt is raised): the interrupt reaches the caller only once every pack that began has ended
    and the packing threads are gone, so no thread is left to pack a unit after set-up put every tensor back,
    each in a storage of its own as before, bit for bit."""
    import threading

    from flextensor_diffusers.storage import packing, setup_threads

    model, x = make(depth=8)
    ref = native(model, x, "cpu")
    before = snapshot(model)
    real_pack, real_wait = packing.pack_unit, setup_threads.wait
    changed = threading.Condition()
    began: list[str] = []
    ended: list[str] = []
    threads: set[threading.Thread] = set()
    interrupted = threading.Event()

    def held_pack(unit, *args, **kwargs) -> None:
        with changed:
            began.append(unit.name)
            threads.add(threading.current_thread())
            changed.notify_all()
        assert interrupted.wait(60), "the interrupt never came"
        real_pack(unit, *args, **kwargs)
        with changed:
            ended.append(unit.name)

    def interrupted_wait(futures, *args, **kwargs):
        with changed:
            assert changed.wait_for(lambda: began, 60), "no unit began to pack"
        interrupted.set()  # the packs under way go on while the interrupt is raised
        raise KeyboardInterrupt

    monkeypatch.setattr(setup_threads, "PACK_THREADS", 2)
    monkeypatch.setattr(packing, "pack_unit", held_pack)
    monkeypatch.setattr(setup_threads, "wait", interrupted_wait)
    with pytest.raises(KeyboardInterrupt):  # packed before set-up returns, as under a pipeline's host tier
        ft.offload(model, include_patterns=["blocks.*"], gpu_budget=10**9, device="cpu", progressive_packing=False)
    monkeypatch.setattr(setup_threads, "wait", real_wait)
    with changed:
        assert began and sorted(began) == sorted(ended), (began, ended)  # every pack that began had ended
    assert threads and not any(t.is_alive() for t in threads)  # and no thread is left to begin another
    assert_same(before, model)
    storages = [t.untyped_storage().data_ptr() for t in model.parameters()]
    assert len(set(storages)) == len(storages)  # not views of a unit's flat buffer: packed after set-up gave up
    assert torch.equal(native(model, x, "cpu"), ref)


def test_a_budget_refused_after_profiling_keeps_nothing_of_the_call_alive(monkeypatch) -> None:
    """The shortfall kept to be raised before the next forward is kept without the traceback it was caught with:
    that traceback's frames reach, through their callers, the very call that profiled, with its inputs and its
    output. A VAE's decoded video stayed alive after the caller dropped it (on an H100, 110,592 bytes per handle
    in `test_profile_inline`'s decode test, freed only when the garbage collector ran), and was counted as the
    next handle's activations."""
    import dataclasses
    import gc
    import weakref

    from flextensor_diffusers.engine.profiler import Profiler

    end_forward = Profiler.end_forward

    def too_fat(profiler: Profiler) -> object:  # activations no budget below holds (the CPU measures none)
        run = dataclasses.replace(end_forward(profiler), activation_peak_bytes=10**12)
        profiler.runs[-1] = run
        return run

    monkeypatch.setattr(Profiler, "end_forward", too_fat)
    model, x = make()
    handle = ft.offload(model, include_patterns=["blocks.*"], gpu_budget=14_848 + 3 * UNIT, device="cpu")
    gc.disable()  # the leak was a reference cycle: only the collector freed it
    try:
        with torch.inference_mode():
            for _ in range(2):  # discovery, then profiling: planned over budget at its end
                output = model(x)
                dropped = weakref.ref(output)
                del output
        assert handle.phase is Phase.OVER_BUDGET
        assert dropped() is None
    finally:
        gc.enable()
        handle.remove()
