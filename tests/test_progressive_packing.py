"""Raw host copies packed while the model is already in use: set-up returns at once, the first forward waits only
for the units it reaches, and nothing a user does meanwhile (edit a weight, read the state dict, remove the
offload, interrupt a forward) sees a unit half packed or loses an edit."""

from __future__ import annotations

import threading

import pytest
import torch

import flextensor_diffusers as ft
from flextensor_diffusers.storage import host_copies, packing, packing_line
from tests.models import Stack, assert_same, snapshot
from tests.test_engine import make, native

HELD = "blocks.2"  # the unit whose packing a test holds


def forward(model: Stack, x: torch.Tensor, device: str) -> torch.Tensor:
    with torch.inference_mode():
        return model(x.to(device)).cpu()


def offload(model: Stack, device: str) -> ft.OffloadHandle:
    """Offloaded to stream its blocks (none resident: activating at set-up copies the base only)."""
    return ft.offload(model, include_patterns=["blocks.*"], gpu_budget=150_000, device=device)


@pytest.fixture(autouse=True)
def line_of_its_own(monkeypatch: pytest.MonkeyPatch) -> packing_line.PackingLine:
    """A packing line for this test's models alone: models of earlier tests, not yet collected, copy nothing here."""
    line = packing_line.PackingLine()
    monkeypatch.setattr(packing_line, "LINE", line)
    return line


def hold_packing(
    monkeypatch: pytest.MonkeyPatch, name: str = HELD, before_copy: bool = False
) -> tuple[threading.Event, threading.Event]:
    """Hold the packing thread of unit ``name`` after it copied the unit's bytes (or before), until the second
    event is set; the first is set once it is held."""
    copied, go_on = threading.Event(), threading.Event()
    real = packing.copy_into

    def held(unit, buffer) -> None:
        if not before_copy:
            real(unit, buffer)
        if unit.name == name:
            copied.set()
            assert go_on.wait(60), "the test never let the packing go on"
        if before_copy:
            real(unit, buffer)

    monkeypatch.setattr(packing, "copy_into", held)
    return copied, go_on


def pending(handle: ft.OffloadHandle) -> set[int]:
    packing = handle.host._progressive
    return set() if packing is None else set(packing.pending)


def reach(handle: ft.OffloadHandle, name: str = HELD) -> None:
    """Ask for the host bytes of the unit before ``name``, as a forward reaching it does: it is adopted, and the
    line copies ``name`` next."""
    before = next(i for i, unit in enumerate(handle.units) if unit.name == name) - 1
    handle.host.host_of(handle.units[before])


def test_set_up_returns_before_packing_ends_and_the_first_forward_waits(device: str, monkeypatch) -> None:
    model, x = make()
    ref = native(model, x, device)
    copied, go_on = hold_packing(monkeypatch)
    handle = offload(model, device)
    assert 3 in pending(handle) and not copied.is_set()  # set-up returned; blocks.2 is copied once reached
    seen: list[bool] = []

    def let_go() -> None:  # the forward waits at blocks.2's gate while its copy is held
        seen.append(copied.wait(60) and 3 in pending(handle))
        go_on.set()

    releaser = threading.Thread(target=let_go)
    releaser.start()
    assert torch.equal(forward(model, x, device), ref)
    releaser.join()
    assert seen == [True]
    assert not pending(handle) and not handle.host.arriving  # the last unit adopted ends the gate
    assert torch.equal(forward(model, x, device), ref)
    handle.wait_until_packed()
    assert handle.host._progressive is None
    assert handle.stats().setup_ms["pack"] > 0
    handle.remove()


def test_at_most_one_unit_of_the_process_is_held_twice(line_of_its_own: packing_line.PackingLine) -> None:
    """Until a unit is adopted its own tensors stay alive too. Two models set up and not used: the line copied one
    unit ahead, for both, and then stops (no thread copies); every unit not adopted has its own tensors."""
    models = [make(depth=8) for _ in range(2)]
    refs = [native(model, x, "cpu") for model, x in models]
    earlier = set(threading.enumerate())  # another test's handle may still be copying a unit on its own line
    handles = [offload(model, "cpu") for model, _ in models]
    line = line_of_its_own
    with line._cond:  # woken as each copy ends
        assert line._cond.wait_for(lambda: line._held is not None and line._copying is None, timeout=60)
    assert not [t for t in set(threading.enumerate()) - earlier if t.name == "flextensor-pack"]  # none until adopted
    held = line._held
    assert held is not None and held.packer() in [h.host._progressive for h in handles]
    adopted = [len(h.host.positions) - len(pending(h)) for h in handles]
    assert adopted == [2, 1]  # each base (activated at set-up), and the first model's first block: adopted by the
    # second model's set-up, which found it held when it asked for its base
    waiting = [packed.tensor for h in handles for p in pending(h) for packed in h.host.positions[p].tensors]
    storages = [t.untyped_storage().data_ptr() for t in waiting]
    assert len(set(storages)) == len(storages) == len(waiting)  # their tensors are still their own
    for (model, x), ref in zip(models, refs, strict=True):
        assert torch.equal(forward(model, x, "cpu"), ref)
    for handle in handles:
        handle.wait_until_packed()
        assert not pending(handle) and handle.host._progressive is None
        handle.remove()


