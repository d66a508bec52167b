"""Profiling inside the generation the user asked for (issue 48): no profiling generation by default and the same
video as natively; a budget the profiled activations do not fit refused in the step that measured them, the model
left as it was; an unplanned VAE decode that loads each block it runs once, within a quarter of the budget."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

import numpy as np
import pytest
import torch

import flextensor_diffusers as ft
from flextensor_diffusers.engine import Phase
from flextensor_diffusers.engine.phases import PROFILE_RESIDENT_SHARE
from flextensor_diffusers.engine.profiler import Profiler
from flextensor_diffusers.pipelines.patterns import autoencoder_patterns
from flextensor_diffusers.recipes import wan22_t2v
from flextensor_diffusers.recipes.models import build_pipeline
from tests.models import TINY_WAN_ARGV, TINY_WAN_CALL, assert_same, snapshot

BUDGET = 250_000  # streams the transformer blocks
#: Activations the tests make a profiling forward measure (the CPU measures none): more than BUDGET leaves them.
FAT = 200_000


@pytest.fixture(scope="module")
def pipe():
    return build_pipeline("wan22_t2v", "tiny")


def generate(pipe, steps: list[int] | None = None, output_type: str = "latent") -> torch.Tensor:
    """One seeded tiny-Wan2.2 generation (4 steps, CFG); ``steps`` gets the index of each step that finished."""
    done = [] if steps is None else steps

    def count(_pipe, step: int, _t, kwargs: dict) -> dict:
        done.append(step)
        return kwargs

    return pipe(
        **TINY_WAN_CALL,
        output_type=output_type,
        generator=torch.Generator().manual_seed(0),
        callback_on_step_end=count,
    ).frames


def fat_activations(end_forward: Callable[[Profiler], object]) -> Callable[[Profiler], object]:
    """``Profiler.end_forward`` that measures `FAT` bytes of activations, as a GPU would for a larger workload."""

    def measured(profiler: Profiler) -> object:
        run = dataclasses.replace(end_forward(profiler), activation_peak_bytes=FAT)
        profiler.runs[-1] = run
        return run

    return measured


def fatten(handle: ft.OffloadHandle) -> None:
    handle.profiler.end_forward = fat_activations(type(handle.profiler).end_forward).__get__(handle.profiler)


def test_the_recipe_profiles_in_its_generation_and_writes_the_native_video(tmp_path) -> None:
    """No profiling generation by default: the same mp4 bytes as natively, as with --profiling-generation and as
    from a saved profile; the summary says where profiling happened and how many forwards ran unplanned."""
    videos = {}

    def run(name: str, *extra: str) -> dict:
        out = tmp_path / f"{name}.mp4"
        info = wan22_t2v.main([*TINY_WAN_ARGV, "-q", "--output", str(out), *extra])
        videos[name] = out.read_bytes()
        return info

    inline = tmp_path / "inline"
    first = run("first", "--profile-dir", str(inline))
    assert first["profiled_in"] == "generation" and first["profiling_generation_s"] is None
    # discovery and profiling forwards of the text encoder and of each expert, and the VAE's one decode
    assert first["unplanned_forwards_by_component"] == {
        "text_encoder": 2,
        "transformer": 2,
        "transformer_2": 2,
        "vae": 1,
    }
    assert first["unplanned_forwards"] == 7 and first["total_s"] == first["generation_s"]
    index = json.loads((inline / "workloads.json").read_text())  # recorded after the real generation
    assert [entry["recipe"] for entry in index.values()] == ["wan22_t2v"]
    saved = run("saved", "--profile-dir", str(inline))
    assert saved["profiled_in"] == "saved profile" and saved["unplanned_forwards"] == 1  # the VAE only
    before = run("before", "--profile-dir", str(tmp_path / "before"), "--profiling-generation")
    assert before["profiled_in"] == "profiling generation" and before["profiling_generation_s"] > 0
    assert before["unplanned_forwards"] == 1 and before["total_s"] > before["generation_s"]
    native = run("native", "--no-offload")
    assert native["profiled_in"] is None and native["unplanned_forwards"] is None
    assert videos["first"] == videos["saved"] == videos["before"] == videos["native"]


def test_a_budget_the_profiled_activations_do_not_fit_is_refused_in_the_step_that_measured_them(pipe) -> None:
    """The expert's discovery and profiling forwards run in step 1 (cond, uncond); its shortfall refuses the next
    forward, step 2's, naming the smallest budget for the pipeline. The model is left as it was: offload enabled
    (every later call refused at once), disable restores every weight, and the named budget works."""
    reference = generate(pipe)
    before = {name: snapshot(m) for name, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    state = pipe.enable_flextensor_offload(budget=BUDGET, device="cpu")
    fatten(state.handles["transformer"])
    steps: list[int] = []
    with pytest.raises(
        ft.BudgetError, match=r"smallest workable budget for the whole pipeline is .*short: transformer"
    ):
        generate(pipe, steps)
    transformer = state.handles["transformer"]
    assert steps == [0] and transformer.phase is Phase.OVER_BUDGET
    assert transformer.counters["discovery"] == 1 and transformer.counters["profiling"] == 1
    assert transformer.counters["steady"] == 0 and state.handles["transformer_2"].counters["discovery"] == 0
    need = state.budget_error().required_bytes
    assert need >= transformer.smallest_budget() > BUDGET
    encoder_calls = dict(state.handles["text_encoder"].counters)
    with pytest.raises(ft.BudgetError, match="smallest workable budget"):  # again: before the first forward
        generate(pipe, steps)
    assert steps == [0] and state.handles["text_encoder"].counters == encoder_calls
    assert ft.pipeline_offload(pipe) is state
    pipe.disable_flextensor_offload()
    for name, snap in before.items():
        assert_same(snap, getattr(pipe, name))
    assert torch.equal(generate(pipe), reference)
    state = pipe.enable_flextensor_offload(budget=need, device="cpu")
    fatten(state.handles["transformer"])
    assert torch.equal(generate(pipe), reference)  # the budget named holds what was measured
    assert state.handles["transformer"].phase is Phase.STEADY
    pipe.disable_flextensor_offload()


def test_the_recipe_says_it_in_one_line_before_any_step(tmp_path, monkeypatch, capsys) -> None:
    """Every component measures `FAT` activations: the text encoder's profiling forward (the negative prompt) finds
    the shortfall, and the transformer's first forward is refused; one line names the smallest budget."""
    monkeypatch.setattr(Profiler, "end_forward", fat_activations(Profiler.end_forward))
    steps: list[int] = []
    real = wan22_t2v.generate

    def counted(*args, **kwargs):
        return real(*args, **kwargs, callback_on_step_end=lambda _p, step, _t, kw: steps.append(step) or kw)

    monkeypatch.setattr(wan22_t2v, "generate", counted)
    out = tmp_path / "x.mp4"
    with pytest.raises(SystemExit) as stopped:
        wan22_t2v.cli([*TINY_WAN_ARGV, "-q", "--output", str(out), "--profile-dir", str(tmp_path / "p")])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("error: --budget 250000 is too small for this pipeline: the smallest workable budget is ")
    assert steps == [] and not out.exists()


