"""The host tier's threads under seeded random delays (`tests.race_harness`): the readers filling buffers the locked
pool lends, the hand-over letting payloads go on events, the payload file's background write and the model's
thread taking units at the gate. Every generation is bitwise equal to native, no load copies a payload whose bytes
changed since enable, and no buffer goes back to the pool, to a new read or to the system while a copy of it may
still be pending on a GPU (the ledger's model of the asynchronous copies). Two positive controls show that the
harness sees both kinds of fault: a buffer given back while still kept, and one handed on under a pending copy.

A longer soak: ``python -m tests.race_harness --seeds 0-199`` (see there)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from flextensor_diffusers.storage import host_forms
from flextensor_diffusers.storage.host_memory import unpin_in_place
from flextensor_diffusers.storage.payload_records import PayloadLocks
from tests.models import set_host_overhead, wan_latents
from tests.race_harness import RunResult, Scenario, one_torch_thread, run
from tests.test_compressed_tier import smallest_host_budget
from tests.test_host_tier import load, save


@pytest.fixture(scope="module")
def tier(tmp_path_factory) -> tuple[Path, torch.Tensor, int]:
    """The tiny pipeline saved to a folder (each expert in two shards), its native latents (on one torch thread, as
    the harness runs), and the smallest host budget that runs it compressed (one expert in RAM at a time: each
    generation reads the other back, and hands RAM over at each switch)."""
    folder = save(tmp_path_factory.mktemp("tiny") / "wan22", "200KB")
    with one_torch_thread():
        reference = wan_latents(load(folder))
    with pytest.MonkeyPatch.context() as patch:
        set_host_overhead(patch, own=0, reserve=0)
        host_budget = smallest_host_budget(load(folder), tmp_path_factory.mktemp("probe"))
    return folder, reference, host_budget


def run_in(tier, tmp_path: Path, scenario: Scenario) -> RunResult:
    folder, reference, host_budget = tier
    return run(folder, reference, tmp_path / "cache", host_budget, scenario)


#: Delays up to 2 ms (one in twenty up to 40 ms); a hand-over's events up to 30 ms late (a GPU may complete them a
#: forward later), and a forecast always wrong (units let go are taken back, their events overtaken by newer ones).
SCENARIOS = {
    "seed0": Scenario(0, generations=3),
    "seed3": Scenario(3, generations=3),
    "seed1-slow-events": Scenario(1, generations=3, event_most_s=0.03),
    "seed2-always-last-slow-events": Scenario(2, generations=3, always_last=True, event_most_s=0.03),
}


@pytest.mark.parametrize("scenario", SCENARIOS.values(), ids=SCENARIOS.keys())
def test_the_host_tiers_threads_under_random_delays_stay_bitwise(tier, tmp_path, scenario: Scenario) -> None:
    """Three generations per seed, delays at every hand-off between threads (see `tests.race_harness`): bitwise, every
    load's payload as it was at enable, no buffer released under a read. The parts under test did run: units read
    back from disk into lent buffers, payloads let go on events, buffers reused, the payload file written (and, with
    a forecast that is always wrong, units taken back)."""
    result = run_in(tier, tmp_path, scenario)
    assert result.clean, "\n".join([result.line(), *result.errors, *result.hazards, *result.mismatches][:8])
    assert result.reads_from_disk >= 3 and result.pool_reused > 0 and result.let_go_units > 0
    assert (result.taken_back_units > 0) == scenario.always_last
    for site in ("reader.lent", "reader.piece", "event.synchronize", "hand_over.let_go", "write.begin"):
        assert result.delays.get(site, 0) > 0, site


def test_the_poison_shows_a_buffer_given_back_while_its_payload_is_kept(tier, tmp_path) -> None:
    """Positive control: each payload read back is given back to the pool as it is taken, yet kept (a buffer with
    two owners). The next load copies the poison the harness wrote into it: mismatches, and outputs not bitwise."""

    def taken_and_given_back(patch: pytest.MonkeyPatch) -> None:
        real = host_forms.CompressedOnly.take_unit

        def take_unit(self, new) -> None:
            real(self, new)
            unpin_in_place(new.host)  # back to the pool, still the unit's payload

        patch.setattr(host_forms.CompressedOnly, "take_unit", take_unit)

    result = run_in(tier, tmp_path, Scenario(0, generations=1, change=taken_and_given_back))
    assert result.mismatches and not all(result.bitwise)


@pytest.mark.parametrize("synchronised", [True, False], ids=["as-it-is", "spill-without-synchronising"])
def test_the_ledger_sees_a_buffer_handed_on_under_a_pending_copy(tier, tmp_path, synchronised: bool) -> None:
    """The hand-over's events held until the generation is over (a GPU still running the last forward): nothing is
    let go, and the expert moved out at the switch hands its payloads' buffers to the pool while the copies of its
    last forward are not known done. As it is, the spill synchronises the device first: nothing found. Positive
    control: a spill that does not (its payloads unlocked as if their copies were done) is a hazard per buffer."""

    def no_synchronisation(patch: pytest.MonkeyPatch) -> None:
        patch.setattr(PayloadLocks, "unlock_all", lambda self: self.unlock(list(self._in_place), copies_done=True))

    change = None if synchronised else no_synchronisation
    result = run_in(tier, tmp_path, Scenario(0, generations=1, held=threading.Event(), change=change))
    assert all(result.bitwise) and not result.mismatches and result.let_go_units == 0
    assert bool(result.hazards) != synchronised, "\n".join(result.hazards[:4])
    assert all("event not waited for" in h or "not consumed" in h for h in result.hazards)