@pytest.mark.parametrize("edited_before_copy", [False, True])
def test_in_place_edit_while_packing_reaches_the_outputs(device: str, monkeypatch, edited_before_copy: bool) -> None:
    """An edit of a weight made after set-up returned, before its unit was adopted: while its bytes were already
    copied (its edit count tells, and it is copied again), or before its unit's copy began."""
    model, x = make()
    expected_model, _ = make()
    with torch.no_grad():
        expected_model.blocks[2].qkv.weight.mul_(2)
    expected = native(expected_model, x, device)
    copied, go_on = hold_packing(monkeypatch, before_copy=edited_before_copy)
    handle = offload(model, device)
    reach(handle)
    assert copied.wait(30)
    with torch.no_grad():
        model.blocks[2].qkv.weight.mul_(2)  # blocks.2 is copied already, or its copy waits to begin
    go_on.set()
    assert torch.equal(forward(model, x, device), expected)
    assert torch.equal(forward(model, x, device), expected)
    handle.remove()
    assert torch.equal(native(model, x, device), expected)


def test_state_dict_while_packing_gives_the_weights(monkeypatch) -> None:
    model, _ = make()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    copied, go_on = hold_packing(monkeypatch)
    handle = offload(model, "cpu")
    reach(handle)
    assert copied.wait(30)
    state = model.state_dict()
    assert state.keys() == before.keys() and all(torch.equal(state[k], before[k]) for k in before)
    go_on.set()
    handle.remove()


def test_a_unit_that_fails_to_pack_is_refused_when_reached_and_remove_restores(monkeypatch) -> None:
    model, x = make()
    ref = native(model, x, "cpu")
    before = snapshot(model)
    real = packing.copy_into

    def failing(unit, buffer) -> None:
        if unit.name == HELD:
            raise MemoryError("simulated: host memory exhausted while packing")
        real(unit, buffer)

    monkeypatch.setattr(packing, "copy_into", failing)
    handle = offload(model, "cpu")
    for _ in range(2):  # every forward that reaches it says so
        with pytest.raises(ft.FlexTensorError, match=r"packing 'blocks\.2' into host memory failed .*simulated"):
            forward(model, x, "cpu")
    with pytest.raises(ft.FlexTensorError, match=r"blocks\.2"):
        handle.wait_until_packed()
    handle.remove()
    assert_same(before, model)
    assert torch.equal(native(model, x, "cpu"), ref)


def test_remove_while_packing_is_under_way_leaves_every_tensor_as_it_was(monkeypatch) -> None:
    model, x = make()
    ref = native(model, x, "cpu")
    before = snapshot(model)
    copied, go_on = hold_packing(monkeypatch)
    earlier = set(threading.enumerate())  # other tests' handles, never removed, may still hold packing threads
    handle = offload(model, "cpu")
    reach(handle)
    assert copied.wait(30)
    threading.Timer(0.2, go_on.set).start()  # removal waits for the copy under way
    handle.remove()
    assert not [t for t in set(threading.enumerate()) - earlier if t.name.startswith("flextensor-pack")]
    assert_same(before, model)
    storages = [t.untyped_storage().data_ptr() for t in model.parameters()]
    assert len(set(storages)) == len(storages)  # each in a storage of its own again
    assert torch.equal(native(model, x, "cpu"), ref)


def test_an_interrupted_adoption_goes_on_at_the_next_forward(monkeypatch) -> None:
    """Ctrl-C while the gate adopts a unit: that forward stops, and the next one adopts it and computes right."""
    model, x = make()
    ref = native(model, x, "cpu")
    before = snapshot(model)
    real = host_copies.ProgressivePacking._adopt
    interrupted: list[int] = []

    def adopt(self, position, copy) -> None:
        if position == 3 and not interrupted:
            interrupted.append(position)
            raise KeyboardInterrupt
        real(self, position, copy)

    monkeypatch.setattr(host_copies.ProgressivePacking, "_adopt", adopt)
    handle = offload(model, "cpu")
    with pytest.raises(KeyboardInterrupt):
        forward(model, x, "cpu")
    assert interrupted and 3 in pending(handle)
    assert torch.equal(forward(model, x, "cpu"), ref)
    assert torch.equal(forward(model, x, "cpu"), ref)
    handle.remove()
    assert_same(before, model)


def test_progressive_packing_with_a_host_budget_is_refused_before_packing(tmp_path) -> None:
    """A host tier packs before set-up returns (it keeps the process under a budget); asking for progressive
    packing there is refused at once, naming the fix, with nothing packed."""
    from flextensor_diffusers.recipes.models import build_pipeline

    pipe = build_pipeline("wan22_t2v", "tiny")
    before = snapshot(pipe.transformer)
    with pytest.raises(ft.FlexTensorError, match=r"progressive_packing=True .* drop progressive_packing"):
        pipe.enable_flextensor_offload(
            budget=10**9, device="cpu", host_budget="1GiB", cache_dir=tmp_path, progressive_packing=True
        )
    assert ft.pipeline_offload(pipe) is None
    assert_same(before, pipe.transformer)
