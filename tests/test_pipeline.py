"""The tiny Wan2.2 pipeline (both experts) offloaded on the CPU: numerics, restore, recipe, profiles."""

from __future__ import annotations

import json

import pytest
import torch

import flextensor_diffusers as ft
from flextensor_diffusers.media.video import read_mp4
from flextensor_diffusers.recipes import wan22_t2v
from flextensor_diffusers.recipes.models import build_pipeline
from flextensor_diffusers.recipes.options import OptionsError
from tests.models import (
    TINY_WAN_ARGV,
    assert_same,
    enable_with_one_component_in_ram,
    set_host_overhead,
    snapshot,
    wan_latents,
)

BUDGET = 250_000  # streams the transformer blocks; the tiny VAE and text encoder stay whole


@pytest.fixture(scope="module")
def pipe():
    return build_pipeline("wan22_t2v", "tiny")


def latents(pipe, **extra):
    return wan_latents(pipe, **extra)


def test_offloaded_latents_bitwise_equal_and_disable_restores(pipe) -> None:
    ref = latents(pipe)
    before = {name: snapshot(m) for name, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    pipe.enable_flextensor_offload(budget=BUDGET, device="cpu")
    state = ft.pipeline_offload(pipe)
    assert set(state.handles) == {"text_encoder", "transformer", "transformer_2", "vae"}
    outs = [latents(pipe) for _ in range(2)]
    assert all(torch.equal(o, ref) for o in outs)
    report = pipe.flextensor_report()
    for expert in ("transformer", "transformer_2"):
        component = report["components"][expert]
        assert component["phase"] == "steady" and component["streamed_units"] > 0
        assert component["forwards"]["discovery"] == 1 and component["forwards"]["profiling"] == 1
    assert sum(h.active for h in state.handles.values()) <= 1  # one component on the device at a time
    assert "transformer_2" in pipe.flextensor_report(as_text=True)
    pipe.disable_flextensor_offload()
    for name, snap in before.items():
        assert_same(snap, getattr(pipe, name))
    assert not hasattr(pipe.transformer, "_hf_hook") and "decode" not in vars(pipe.vae)
    assert torch.equal(latents(pipe), ref)


def test_profiles_are_reused_by_a_later_run(pipe, tmp_path) -> None:
    ref = latents(pipe)
    pipe.enable_flextensor_offload(budget=BUDGET, device="cpu", profile_dir=tmp_path)
    latents(pipe)
    pipe.disable_flextensor_offload()
    saved = sorted(p.parent.name for p in tmp_path.rglob("*.json"))
    assert saved == ["text_encoder", "transformer", "transformer_2"]

    pipe.enable_flextensor_offload(budget=BUDGET, device="cpu", profile_dir=tmp_path)
    assert torch.equal(latents(pipe), ref)
    for name in ("text_encoder", "transformer", "transformer_2"):
        forwards = pipe.flextensor_report()["components"][name]["forwards"]
        assert forwards["discovery"] == 0 and forwards["profiling"] == 0 and forwards["steady"] > 0
    pipe.disable_flextensor_offload()


def test_wrong_component_and_small_budget_are_clear_errors(pipe) -> None:
    before = snapshot(pipe.transformer)
    with pytest.raises(ft.FlexTensorError, match=r"unknown component\(s\) 'transfomer'.*transformer_2"):
        pipe.enable_flextensor_offload(budget=BUDGET, device="cpu", components=["transfomer"])
    with pytest.raises(ft.BudgetError, match=r"whole pipeline is .*transformer .*transformer_2") as raised:
        pipe.enable_flextensor_offload(budget=150_000, device="cpu")  # all components named at once
    assert raised.value.required_bytes > 150_000
    pipe.enable_flextensor_offload(budget=raised.value.required_bytes, device="cpu")  # the named budget works
    pipe.disable_flextensor_offload()
    assert ft.pipeline_offload(pipe) is None
    assert_same(before, pipe.transformer)
    assert not hasattr(pipe.text_encoder, "_hf_hook")


def test_pattern_overrides_are_used_as_given(pipe) -> None:
    ref = latents(pipe)
    pipe.enable_flextensor_offload(
        budget=400_000, device="cpu", patterns={"transformer": ["blocks.0", "blocks.1"], "text_encoder": []}
    )
    assert torch.equal(latents(pipe), ref)
    components = pipe.flextensor_report()["components"]
    assert components["transformer"]["units"] == 2 and components["text_encoder"]["units"] == 0
    pipe.disable_flextensor_offload()


def test_enabling_twice_is_refused(pipe) -> None:
    pipe.enable_flextensor_offload(budget=BUDGET, device="cpu")
    with pytest.raises(ft.OffloadStateError, match="already enabled"):
        pipe.enable_flextensor_offload(budget=BUDGET, device="cpu")
    pipe.disable_flextensor_offload()


def test_native_placement_makes_the_offloaded_runs_vae_tiling_choice(pipe) -> None:
    """Tiled and untiled VAE passes differ: a compared native run must tile exactly when offload does."""
    from flextensor_diffusers.recipes import common

    for budget, tiled in (("1GiB", True), ("64GiB", False)):
        args = wan22_t2v.parse_args([*TINY_WAN_ARGV, "--budget", budget])
        pipe.vae.disable_tiling()
        common.place_natively(pipe, args, torch.device("cpu"))
        assert pipe.vae.use_tiling is tiled
        pipe.vae.disable_tiling()
        state = pipe.enable_flextensor_offload(budget=budget, device="cpu", vae_tiling=args.vae_tiling_choice)
        assert state.vae_tiling is tiled and pipe.vae.use_tiling is tiled
        pipe.disable_flextensor_offload()
        assert not pipe.vae.use_tiling


def test_unknown_model_gets_its_largest_block_list() -> None:
    from flextensor_diffusers.pipelines import patterns_for

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.small = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(3)])
            self.layers = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(4)])

    assert patterns_for("x", Net()) == ["layers.*"]
    assert patterns_for("x", torch.nn.Linear(3, 3)) == []


