"""A host-memory budget: components that do not fit in RAM wait in cache files, outputs unchanged."""

from __future__ import annotations

import os

import pytest
import torch
from models import assert_same, snapshot, wan_latents

import flextensor_diffusers as ft
from flextensor_diffusers.models import build_pipeline

BUDGET = 250_000  # GPU budget: the transformer blocks stream


def packed_sizes(pipe) -> dict[str, int]:
    return {name: h.residency.packed_bytes for name, h in pipe._flextensor.handles.items()}


@pytest.fixture(scope="module")
def reference():
    pipe = build_pipeline("wan22_t2v", "tiny")
    return wan_latents(pipe)


def test_a_host_budget_under_the_weights_keeps_outputs_bitwise_equal(reference, tmp_path) -> None:
    pipe = build_pipeline("wan22_t2v", "tiny")
    before = {name: snapshot(getattr(pipe, name)) for name in ("text_encoder", "transformer", "transformer_2")}
    pipe.enable_flextensor_offload(budget=BUDGET, device="cpu")
    sizes = packed_sizes(pipe)
    pipe.disable_flextensor_offload()
    host_budget = max(sizes.values()) + 1  # the largest component fits, not two of the larger ones
    assert host_budget < sum(sizes.values()) - min(sizes.values())

    pipe.enable_flextensor_offload(budget=BUDGET, device="cpu", host_budget=host_budget, cache_dir=tmp_path)
    tier = pipe._flextensor.host_tier
    assert tier.ram_bytes() <= host_budget and tier.report()["on_disk"]  # set-up spilled as it packed
    outs = [wan_latents(pipe) for _ in range(3)]
    assert all(torch.equal(o, reference) for o in outs)
    report = pipe.flextensor_report()["host_tier"]
    assert report["peak_host_ram_bytes"] <= host_budget
    assert len(report["disk_reads_s"]) >= 3  # the experts took turns in RAM
    assert {c["host"] for c in pipe.flextensor_report()["components"].values()} == {"ram", "disk"}
    assert any(tmp_path.iterdir())
    pipe.disable_flextensor_offload()
    assert not any(tmp_path.iterdir())  # cache files deleted
    for name, snap in before.items():
        assert_same(snap, getattr(pipe, name))
    assert torch.equal(wan_latents(pipe), reference)


def test_an_edit_while_on_disk_reaches_the_file(tmp_path) -> None:
    """A state dict loaded into a component whose host copies wait on disk is what it computes with."""
    pipe = build_pipeline("wan22_t2v", "tiny")
    pipe.enable_flextensor_offload(budget=BUDGET, device="cpu")
    host_budget = max(packed_sizes(pipe).values()) + 1
    pipe.disable_flextensor_offload()
    pipe.enable_flextensor_offload(budget=BUDGET, device="cpu", host_budget=host_budget, cache_dir=tmp_path)
    wan_latents(pipe)
    on_disk = [n for n in pipe._flextensor.host_tier.report()["on_disk"] if n.startswith("transformer")]
    assert on_disk
    name = on_disk[0]
    torch.manual_seed(5)
    state = {k: v + 0.01 * torch.randn_like(v) for k, v in getattr(pipe, name).state_dict().items()}
    getattr(pipe, name).load_state_dict(state)

    native = build_pipeline("wan22_t2v", "tiny")
    getattr(native, name).load_state_dict(state)
    expected = wan_latents(native)
    assert all(torch.equal(wan_latents(pipe), expected) for _ in range(2))
    pipe.disable_flextensor_offload()


def test_a_host_budget_under_the_largest_component_names_the_smallest(tmp_path) -> None:
    pipe = build_pipeline("wan22_t2v", "tiny")
    before = snapshot(pipe.transformer)
    with pytest.raises(ft.HostBudgetError, match="smallest workable host budget") as raised:
        pipe.enable_flextensor_offload(budget=BUDGET, device="cpu", host_budget=1000, cache_dir=tmp_path)
    assert raised.value.required_bytes > 1000
    assert getattr(pipe, "_flextensor", None) is None
    assert_same(before, pipe.transformer)
    pipe.enable_flextensor_offload(
        budget=BUDGET, device="cpu", host_budget=raised.value.required_bytes, cache_dir=tmp_path
    )
    pipe.disable_flextensor_offload()


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_an_unwritable_cache_dir_is_refused_before_packing(tmp_path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    pipe = build_pipeline("wan22_t2v", "tiny")
    with pytest.raises(ft.FlexTensorError, match="not writable"):
        pipe.enable_flextensor_offload(budget=BUDGET, device="cpu", host_budget="1GiB", cache_dir=locked)


def test_a_cache_dir_that_is_a_file_is_refused_and_the_model_left_as_it_was(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    pipe = build_pipeline("wan22_t2v", "tiny")
    before = snapshot(pipe.transformer)
    with pytest.raises(ft.FlexTensorError, match="cache folder"):
        pipe.enable_flextensor_offload(budget=BUDGET, device="cpu", host_budget="1GiB", cache_dir=blocker / "x")
    assert getattr(pipe, "_flextensor", None) is None
    assert_same(before, pipe.transformer)


def test_a_full_disk_while_moving_a_component_out_is_a_clear_error(tmp_path, monkeypatch) -> None:
    """Writing the cache fails (disk full): the error names the fix and the model still computes."""
    from flextensor_diffusers.engine import residency

    pipe = build_pipeline("wan22_t2v", "tiny")
    reference = wan_latents(pipe)
    real_open = open

    def full_disk(path, mode="r", *args, **kwargs):
        if "w" in mode and str(path).endswith(".tmp"):
            raise OSError(28, "No space left on device")
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(residency, "open", full_disk, raising=False)
    with pytest.raises(ft.FlexTensorError, match=r"No space left.*cache_dir"):
        pipe.enable_flextensor_offload(budget=BUDGET, device="cpu", host_budget=400_000, cache_dir=tmp_path)
    assert getattr(pipe, "_flextensor", None) is None
    monkeypatch.undo()
    assert torch.equal(wan_latents(pipe), reference)


def test_the_recipe_names_the_host_budget_flag(tmp_path, capsys) -> None:
    from flextensor_diffusers.recipes import wan22_t2v

    argv = ["--random-weights", "tiny", "--device", "cpu", "-q", "--host-budget", "1KiB", "--cache-dir", str(tmp_path)]
    argv += ["--output", str(tmp_path / "x.mp4"), "--profile-dir", str(tmp_path / "p")]
    with pytest.raises(SystemExit):
        wan22_t2v.cli(argv)
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --host-budget 1KiB cannot hold the largest component")
    assert "; pass --host-budget 0." in err and len(err.splitlines()) == 1


def test_a_host_budget_with_compression_is_refused_for_now(tmp_path) -> None:
    pipe = build_pipeline("wan22_t2v", "tiny")
    with pytest.raises(ft.FlexTensorError, match="cannot be combined"):
        pipe.enable_flextensor_offload(
            budget="1GiB", device="cpu", host_budget="1GiB", cache_dir=tmp_path, compression="lossless"
        )
    assert getattr(pipe, "_flextensor", None) is None
