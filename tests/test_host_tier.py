"""A host-memory budget: components that do not fit in RAM wait in cache files, outputs unchanged."""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from models import assert_same, snapshot, wan_latents

import flextensor_diffusers as ft
from flextensor_diffusers.models import build_pipeline
from flextensor_diffusers.pipelines.weight_files import WeightSource, read_entries

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


# ---------------------------------------------------------------------------------------- weight files
#
# A pipeline loaded with ``from_pretrained`` from a local folder waits on disk in its own safetensors
# files: nothing is written to the cache folder, and nothing ever to the model folder.

#: Wider experts than the tiny config (73 MB each instead of 0.36 MB), so that the process's anonymous
#: memory can be measured against the host budget above the noise of Python and the allocator.
WIDE_EXPERT = {"num_attention_heads": 4, "attention_head_dim": 128, "ffn_dim": 2048}
#: Anonymous memory besides the host copies (and the budget-sized device copies: on the CPU the "device"
#: is host RAM too): activations, Python, the allocator. Measured 6 MiB on the wide pipeline, steady over
#: runs, with large allocations always mapped (see `measure_anonymous_memory`).
ANON_SLACK = 16 * 2**20


def digest(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder``: the user's folder must stay byte-identical."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def rss_anon() -> int:
    """The process's anonymous resident memory (RssAnon of /proc/self/status), bytes."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))


class AnonPeak:
    """The highest `rss_anon` seen while the block runs, sampled every millisecond on a thread."""

    def __enter__(self) -> AnonPeak:
        self.peak = rss_anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, rss_anon())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon())


def save(folder: Path, shard: str, expert: dict | None = None) -> Path:
    """The tiny Wan2.2 pipeline (experts widened by ``expert``) saved with ``save_pretrained``, sharded."""
    from flextensor_diffusers import models

    real = models.load_config

    def config(model: str, size: str) -> dict:
        cfg = real(model, size)
        for name in ("transformer", "transformer_2"):
            cfg[name].update(expert or {})
        return cfg

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(models, "load_config", config)
        build_pipeline("wan22_t2v", "tiny").save_pretrained(folder, max_shard_size=shard)
    return folder


def load(folder: Path):
    from diffusers import WanPipeline

    return WanPipeline.from_pretrained(folder)


def smallest_budgets(pipe, cache: Path) -> tuple[int, int]:
    """The smallest workable GPU and host budgets, from the errors that name them (nothing is packed)."""
    with pytest.raises(ft.BudgetError) as gpu:
        pipe.enable_flextensor_offload(budget=1, device="cpu")
    with pytest.raises(ft.HostBudgetError) as host:
        pipe.enable_flextensor_offload(budget=gpu.value.required_bytes, device="cpu", host_budget=1, cache_dir=cache)
    return gpu.value.required_bytes, host.value.required_bytes


def tier_of(pipe):
    return pipe._flextensor.host_tier


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, torch.Tensor]:
    """The tiny pipeline's folder (the experts in two shards each) and its native latents."""
    folder = save(tmp_path_factory.mktemp("tiny") / "wan22", "200KB")
    return folder, wan_latents(load(folder))


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> tuple[Path, torch.Tensor]:
    """The wide pipeline's folder (each expert in four shards) and its native latents."""
    folder = save(tmp_path_factory.mktemp("wide") / "wan22", "20MB", WIDE_EXPERT)
    return folder, wan_latents(load(folder))


def test_a_pipeline_loaded_from_a_folder_waits_in_its_own_files(wide, tmp_path) -> None:
    """One expert in RAM at a time, the other in its own (sharded) weight files: three generations
    bitwise equal to native, no cache file written, the high-noise expert read ahead while the text
    encoder runs, and the user's folder byte-identical after all of it, disable included."""
    folder, reference = wide
    before = digest(folder)
    pipe = load(folder)
    cache = tmp_path / "cache"
    gpu, host = smallest_budgets(pipe, cache)
    pipe.enable_flextensor_offload(budget=gpu, device="cpu", host_budget=host + 2**20, cache_dir=cache)
    report = tier_of(pipe).report()
    assert {c["source"] for c in report["components"].values()} == {"weights files"}
    outs = [wan_latents(pipe) for _ in range(3)]
    assert all(torch.equal(o, reference) for o in outs)
    assert not any(cache.iterdir())  # nothing written for components that wait in their own files
    report = pipe.flextensor_report()["host_tier"]
    assert report["peak_host_ram_bytes"] <= host + 2**20
    assert {"transformer", "transformer_2"} & set(report["on_disk"])
    assert report["components"]["transformer"]["reads"] >= 3 and report["disk_read_gbps"] > 0
    assert any(s["prefetched"] and s["component"] == "transformer" for s in report["switches"])
    text = pipe.flextensor_report(as_text=True)
    assert "weights files" in text and "GB/s" in text
    pipe.disable_flextensor_offload()
    assert torch.equal(wan_latents(pipe), reference)
    assert digest(folder) == before


def measure_anonymous_memory(folder: str, out: str) -> None:
    """Run in a fresh process: RssAnon growth from a pipeline just loaded (its weights mapped from the
    files, not anonymous) to right after enabling offload, and its peak over three generations (sampled
    every millisecond). Written to ``out`` as JSON with the budgets and what the cache folder holds."""
    import json

    pipe = load(Path(folder))
    cache = Path(out).parent / "cache"
    gpu, host = smallest_budgets(pipe, cache)
    host_budget = host + 2**20  # one expert and the small components: the other expert waits on disk
    before = rss_anon()
    with AnonPeak() as peak:
        pipe.enable_flextensor_offload(budget=gpu, device="cpu", host_budget=host_budget, cache_dir=cache)
        enabled = rss_anon() - before
        for _ in range(3):
            wan_latents(pipe)
    result = {
        "enabled": enabled,
        "peak": peak.peak - before,
        "host_budget": host_budget,
        "gpu_budget": gpu,
        "expert": max(h.residency.packed_bytes for h in pipe._flextensor.handles.values()),
        "cache_files": [p.name for p in cache.iterdir()],
    }
    pipe.disable_flextensor_offload()
    Path(out).write_text(json.dumps(result))


def test_anonymous_memory_stays_within_the_host_budget(wide, tmp_path) -> None:
    """Right after enabling, the process's anonymous memory has grown by at most the host budget plus
    `ANON_SLACK`; over three generations by at most that plus the device copies (the CPU is the device
    here). Measured in a fresh process whose allocator maps every allocation over 1 MiB, so that freed
    buffers leave (glibc's moving threshold would keep freed 16 MB blocks in its heaps; real blocks of
    hundreds of MB are always mapped)."""
    import json
    import subprocess
    import sys

    out = tmp_path / "anon.json"
    code = f"import test_host_tier as t; t.measure_anonymous_memory({str(wide[0])!r}, {str(out)!r})"
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20), "PYTHONPATH": str(Path(__file__).parent)}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, timeout=300)
    r = json.loads(out.read_text())
    assert r["cache_files"] == []
    assert r["expert"] <= r["enabled"] <= r["host_budget"] + ANON_SLACK, r  # one expert in RAM, not two
    assert r["peak"] <= r["host_budget"] + r["gpu_budget"] + ANON_SLACK, r