def test_recipe_writes_mp4_and_skips_profiling_next_time(tmp_path, capsys) -> None:
    assert TINY_WAN_ARGV[TINY_WAN_ARGV.index("--budget") + 1] == str(BUDGET)
    argv = [
        *TINY_WAN_ARGV,
        "--profile-dir",
        str(tmp_path / "p"),
        "--output",
        str(tmp_path / "out.mp4"),
        "--json",
        str(tmp_path / "run.json"),
    ]
    first = wan22_t2v.run(wan22_t2v.parse_args(argv))
    video = read_mp4(tmp_path / "out.mp4")
    assert video.shape == (9, 32, 32, 3)
    assert first["profiling_generation_s"] is None and first["profiled_in"] == "generation"  # no generation before
    second = wan22_t2v.run(wan22_t2v.parse_args(argv))
    assert second["profiled_in"] == "saved profile"  # a matching profile existed
    forwards = second["offload_report"]["components"]["transformer"]["forwards"]
    assert forwards["discovery"] == 0 and forwards["profiling"] == 0
    assert second["unplanned_forwards_by_component"] == {
        "text_encoder": 0,
        "transformer": 0,
        "transformer_2": 0,
        "vae": 1,
    }
    assert json.loads((tmp_path / "run.json").read_text())["frames"] == 9
    assert "peak allocated GPU memory n/a (CPU)" in capsys.readouterr().out


def test_recipe_without_weights_says_how_to_get_them(capsys) -> None:
    with pytest.raises(OptionsError) as info:
        wan22_t2v.parse_args([])
    assert "--random-weights tiny|full" in str(info.value) and "--model PATH" in str(info.value)


def test_model_path_without_model_index_is_explained(tmp_path) -> None:
    with pytest.raises(OptionsError, match=r"--model .* \(no model_index.json\).*--random-weights"):
        wan22_t2v.parse_args(["--model", str(tmp_path), "--device", "cpu"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pipeline_on_cuda_is_bitwise_native(pipe) -> None:
    pipe.to("cuda")
    ref = latents(pipe).cpu()
    pipe.to("cpu")
    pipe.enable_flextensor_offload(budget="64MiB", device="cuda")
    outs = [latents(pipe).cpu() for _ in range(2)]
    assert all(torch.equal(o, ref) for o in outs)
    report = pipe.flextensor_report()
    assert report["peak_allocated_bytes"] is not None and report["components"]["transformer"]["phase"] == "steady"
    pipe.disable_flextensor_offload()
    assert all(p.device.type == "cpu" for p in pipe.transformer.parameters())


@pytest.mark.parametrize("host_tier", [False, True], ids=["all-in-ram", "one-expert-on-disk"])
def test_ctrl_c_during_disable_keeps_outputs_native_and_disable_finishes_later(
    host_tier: bool, tmp_path, monkeypatch
) -> None:
    """Ctrl-C while `disable_flextensor_offload` puts the weights back (in the second expert, say): the
    interrupt reaches the caller as it is, the pipeline still computes bitwise as natively (the units not
    restored yet stream on demand), and calling disable again finishes the job, every tensor as before."""
    from flextensor_diffusers.storage import host_copies

    pipe = build_pipeline("wan22_t2v", "tiny")
    reference = latents(pipe)
    before = {name: snapshot(m) for name, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    if host_tier:
        set_host_overhead(monkeypatch, own=0, reserve=0)
        enable_with_one_component_in_ram(pipe, BUDGET, tmp_path)
    else:
        pipe.enable_flextensor_offload(budget=BUDGET, device="cpu")
    latents(pipe)
    real_restore = host_copies.restore_unit
    second_expert = set(pipe.transformer_2.modules())
    interrupted = []

    def interrupted_restore(unit) -> None:
        if unit.module in second_expert and not interrupted:  # the second expert's first unit, once
            interrupted.append(unit.name)
            raise KeyboardInterrupt
        real_restore(unit)

    monkeypatch.setattr(host_copies, "restore_unit", interrupted_restore)
    with pytest.raises(KeyboardInterrupt):
        pipe.disable_flextensor_offload()
    monkeypatch.setattr(host_copies, "restore_unit", real_restore)
    assert interrupted and ft.pipeline_offload(pipe) is not None
    assert all(torch.equal(latents(pipe), reference) for _ in range(2))
    pipe.disable_flextensor_offload()
    assert ft.pipeline_offload(pipe) is None
    for name, snap in before.items():
        assert_same(snap, getattr(pipe, name))
    assert torch.equal(latents(pipe), reference)
    assert not any(tmp_path.iterdir())