def decoder_and_encoder(handle: ft.OffloadHandle) -> tuple[list[int], list[int]]:
    units = handle.units
    return [u.index for u in units if u.name.startswith("decoder.")], [
        u.index for u in units if u.name.startswith("encoder.")
    ]


@pytest.mark.parametrize("budget", [400_000, BUDGET], ids=["decoder-within-a-quarter", "decoder-past-it"])
def test_an_unplanned_decode_loads_each_block_it_runs_once_within_a_quarter_of_the_budget(pipe, budget) -> None:
    """The VAE decodes 3 latent frames, calling each decoder block 3 times: through the one profiling slot each
    would load 3 times. Kept on the device at their first call, they load once, as natively, and the encoder's
    not at all; past a quarter of the budget the rest load on demand. The frames are the native ones."""
    reference = generate(pipe, output_type="np")
    state = pipe.enable_flextensor_offload(budget=budget, device="cpu")
    vae = state.handles["vae"]
    try:
        assert np.array_equal(generate(pipe, output_type="np"), reference)
        decoder, encoder = decoder_and_encoder(vae)
        copies = vae.device_copies
        kept = [i for i in decoder if copies.slot_of[i] is None]
        assert kept and all(copies.loads[i] == 1 for i in kept)
        assert all(copies.loads[i] == 0 for i in encoder)
        assert copies.device_bytes <= PROFILE_RESIDENT_SHARE * budget
        if budget == BUDGET:
            assert len(kept) < len(decoder) and max(copies.loads) == 3  # the rest through the slot
            return
        assert kept == decoder
        assert np.array_equal(generate(pipe, output_type="np"), reference)  # its profiling decode, kept again
        assert vae.phase is Phase.STEADY and all(copies.loads[i] == 2 for i in decoder)
        assert np.array_equal(generate(pipe, output_type="np"), reference)  # planned
    finally:
        pipe.disable_flextensor_offload()