def slow_reads(monkeypatch, component: str, seconds: float) -> None:
    """Reading ``component`` from its weight files takes ``seconds`` longer (one sleep per read)."""
    real = WeightSource.read_into

    def read_into(self, position, buffer):
        if self.component == component and position == 0:
            time.sleep(seconds)
        real(self, position, buffer)

    monkeypatch.setattr(WeightSource, "read_into", read_into)


def test_the_next_component_is_read_while_the_one_before_runs(saved, tmp_path, monkeypatch) -> None:
    """While the text encoder runs (made slow), the high-noise expert is read on the prefetch thread
    (made slow): its switch waits for less than the read took; outputs stay bitwise equal."""
    folder, reference = saved
    pipe = load(folder)
    cache = tmp_path / "cache"
    gpu, host = smallest_budgets(pipe, cache)
    host_budget = host + 300_000  # an expert with the text encoder and the VAE; never both experts
    pipe.enable_flextensor_offload(budget=gpu, device="cpu", host_budget=host_budget, cache_dir=cache)
    slow_reads(monkeypatch, "transformer", 0.3)
    pipe.text_encoder.register_forward_hook(lambda *_: time.sleep(0.15))  # runs while it is active
    outs = [wan_latents(pipe) for _ in range(3)]
    assert all(torch.equal(o, reference) for o in outs)
    report = pipe.flextensor_report()["host_tier"]
    ahead = [s for s in report["switches"] if s["prefetched"] and s["component"] == "transformer"]
    assert len(ahead) == 3
    assert all(s["read_s"] >= 0.3 and s["wait_s"] < s["read_s"] / 2 for s in ahead), ahead
    assert report["hidden_s"] >= 0.45 and report["peak_host_ram_bytes"] <= host_budget
    assert not any(cache.iterdir())
    pipe.disable_flextensor_offload()


