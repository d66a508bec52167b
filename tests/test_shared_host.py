"""One host copy of the weights for several processes: a creator packs, followers attach."""

from __future__ import annotations

import json
import os
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flextensor_diffusers as ft
from tests.models import Stack

DIM, DEPTH = 512, 8  # 8 blocks of 8.4 MB: big enough to see whether a follower copies them
TOKENS = torch.arange(24).view(2, 12) % 50


def config(shared: ft.SharedHostMemory | None = None) -> ft.OffloadConfig:
    return ft.OffloadConfig(include_patterns=["blocks.*"], gpu_budget=40_000_000, device="cpu", shared_host=shared)


def rank_main(rank: int, tmp: str) -> None:
    tmp = Path(tmp)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=f"file://{tmp / 'pg'}", rank=rank, world_size=2)
    torch.manual_seed(0)
    if rank == 0:
        model = Stack(DIM, DEPTH).eval()
        with torch.inference_mode():
            native = model(TOKENS)
        torch.save({"native": native, "weights": model.state_dict()}, tmp / "native.pt")
    else:
        with torch.device("meta"):  # no weights of its own
            model = Stack(DIM, DEPTH).eval()
    proc = psutil.Process()
    before = proc.memory_full_info().uss
    handle = ft.offload_shared(model, config(), namespace="test", root=tmp)
    grown = proc.memory_full_info().uss - before
    with torch.inference_mode():
        outs = [model(TOKENS) for _ in range(3)]  # discovery, profiling, steady
    dist.barrier()
    reference = torch.load(tmp / "native.pt")
    result = {
        "equal": all(torch.equal(o, reference["native"]) for o in outs),
        "phase": handle.phase.value,
        "uss_growth": grown,
        "weights": sum(t.numel() * t.element_size() for t in reference["weights"].values()),
    }
    dist.barrier()  # the follower removes first: the creator deletes the files when it removes
    if rank == 1:
        handle.remove()
        restored = model.state_dict()
        result["restored"] = all(torch.equal(restored[k], v) for k, v in reference["weights"].items())
        result["restored_device"] = str(next(model.parameters()).device)
    dist.barrier()
    if rank == 0:
        handle.remove()
        result["files_left"] = (tmp / "flextensor-test").exists()
    (tmp / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def test_two_processes_share_one_host_copy_and_match_native(tmp_path) -> None:
    mp.spawn(rank_main, args=(str(tmp_path),), nprocs=2, join=True)
    creator, follower = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert creator["equal"] and follower["equal"]
    assert creator["phase"] == follower["phase"] == "steady"
    assert follower["uss_growth"] < 0.2 * follower["weights"]  # attached, not copied
    assert follower["restored"] and follower["restored_device"] == "cpu"
    assert creator["files_left"] is False


def test_attaching_needs_a_finished_creator_and_the_same_model(tmp_path) -> None:
    def shared(create: bool) -> ft.OffloadConfig:
        return config(ft.SharedHostMemory("x", create=create, root=tmp_path))

    with pytest.raises(ft.FlexTensorError, match="must finish offload\\(\\) first"):
        ft.offload(Stack(64, 2), shared(create=False))
    creator = ft.offload(Stack(64, 2), shared(create=True))
    with pytest.raises(ft.FlexTensorError, match="another model"):
        ft.offload(Stack(64, 3), shared(create=False))
    with pytest.raises(ft.FlexTensorError, match="already exist"):
        ft.offload(Stack(64, 2), shared(create=True))
    assert (tmp_path / "flextensor-x" / "manifest.json").exists()  # the refused creator deleted nothing
    creator.remove()
    assert not (tmp_path / "flextensor-x").exists()


def pipeline_rank(rank: int, tmp: str) -> None:
    from flextensor_diffusers.recipes.models import build_pipeline

    tmp = Path(tmp)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=f"file://{tmp / 'pg'}", rank=rank, world_size=2)
    kw = dict(prompt="a cat", num_frames=9, height=32, width=32, num_inference_steps=4, guidance_scale=4.0)

    def latents(pipe):
        return pipe(**kw, output_type="latent", generator=torch.Generator().manual_seed(0)).frames

    pipe = build_pipeline("wan22_t2v", "tiny", init_device="cpu" if rank == 0 else "meta")
    if rank == 0:
        torch.save(latents(pipe), tmp / "native.pt")
    pipe.enable_flextensor_offload(budget=250_000, device="cpu", shared_host="wan", shared_host_root=tmp)
    outs = [latents(pipe) for _ in range(2)]
    dist.barrier()
    native = torch.load(tmp / "native.pt")
    report = pipe.flextensor_report()["components"]
    result = {
        "equal": all(torch.equal(o, native) for o in outs),
        "streamed": report["transformer"]["streamed_units"],
        "shared_folders": sorted(p.name for p in tmp.glob("flextensor-*")),
    }
    (tmp / f"pipe{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def test_a_pipeline_on_the_meta_device_streams_the_creators_weights(tmp_path) -> None:
    mp.spawn(pipeline_rank, args=(str(tmp_path),), nprocs=2, join=True)
    creator, follower = (json.loads((tmp_path / f"pipe{r}.json").read_text()) for r in (0, 1))
    assert creator["equal"] and follower["equal"] and follower["streamed"] > 0
    components = ["text_encoder", "transformer", "transformer_2", "vae"]
    assert follower["shared_folders"] == sorted(f"flextensor-wan-{c}" for c in components)


def test_gpus_flag_launches_torchrun_and_names_the_fix_without_gpus(monkeypatch) -> None:
    from flextensor_diffusers.recipes import parallel, wan22_t2v

    cmd = parallel.torchrun_command("flextensor_diffusers.recipes.wan22_t2v", ["--gpus", "2"], 2)
    assert cmd[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m"]
    assert cmd[6:] == ["flextensor_diffusers.recipes.wan22_t2v", "--gpus", "2"]
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ft.NoCudaDeviceError, match="needs 2 CUDA devices on this host; found 0"):
        wan22_t2v.main(["--random-weights", "tiny", "--gpus", "2"])


def test_a_full_shared_memory_filesystem_is_refused_before_writing(tmp_path, monkeypatch) -> None:
    import shutil

    usage = type(shutil.disk_usage(tmp_path))  # the named tuple disk_usage returns
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    model = Stack(64, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ft.FlexTensorError, match="docker --shm-size"):
        ft.offload(model, config(ft.SharedHostMemory("full", create=True, root=tmp_path)))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())  # model as it was
