"""Under a host budget, an expert hands its RAM over during its last forward before a switch: its compressed
copies go back to their payload file as each unit is done, and the next expert's read ahead takes the room
(`storage.host_tier.hand_over`). Outputs stay bitwise; a wrong forecast only costs reads."""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from types import SimpleNamespace

import pytest
import torch

import flextensor_diffusers as ft
from flextensor_diffusers.storage.host_tier import HostTier
from flextensor_diffusers.storage.host_tier.hand_over import HandOver, LastForwardForecast
from tests.models import set_host_overhead, wan_latents
from tests.test_compressed_tier import EXPERTS, enable_one_expert_in_ram, saved  # noqa: F401 (a fixture)
from tests.test_host_tier import load


@pytest.fixture(autouse=True)
def host_copies_only(monkeypatch):
    """Host budgets here are planned in the host copies' bytes (see tests.test_host_tier)."""
    set_host_overhead(monkeypatch, own=0, reserve=0)


class DeviceTimesteps:
    """A schedule's timesteps as the GPU holds them: reading them on the host (``tolist``) would wait for the
    device, so it is counted; each step's timestep is a new tensor, as diffusers' loop makes it."""

    def __init__(self, values: list[int]) -> None:
        self.values = values
        self.reads = 0

    def tolist(self) -> list[int]:
        self.reads += 1
        return list(self.values)

    def __iter__(self):
        return (torch.tensor(v) for v in self.values)


def wan_like(guidance: bool) -> SimpleNamespace:
    """What the forecast reads of a Wan2.2 pipeline: boundary 875 of 1000, four steps, two for each expert."""
    return SimpleNamespace(
        config=SimpleNamespace(boundary_ratio=0.875),
        scheduler=SimpleNamespace(
            timesteps=DeviceTimesteps([999, 900, 800, 700]), config=SimpleNamespace(num_train_timesteps=1000)
        ),
        do_classifier_free_guidance=guidance,
        transformer_2=object(),
        _current_timestep=None,
    )


@pytest.mark.parametrize("guidance", [True, False])
def test_the_last_forward_is_the_last_one_of_the_experts_last_step(guidance: bool) -> None:
    """Two generations: each expert's last forward is said once per generation, and the schedule is read from the
    device once per generation (never per forward)."""
    pipe = wan_like(guidance)
    assert LastForwardForecast.applies_to(pipe)
    forecast = LastForwardForecast(pipe)
    said = []
    for _generation in range(2):
        pipe.scheduler.timesteps = DeviceTimesteps([999, 900, 800, 700])  # set_timesteps makes a new tensor
        for t in pipe.scheduler.timesteps:
            pipe._current_timestep = t
            name = "transformer" if t >= 875 else "transformer_2"
            said += [(name, int(t), forecast.is_last(name)) for _ in range(2 if guidance else 1)]
        assert pipe.scheduler.timesteps.reads == 1
    last = [(name, t) for name, t, is_last in said if is_last]
    assert last == [("transformer", 900), ("transformer_2", 700)] * 2
    assert not LastForwardForecast.applies_to(SimpleNamespace(config=SimpleNamespace(boundary_ratio=None)))


def record_room_at_switches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """Per switch to an expert, the bytes its read ahead was allowed by then and its size: what the budget gave it
    (what was read by then depends on the reader thread's pace)."""
    seen: list[tuple[str, int, int]] = []
    real = HostTier.bring_in

    def bring_in(tier: HostTier, handle) -> None:
        name = next(n for n, h in tier.handles.items() if h is handle)
        job = tier._aheads._jobs.get(name)
        if name in EXPERTS and handle.host.waiting_on_disk:
            size = sum(handle.host.arrival_bytes())  # what its read brings into RAM (its payloads)
            seen.append((name, 0 if job is None else min(job.allowed, job.total_bytes), size))
        real(tier, handle)

    monkeypatch.setattr(HostTier, "bring_in", bring_in)
    return seen