@pytest.mark.parametrize("read_ahead", [False, True], ids=["read-when-needed", "read-ahead"])
def test_a_changed_weight_file_is_refused_and_offload_still_disables(saved, tmp_path, read_ahead) -> None:
    """A weight file touched after offload was enabled: the read of its component is refused with a
    one-line error naming the file and the fix (on the prefetch thread: raised when it is needed); the
    pipeline still disables, and computes as before."""
    folder = shutil.copytree(saved[0], tmp_path / "wan22")
    reference = saved[1]
    pipe = load(folder)
    cache = tmp_path / "cache"
    gpu, host = smallest_budgets(pipe, cache)
    host_budget = host + (300_000 if read_ahead else 0)
    pipe.enable_flextensor_offload(budget=gpu, device="cpu", host_budget=host_budget, cache_dir=cache)
    assert torch.equal(wan_latents(pipe), reference)
    assert "transformer" in tier_of(pipe).report()["on_disk"]
    touched = sorted((folder / "transformer").glob("*.safetensors"))[-1]
    stat = touched.stat()
    os.utime(touched, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    with pytest.raises(ft.FlexTensorError) as raised:
        wan_latents(pipe)
    message = str(raised.value)
    assert f"the weight file {touched} changed since offload was enabled" in message
    assert "disable_flextensor_offload() and enable it again" in message and "\n" not in message
    assert "transformer" in tier_of(pipe).report()["on_disk"]  # left as it was
    pipe.disable_flextensor_offload()
    assert torch.equal(wan_latents(pipe), reference)
    assert not any(cache.iterdir())


def test_an_edit_while_in_the_weight_files_reaches_outputs_and_then_a_cache_file(saved, tmp_path) -> None:
    """``load_state_dict`` into an expert that waits in its weight files lands in private copy-on-write
    pages (never in the files); it computes with the edit, and its next move out writes a cache file."""
    folder, _ = saved
    before = digest(folder)
    pipe = load(folder)
    cache = tmp_path / "cache"
    gpu, host = smallest_budgets(pipe, cache)
    pipe.enable_flextensor_offload(budget=gpu, device="cpu", host_budget=host, cache_dir=cache)
    wan_latents(pipe)
    assert "transformer" in tier_of(pipe).report()["on_disk"]
    torch.manual_seed(5)
    state = {k: v + 0.01 * torch.randn_like(v) for k, v in pipe.transformer.state_dict().items()}
    pipe.transformer.load_state_dict(state)
    assert digest(folder) == before
    native = load(folder)
    native.transformer.load_state_dict(state)
    expected = wan_latents(native)
    assert all(torch.equal(wan_latents(pipe), expected) for _ in range(2))
    report = tier_of(pipe).report()["components"]
    assert report["transformer"]["source"] == "cache file" and report["transformer_2"]["source"] == "weights files"
    assert [p.name for p in cache.iterdir()] and all(p.name.startswith("transformer-") for p in cache.iterdir())
    pipe.disable_flextensor_offload()
    assert torch.equal(wan_latents(pipe), expected)
    assert digest(folder) == before


def test_a_direct_write_into_an_expert_waiting_in_its_files_is_kept(saved, tmp_path) -> None:
    """A write into an inactive expert's tensor outside the edit methods, while it waits in its weight
    files, lands in copy-on-write pages: the read back sees it (and takes the bytes from there)."""
    folder, _ = saved
    pipe = load(folder)
    cache = tmp_path / "cache"
    gpu, host = smallest_budgets(pipe, cache)
    pipe.enable_flextensor_offload(budget=gpu, device="cpu", host_budget=host, cache_dir=cache)
    wan_latents(pipe)
    assert "transformer" in tier_of(pipe).report()["on_disk"]
    with torch.no_grad():
        pipe.transformer.proj_out.bias.data.add_(0.5)
    native = load(folder)
    with torch.no_grad():
        native.transformer.proj_out.bias.add_(0.5)
    expected = wan_latents(native)
    assert all(torch.equal(wan_latents(pipe), expected) for _ in range(2))
    assert tier_of(pipe).report()["components"]["transformer"]["source"] == "cache file"
    pipe.disable_flextensor_offload()


def test_weights_converted_at_load_wait_in_cache_files(saved, tmp_path) -> None:
    """Loaded as bfloat16 from float32 files: the bytes in RAM are not the files' bytes, so each
    component moved out gets a cache file, and outputs stay equal to native."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(saved[0], dtype=torch.bfloat16)
    reference = wan_latents(pipe)
    cache = tmp_path / "cache"
    gpu, host = smallest_budgets(pipe, cache)
    pipe.enable_flextensor_offload(budget=gpu, device="cpu", host_budget=host, cache_dir=cache)
    assert {c["source"] for c in tier_of(pipe).report()["components"].values()} == {"cache file"}
    assert torch.equal(wan_latents(pipe), reference)
    assert any(cache.iterdir())
    pipe.disable_flextensor_offload()


def test_safetensors_headers_are_read_as_safetensors_reads_them(saved) -> None:
    from safetensors import safe_open

    for path in (saved[0] / "transformer").glob("*.safetensors"):
        entries = read_entries(path)
        raw = path.read_bytes()
        with safe_open(path, "pt") as file:
            assert set(file.keys()) == set(entries)
            for key in file.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensor, entry = file.get_tensor(key), entries[key]
                assert entry.nbytes == tensor.numel() * tensor.element_size()
                assert (
                    raw[entry.start : entry.start + entry.nbytes]
                    == tensor.contiguous().view(torch.uint8).numpy().tobytes()
                )