def keeping_vae(vae: torch.nn.Module) -> ft.OffloadHandle:
    """The tiny VAE offloaded on CUDA (decode as its entry method) under a budget whose quarter holds its base, the
    profiling slot and every decoder block, but not every block: an unplanned decode keeps its decoder blocks."""
    from flextensor_diffusers.engine.planner import allocated

    handle = ft.offload(
        vae,
        include_patterns=autoencoder_patterns(vae),
        entry_methods=["decode"],
        gpu_budget=2**30,
        device="cuda",
        active_after_setup=False,  # laid out at the first decode, under the budget set below
    )
    decoder, _ = decoder_and_encoder(handle)
    slot = max(u.nbytes for u in handle.units)
    held = handle.resident_weight_bytes + slot + sum(allocated(handle.units[i].nbytes, 512) for i in decoder)
    budget = int(held / PROFILE_RESIDENT_SHARE) + 512
    assert handle.resident_weight_bytes + sum(u.nbytes for u in handle.units) > PROFILE_RESIDENT_SHARE * budget
    handle.set_budget(budget)
    return handle


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("keep", [True, False], ids=["kept", "through-the-slot"])
def test_a_profiled_decode_that_keeps_its_blocks_measures_the_same_activations(keep, monkeypatch) -> None:
    """Kept copies are the handle's own memory from the moment each is taken (`Profiler.own_bytes_grow`): a
    profiling decode that keeps its blocks measures the activations of the same decode through the one slot, and
    the same as the decode laid out all resident. Its frames are the native ones."""
    from flextensor_diffusers.engine import phases

    vae = build_pipeline("wan22_t2v", "tiny").vae.to("cuda")
    latents = torch.randn(1, vae.config.z_dim, 3, 4, 4, generator=torch.Generator().manual_seed(0)).to("cuda")
    with torch.inference_mode():
        reference = vae.decode(latents).sample
    vae.to("cpu")
    measured = {}
    # A first offload, not measured, makes what the engine and CUDA keep per process once used (measured as part of
    # "everything the process holds") exist before both measured layouts, in any test order.
    for layout in ("warm-up", "unplanned", "all resident"):
        handle = keeping_vae(vae)
        if not keep:
            monkeypatch.setattr(phases.Unplanned, "keeps", lambda self, index, in_workload: False)
        if layout == "all resident":
            handle.set_budget(2**30)  # a quarter holds every block: laid out resident, nothing kept or loaded
        with torch.inference_mode():
            assert torch.equal(vae.decode(latents).sample, reference)  # discovery
            handle.release()  # the profiling decode lays out afresh: it keeps its blocks again, measured
            assert torch.equal(vae.decode(latents).sample, reference)
        decoder, _ = decoder_and_encoder(handle)
        expected = 2 if keep or layout == "all resident" else 6  # 3 latent frames through the slot: 3 loads a decode
        if layout != "all resident":
            assert [handle.device_copies.loads[i] for i in decoder] == [expected] * len(decoder)
        measured[layout] = handle.profile.activation_peak_bytes
        handle.remove()
        monkeypatch.undo()
    assert abs(measured["unplanned"] - measured["all resident"]) <= 512 * len(vae.decoder.up_blocks) + 4096, measured