def count_payload_file_mappings(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How many times each payload file is mapped from now on (`PayloadCache.map`, which units let go become views
    of; it maps the file through the descriptor it checked): filled in as the test runs."""
    from flextensor_diffusers.storage import payload_cache

    mapped: dict[str, int] = {}
    real = payload_cache.map_descriptor

    def counted(fd: int, *args: object, **kwargs: object) -> torch.Tensor:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.endswith(".payloads"):
            mapped[path] = mapped.get(path, 0) + 1
        return real(fd, *args, **kwargs)

    monkeypatch.setattr(payload_cache, "map_descriptor", counted)
    return mapped


def test_an_expert_hands_its_ram_over_during_its_last_forward_bitwise(saved, tmp_path, monkeypatch) -> None:  # noqa: F811
    """One expert's compressed copies fit in RAM at a time: during each expert's last forward its payloads leave
    RAM unit by unit and the other expert is read ahead into the room, so the switches to the low-noise expert find
    all of it allowed to be read ahead (the high-noise one shares the room with the text encoder, which runs before
    it). Three generations bitwise, the budget held, nothing taken back."""
    folder, reference = saved
    pipe = load(folder)
    host_budget = enable_one_expert_in_ram(pipe, tmp_path / "cache")
    room = record_room_at_switches(monkeypatch)
    mapped = count_payload_file_mappings(monkeypatch)
    outs = [wan_latents(pipe) for _ in range(3)]
    assert all(torch.equal(o, reference) for o in outs)
    tier = ft.pipeline_offload(pipe).host_tier.report()
    assert tier["peak_host_ram_bytes"] <= host_budget
    handed = tier["hand_overs"]
    assert {h["component"] for h in handed} == set(EXPERTS)
    assert all(h["let_go_units"] > 0 and h["taken_back_units"] == 0 for h in handed)
    assert sum(h["let_go_units"] for h in handed) > len(mapped) and set(mapped.values()) == {1}  # one map a file
    second = [(allowed, size) for name, allowed, size in room if name == "transformer_2"][1:]  # after a hand-over
    assert second and all(allowed == size for allowed, size in second)
    pipe.disable_flextensor_offload()
    assert torch.equal(wan_latents(pipe), reference)


def test_the_last_expert_hands_over_in_the_first_generation_though_the_vae_comes_next(saved, tmp_path) -> None:  # noqa: F811
    """Before an order is seen, the components expected after the low-noise expert are the pipeline's declared ones:
    the VAE first, which stays in RAM. The expert hands its RAM over all the same, to the components after it that
    wait on disk (the next generation's first ones): in the first generation both experts hand over, bitwise."""
    folder, reference = saved
    pipe = load(folder)
    host_budget = enable_one_expert_in_ram(pipe, tmp_path / "cache")
    assert torch.equal(wan_latents(pipe), reference)
    tier = ft.pipeline_offload(pipe).host_tier.report()
    assert [h["component"] for h in tier["hand_overs"]] == ["transformer", "transformer_2"]
    assert all(h["let_go_units"] > 0 and h["taken_back_units"] == 0 for h in tier["hand_overs"])
    assert tier["peak_host_ram_bytes"] <= host_budget
    assert torch.equal(wan_latents(pipe), reference)
    pipe.disable_flextensor_offload()


def test_a_generation_that_ends_with_latents_ends_the_hand_over(saved, tmp_path, caplog) -> None:  # noqa: F811
    """``output_type="latent"``: no VAE runs after the low-noise expert's last forward, so no switch ends its
    hand-over; the end of the generation does. An edit of that expert then goes through no hand-over's gate: it
    takes no unit back and warns of no wrong forecast (it once did both); the outputs follow the edit, bitwise."""
    folder, reference = saved
    pipe = load(folder)
    enable_one_expert_in_ram(pipe, tmp_path / "cache")
    assert torch.equal(wan_latents(pipe), reference)
    tier = ft.pipeline_offload(pipe).host_tier
    expert = pipe.transformer_2
    weights = {k: v.clone() for k, v in expert.state_dict().items()}
    with caplog.at_level(logging.WARNING, logger="flextensor_diffusers"):
        expert.load_state_dict(weights)  # the same weights: an edit all the same
    assert all(h["taken_back_units"] == 0 for h in tier.report()["hand_overs"])
    assert "ran again after the forward expected to be its last" not in caplog.text
    assert torch.equal(wan_latents(pipe), reference)
    pipe.disable_flextensor_offload()


def test_without_the_hand_over_the_switches_find_less_read_ahead(saved, tmp_path, monkeypatch) -> None:  # noqa: F811
    """The same run with no forecast: the budget leaves the next expert no room until the switch."""
    monkeypatch.setattr(LastForwardForecast, "is_last", lambda self, name: False)
    folder, reference = saved
    pipe = load(folder)
    enable_one_expert_in_ram(pipe, tmp_path / "cache")
    room = record_room_at_switches(monkeypatch)
    assert all(torch.equal(wan_latents(pipe), reference) for _ in range(2))
    assert not ft.pipeline_offload(pipe).host_tier.report()["hand_overs"]
    second = [(allowed, size) for name, allowed, size in room if name == "transformer_2"][1:]
    assert second and all(allowed < size for allowed, size in second)
    pipe.disable_flextensor_offload()


def test_a_wrong_forecast_takes_the_units_back_and_stays_bitwise(saved, tmp_path, monkeypatch, caplog) -> None:  # noqa: F811
    """A forecast that calls every forward the last: each next forward of the same expert takes the units let go
    back from the payload file (checked against its checksum) before loading them, with one warning; bitwise."""
    monkeypatch.setattr(LastForwardForecast, "is_last", lambda self, name: True)
    folder, reference = saved
    pipe = load(folder)
    host_budget = enable_one_expert_in_ram(pipe, tmp_path / "cache")
    with caplog.at_level(logging.WARNING, logger="flextensor_diffusers"):
        assert all(torch.equal(wan_latents(pipe), reference) for _ in range(2))
    tier = ft.pipeline_offload(pipe).host_tier.report()
    assert tier["peak_host_ram_bytes"] <= host_budget
    assert any(h["taken_back_units"] > 0 for h in tier["hand_overs"])
    assert "ran again after the forward expected to be its last" in caplog.text
    pipe.disable_flextensor_offload()
    assert torch.equal(wan_latents(pipe), reference)


class SlowEvent:
    """Stands in for the CUDA event of a unit's last call: done after a random few milliseconds, so that payloads
    are let go on the hand-over's thread while the model goes on (as on a GPU), at random points of the run."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def synchronize(self) -> None:
        time.sleep(self._rng.uniform(0, 0.004))


@pytest.mark.parametrize("always_last", [False, True])
def test_payloads_let_go_on_the_thread_at_random_times_stay_bitwise(saved, tmp_path, monkeypatch, always_last):  # noqa: F811
    """The thread's path, events completing at random times: a unit may be let go before, during or after the
    switch away (then the move out takes it), or claimed by the gate first; with a forecast that is always wrong
    too. Bitwise, within the budget."""
    rng = random.Random(3)
    real = HandOver.unit_done
    monkeypatch.setattr(HandOver, "unit_done", lambda self, unit, event: real(self, unit, SlowEvent(rng)))
    if always_last:
        monkeypatch.setattr(LastForwardForecast, "is_last", lambda self, name: True)
    folder, reference = saved
    pipe = load(folder)
    host_budget = enable_one_expert_in_ram(pipe, tmp_path / "cache")
    assert all(torch.equal(wan_latents(pipe), reference) for _ in range(3))
    tier = ft.pipeline_offload(pipe).host_tier.report()
    assert tier["peak_host_ram_bytes"] <= host_budget
    assert sum(h["let_go_units"] for h in tier["hand_overs"]) > 0
    pipe.disable_flextensor_offload()
    assert torch.equal(wan_latents(pipe), reference)


class HeldEvent:
    """Stands in for the CUDA event of a unit's last call: done once the test says so (``done``); ``waited`` is set
    as the hand-over's thread begins to wait for it."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.waited = threading.Event()

    def synchronize(self) -> None:
        self.waited.set()
        assert self.done.wait(10)


def test_a_unit_told_done_again_is_let_go_on_its_newer_event_only() -> None:
    """A unit told done (event 1, not complete yet), claimed by the gate as the component runs again, then told done
    again in that run (event 2): event 1 completing lets nothing go (the newer call's payload copy may still be
    queued on the device, and its buffer would go to a read); event 2 completing does."""
    let_go: list[int] = []
    host = SimpleNamespace(
        expect_arrivals=lambda gate: SimpleNamespace(close=lambda: None),  # the gate it opens (`OpenGate`)
        transfer_bytes=lambda index: 1,
        let_go_payload=lambda unit: let_go.append(unit.index) is None,
    )
    hand = HandOver("transformer", SimpleNamespace(host=host), threading.RLock(), False, lambda: None, lambda: None)
    unit, first, second = SimpleNamespace(index=3), HeldEvent(), HeldEvent()
    hand.unit_done(unit, first)
    hand.gate(unit)  # ran again before the first event completed: not let go yet, so no wrong forecast is seen
    hand.unit_done(unit, second)
    first.done.set()
    assert second.waited.wait(10)  # the thread is done with the first event
    assert let_go == []
    second.done.set()
    deadline = time.monotonic() + 10
    while not let_go and time.monotonic() < deadline:
        time.sleep(0.001)
    assert let_go == [3]
    hand.finish()
