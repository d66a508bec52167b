"""The first enable under a host budget with compression (issue 48): enable packs each block and hands its raw bytes
to where they wait on disk at once (the weight files it was loaded from), encodes nothing, and returns; the first
forwards stream the raw bytes from there while the blocks are encoded between forwards, within the host budget; the
payloads take over once all are made (each proven at its first decoded load), the payload file is written, and the
next enable reads it. Outputs stay bitwise equal to native throughout, edits included.

The handles' clock moves only when a test says (`tests.clocks`): no forward takes any time by it and each block
encoded takes a second, so every gap between forwards encodes exactly one block, whatever the machine's speed."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import flextensor_diffusers as ft
from flextensor_diffusers.recipes.models import build_pipeline
from flextensor_diffusers.storage import arrivals
from flextensor_diffusers.storage.host_bytes import InPayloadsOnly, InRam
from tests.clocks import ManualClock, drive_handles_by, encoding_takes
from tests.models import assert_same, set_host_overhead, snapshot, wan_latents
from tests.test_compression import planned_from_fixed_figures
from tests.test_host_tier import digest, load, save

BUDGET = 340_000  # GPU budget: the blocks stream compressed (2 slots with staging room)
EXPERTS = ("transformer", "transformer_2")
ENCODED = ("text_encoder", *EXPERTS)  # the components a latent generation runs (not the VAE)


@pytest.fixture(autouse=True)
def one_block_a_gap(monkeypatch) -> ManualClock:
    """Host budgets in the host copies' bytes (no process overhead, no reserve); fixed plans; each gap between
    forwards encodes one block (see the module docstring)."""
    set_host_overhead(monkeypatch, own=0, reserve=0)
    planned_from_fixed_figures(monkeypatch, compute_ms=10.0)
    clock = ManualClock()
    drive_handles_by(monkeypatch, clock)
    encoding_takes(monkeypatch, clock, 1.0)
    return clock


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, torch.Tensor]:
    """The tiny pipeline's folder (the experts in two shards each) and its native latents."""
    folder = save(tmp_path_factory.mktemp("tiny") / "wan22", "200KB")
    return folder, wan_latents(load(folder))


def enable(pipe, cache: Path, host_budget: int | str = "1GiB", **options: object) -> ft.PipelineOffload:
    pipe.enable_flextensor_offload(
        budget=BUDGET,
        device="cpu",
        compression="lossless",
        host_budget=host_budget,
        cache_dir=cache,
        background_encoding=True,
        **options,
    )
    return ft.pipeline_offload(pipe)


class Watch:
    """What each component's host copies looked like as each of its forwards began, and the host tier's count of RAM
    against its share at every block call."""

    def __init__(self, state: ft.PipelineOffload) -> None:
        self.state = state
        self.at_forward: dict[str, list[tuple[int, int]]] = {name: [] for name in state.handles}
        #: Per component, as each forward began while its blocks were encoded: (payloads made and not kept yet, the
        #: payloads' RAM its host copies count).
        self.counted: dict[str, list[tuple[int, int]]] = {name: [] for name in state.handles}
        self.over_share: list[int] = []
        self._hooks = []
        for name, handle in state.handles.items():
            self._hooks.append(handle.model.register_forward_pre_hook(lambda *_, name=name: self._forward(name)))
            self._hooks += [u.module.register_forward_pre_hook(lambda *_: self._block()) for u in handle.units]

    def stop(self) -> None:
        for hook in self._hooks:
            hook.remove()

    def _forward(self, name: str) -> None:
        """(units encoded between forwards so far, payloads kept)."""
        host = self.state.handles[name].host
        current = host.compressed.arrivals.current
        encoding = isinstance(current, arrivals.EncodingBetweenForwards)
        self.at_forward[name].append((current.encoded_units if encoding else -1, len(host.encoded)))
        if encoding:
            self.counted[name].append((current.made_bytes, host.where().ram_compressed_bytes))

    def _block(self) -> None:
        tier = self.state.host_tier
        if tier is not None and tier.ram_bytes() > tier.weights_budget:
            self.over_share.append(tier.ram_bytes())


def all_kept(state: ft.PipelineOffload) -> bool:
    """Every component the generations ran has its payloads kept and proven."""
    hosts = [state.handles[name].host for name in ENCODED]
    return all(h.encoded and not h.compressed.arriving and not h.compressed.unproven for h in hosts)


def generate_until_kept(pipe, state: ft.PipelineOffload, expected: torch.Tensor, tries: int) -> None:
    """Generations bitwise equal to ``expected`` until every payload is kept and proven (at most ``tries``), then one
    more from the kept payloads."""
    for _ in range(tries):
        assert torch.equal(wan_latents(pipe), expected)
        if all_kept(state):
            break
    assert all_kept(state) and torch.equal(wan_latents(pipe), expected)


def test_the_first_forwards_run_before_any_block_is_encoded_bitwise_within_the_host_budget(saved, tmp_path) -> None:
    """Enable encodes nothing: every block's raw bytes wait in the weight files (nothing raw is written), RAM holds no
    payload. Each component's first forward runs with none of its blocks encoded, each later one with one more (one
    a gap); the payloads made meanwhile are counted in the host tier's RAM, which stays within its share at every
    block call. Once all are made they are kept (at the end of that gap) and proven, and the plans decode them;
    every generation is bitwise equal to native's. The payload files are written, and the next enable reads them
    instead of encoding."""
    folder, reference = saved
    before_folder = digest(folder)
    pipe = load(folder)
    cache = tmp_path / "cache"
    state = enable(pipe, cache)
    for name in ENCODED:
        host = state.handles[name].host
        places = host.where()
        assert not host.encoded and host.compressed.encoding_between_forwards
        assert places.ram_compressed_bytes == 0 and places.raw_disk_bytes == sum(u.nbytes for u in host.units)
    assert not any(p.suffix == ".raw" for p in cache.iterdir())  # the weight files hold the raw bytes
    watch = Watch(state)
    assert torch.equal(wan_latents(pipe), reference)
    for name in ENCODED:
        seen = watch.at_forward[name]
        assert seen[0] == (0, 0), (name, seen)  # its first forward: nothing encoded
        encoded = [e for e, _ in seen if e >= 0]
        assert encoded == list(range(len(encoded))), (name, seen)  # one block a gap
    for name in EXPERTS:  # the payloads made and not kept yet are the host copies' RAM, counted by the tier
        made, counted = zip(*watch.counted[name], strict=True)
        assert made == counted and made[0] == 0 and made[-1] > 0, (name, watch.counted[name])
    generate_until_kept(pipe, state, reference, 4)
    assert all(state.handles[n].device_copies.decoding for n in EXPERTS)
    assert not watch.over_share
    assert state.host_tier.report()["peak_host_ram_bytes"] <= state.host_tier.weights_budget
    watch.stop()
    pipe.disable_flextensor_offload()  # waits for the payload files' writes
    assert {p.suffix for p in cache.iterdir()} == {".payloads"}
    state = enable(pipe, cache)
    assert all(state.handles[n].payload_cache.status == "read" for n in ENCODED)  # read at enable, not encoded
    assert all(state.handles[n].host.encoded for n in ENCODED)
    assert torch.equal(wan_latents(pipe), reference)
    pipe.disable_flextensor_offload()
    assert digest(folder) == before_folder


def test_an_edit_while_blocks_are_encoded_begins_the_encoding_again_and_the_outputs_follow_it(saved, tmp_path) -> None:
    """An expert edited (``load_state_dict``) after a generation encoded some of its blocks: the payloads made before
    are of the old weights and are dropped, the encoding begins again from its first block with the edited bytes
    (which leave the weight files' written pages for a cache file), and every generation, while it is encoded, once
    its payloads are proven and after, is bitwise equal to native's with the same edit; so is ``state_dict()``."""
    folder, _ = saved
    pipe = load(folder)
    cache = tmp_path / "cache"
    state = enable(pipe, cache, raw_copies="disk")  # the edited bytes' raw home: a cache file
    wan_latents(pipe, num_inference_steps=2)  # a step for each expert: two forwards, two of its four blocks encoded
    name = "transformer"
    encoding = state.handles[name].host.compressed.arrivals.current
    assert isinstance(encoding, arrivals.EncodingBetweenForwards) and 0 < encoding.encoded_units < 4
    edited = edit(getattr(pipe, name), seed=5)
    assert state.handles[name].host.compressed.arrivals.current is encoding and encoding.encoded_units == 0
    assert ".raw" in {p.suffix for p in cache.iterdir()}  # the written pages of the weight files moved out of RAM
    native = load(folder)
    getattr(native, name).load_state_dict(edited)
    expected = wan_latents(native)
    generate_until_kept(pipe, state, expected, 4)
    assert all(torch.equal(t, edited[k]) for k, t in getattr(pipe, name).state_dict().items())
    pipe.disable_flextensor_offload()
    assert all(torch.equal(t, edited[k]) for k, t in getattr(pipe, name).state_dict().items())


def test_payloads_only_an_edit_while_blocks_are_encoded_leaves_the_edited_blocks_their_payloads_alone_once_proven(
    saved, tmp_path
) -> None:
    """The same edit under the default ``raw_copies="none"``: the edited blocks leave the weight files' written pages
    for RAM (no file holds them; nothing raw is written to disk), raw there beside their payloads only until those
    are kept and proven at their first decoded load; then they go back to their payloads alone, as set-up leaves a
    block no file holds: read-guarded stand-ins, their RAM buffers gone, the host tier's count down by their raw
    bytes. Every generation (while encoded, as they are released, after), ``state_dict()``, a later edit and disable
    are bitwise native's with the same edits. On the old code they stayed raw in RAM beside their payloads for good."""
    folder, _ = saved
    pipe = load(folder)
    cache = tmp_path / "cache"
    state = enable(pipe, cache)
    wan_latents(pipe, num_inference_steps=2)  # two of the expert's four blocks encoded
    name = "transformer"
    host = state.handles[name].host
    assert state.handles[name].config.storage.raw_copies == "none"
    edited = edit(getattr(pipe, name), seed=5)
    assert host.compressed.encoding_between_forwards and not host.encoded
    assert all(isinstance(u.stored, InRam) for u in host.units)  # every block written: out of its files, into RAM
    raw_bytes = sum(u.nbytes for u in host.units)
    native = load(folder)
    getattr(native, name).load_state_dict(edited)
    expected = wan_latents(native)
    kept = None  # (the tier's RAM, the expert's) once its payloads are kept, before any is proven
    for _ in range(6):
        if kept is None and host.encoded and not host.compressed.arriving:
            assert host.compressed.unproven == set(host.encoded)
            assert all(isinstance(u.stored, InRam) for u in host.units)  # kept, none proven: raw in RAM still
            kept = (state.host_tier.ram_bytes(), host.host_ram_bytes)
        assert torch.equal(wan_latents(pipe), expected)
        if all_kept(state):
            break
    assert all_kept(state) and kept is not None and set(host.encoded) == {u.index for u in host.units}
    assert all(isinstance(u.stored, InPayloadsOnly) for u in host.units)
    assert host.host_ram_bytes == kept[1] - raw_bytes and host.where().payloads_only_bytes == raw_bytes
    assert state.host_tier.ram_bytes() <= kept[0] - raw_bytes
    assert all(torch.equal(wan_latents(pipe), expected) for _ in range(2))
    assert all(torch.equal(t, edited[k]) for k, t in getattr(pipe, name).state_dict().items())
    again = edit(getattr(pipe, name), seed=6)  # as any block kept as its payload only: decoded, edited, encoded
    getattr(native, name).load_state_dict(again)
    assert all(isinstance(u.stored, InPayloadsOnly) for u in host.units)
    assert torch.equal(wan_latents(pipe), wan_latents(native))
    assert not any(p.suffix == ".raw" for p in cache.iterdir())
    pipe.disable_flextensor_offload()
    assert all(torch.equal(t, again[k]) for k, t in getattr(pipe, name).state_dict().items())


def edit(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Load into ``model`` (``load_state_dict``) its weights each moved by a little seeded noise; what it loaded."""
    torch.manual_seed(seed)
    edited = {k: v + 0.01 * torch.randn_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(edited)
    return edited


def test_under_a_tight_host_budget_the_experts_take_turns_and_the_encoding_makes_room_within_it(
    saved, tmp_path
) -> None:
    """A host budget with room for one expert's payloads and the encoder's working memory, not both experts': each
    expert is encoded between its forwards within the budget, the first one moved out to its payload file to make
    room for the second's; generations are bitwise, the tier's RAM within its share at every block call, and both
    experts end kept, proven, taking turns on disk."""
    folder, reference = saved
    pipe = load(folder)
    cache = tmp_path / "cache"
    state = enable(pipe, cache)
    while not all_kept(state):
        wan_latents(pipe)
    payloads = {n: h.host.compressed.stored_bytes for n, h in state.handles.items()}
    raw = {n: h.host.where().ram_raw_bytes for n, h in state.handles.items()}
    largest = max(u.nbytes for n in ENCODED for u in state.handles[n].units)
    pipe.disable_flextensor_offload()
    for path in cache.iterdir():
        path.unlink()  # no payload file: the next enable encodes again
    working = arrivals.ENCODER_HOST_UNITS * largest
    host_budget = max(payloads[n] + sum(raw[o] for o in payloads if o != n) for n in payloads) + working + largest
    assert host_budget < sum(payloads.values()) + sum(raw.values())  # not both experts in RAM
    state = enable(pipe, cache, host_budget=host_budget)
    watch = Watch(state)
    generate_until_kept(pipe, state, reference, 6)
    tier = state.host_tier.report()
    assert set(EXPERTS) & set(tier["on_disk"])  # they took turns
    assert not watch.over_share and tier["peak_host_ram_bytes"] <= host_budget
    pipe.disable_flextensor_offload()


def test_with_no_room_for_the_encoder_the_model_streams_raw_within_the_budget_and_says_so(
    saved, tmp_path, caplog
) -> None:
    """The smallest host budget enable takes (the largest component's least compressed size: known before encoding)
    holds the components as they wait (their raw bases) but not one block's payload beside the encoder's working
    memory: nothing is encoded, one warning per component names the fixes, the generations are bitwise from the raw
    bytes in the weight files, and the tier's RAM stays within its share."""
    folder, reference = saved
    pipe = load(folder)
    with pytest.raises(ft.HostBudgetError) as refused:
        enable(pipe, tmp_path / "cache", host_budget=1)
    smallest = refused.value.required_bytes
    with caplog.at_level(logging.WARNING):
        state = enable(pipe, tmp_path / "cache", host_budget=smallest)
        watch = Watch(state)
        assert all(torch.equal(wan_latents(pipe), reference) for _ in range(2))
    said = [r.getMessage() for r in caplog.records if "no room in the host budget to compress" in r.getMessage()]
    assert len(said) == len(ENCODED) and all("background_encoding=False" in line for line in said)
    assert not any(state.handles[n].host.encoded for n in ENCODED) and not watch.over_share
    pipe.disable_flextensor_offload()


def test_removal_while_blocks_are_encoded_restores_every_tensor_and_leaves_the_folder_as_it_was(
    saved, tmp_path
) -> None:
    folder, _ = saved
    before_folder = digest(folder)
    pipe = load(folder)
    before = {name: snapshot(getattr(pipe, name)) for name in EXPERTS}
    cache = tmp_path / "cache"
    state = enable(pipe, cache)
    wan_latents(pipe, num_inference_steps=2)
    assert state.handles["transformer"].host.compressed.encoding_between_forwards
    pipe.disable_flextensor_offload()
    for name, snap in before.items():
        assert_same(snap, getattr(pipe, name))
    assert not any(p.suffix == ".raw" for p in cache.iterdir())
    assert digest(folder) == before_folder


def test_a_refused_encoder_room_after_the_blocks_moved_to_their_files_leaves_the_model_as_it_was(
    saved, tmp_path, monkeypatch
) -> None:
    """The device encoder's room is checked once set-up knows the blocks will be encoded between forwards (every one
    still its weight files' pages, moved there): a refusal then leaves every tensor as it was, the folder untouched,
    and the pipeline still runs natively. (On the CPU nothing is refused: the check is made to refuse here.)"""
    from flextensor_diffusers.engine import setup

    def refuse(nbytes: int, held: int, budget_bytes: int | None, device: torch.device) -> None:
        raise ft.BudgetError(f"refused: encoding {nbytes} bytes needs more", required_bytes=nbytes)

    monkeypatch.setattr(setup, "refuse_without_room", refuse)
    folder, reference = saved
    before_folder = digest(folder)
    pipe = load(folder)
    before = {name: snapshot(getattr(pipe, name)) for name in EXPERTS}
    with pytest.raises(ft.BudgetError, match="refused: encoding"):
        enable(pipe, tmp_path / "cache")
    for name, snap in before.items():
        assert_same(snap, getattr(pipe, name))
    assert digest(folder) == before_folder
    assert torch.equal(wan_latents(pipe), reference)


def test_a_tensor_is_its_files_bytes_only_where_it_views_them_and_no_page_was_written(tmp_path) -> None:
    """`mapped_weights`: a tensor viewing a private mapping of a file holds that file's bytes at its offset while no
    page of it was written; one byte written (a copy-on-write page), another file of the same size and bytes, another
    offset, or memory of its own, and it does not."""
    from flextensor_diffusers.storage.mapped_weights import MappedFiles, unwritten

    size = 4 * 4096
    data = bytes(range(256)) * (size // 256)
    (tmp_path / "a.bin").write_bytes(data)
    (tmp_path / "b.bin").write_bytes(data)  # the same bytes, another file

    def mapped(name: str) -> torch.Tensor:
        return torch.from_file(str(tmp_path / name), shared=False, size=size, dtype=torch.uint8)

    loaded, home, other = mapped("a.bin"), mapped("a.bin"), mapped("b.bin")
    files = MappedFiles()
    tensor = loaded[4096:12288]
    assert unwritten(tensor.data_ptr(), tensor.numel())
    assert files.holds_file_bytes(tensor, tensor.numel(), home, 4096)
    assert not files.holds_file_bytes(tensor, tensor.numel(), home, 0)  # another place of the file
    assert not files.holds_file_bytes(tensor, tensor.numel(), other, 4096)  # another file, the same bytes
    assert not files.holds_file_bytes(tensor.clone(), tensor.numel(), home, 4096)  # memory of its own
    loaded[8192] = int(loaded[8192])  # a write of the same value: the page is a private copy from now on
    assert not unwritten(tensor.data_ptr(), tensor.numel())
    assert not files.holds_file_bytes(tensor, tensor.numel(), home, 4096)
    assert unwritten(loaded[:4096].data_ptr(), 4096) and files.holds_file_bytes(loaded[:4096], 4096, home, 0)


def test_enable_packs_no_block_that_is_still_its_files_pages_and_compares_one_edited_after_loading(
    saved, tmp_path, monkeypatch
) -> None:
    """Loaded from its folder, every block of the components run is still the pages of its weight files: enable
    packs (copies) none of them and compares none, only each component's weights outside blocks. A block edited in
    place after loading (a written page) is not taken for its file's: it is packed, compared, found different and
    (``raw_copies="disk"``) written to a cache file; the outputs follow the edit, bitwise, while it is encoded and
    after."""
    from flextensor_diffusers.engine import units as unit_module
    from flextensor_diffusers.storage import packing

    folder, _ = saved
    packed: list[str] = []
    real = unit_module.pack_unit

    def counted(unit, *args, **kwargs) -> None:
        packed.append(unit.name)
        real(unit, *args, **kwargs)

    monkeypatch.setattr(packing, "pack_unit", counted)
    pipe = load(folder)
    state = enable(pipe, tmp_path / "untouched")
    assert all(not name.startswith("blocks.") for name in packed), packed  # the bases only
    assert not any(p.suffix == ".raw" for p in (tmp_path / "untouched").iterdir())
    pipe.disable_flextensor_offload()
    native, pipe = load(folder), load(folder)
    for model in (native, pipe):
        with torch.no_grad():
            model.transformer.blocks[1].attn1.to_q.weight[0, 0] += 1.0  # the first bytes: a written page
    expected = wan_latents(native)
    packed.clear()
    cache = tmp_path / "cache"
    state = enable(pipe, cache, raw_copies="disk")  # the default ("none") encodes it at set-up: the test below
    assert "blocks.1" in packed and ".raw" in {p.suffix for p in cache.iterdir()}
    for _ in range(3):
        assert torch.equal(wan_latents(pipe), expected)
    assert all_kept(state)
    pipe.disable_flextensor_offload()


@pytest.mark.parametrize("built", ["in memory", "edited after loading"])
def test_payloads_only_a_component_not_all_in_its_weight_files_is_encoded_at_set_up_bitwise(
    saved, tmp_path, built, caplog
) -> None:
    """Under the default ``raw_copies="none"`` with a plan that encodes between forwards (forced here on the CPU, as
    CUDA's default is): a component with a block its weight files do not hold as loaded (built in memory, or one
    block written after loading) would keep that block's payload as its only host copy, with no raw bytes to stream
    while it is encoded; set-up encodes it before enable returns instead, says so, and writes nothing raw to
    ``cache_dir``. The generations and disable are bitwise. A component still all its files' pages, beside it, is
    still encoded between forwards. On first-enable's code the in-place edit went to a raw cache file and the model
    built in memory had every block written there, nothing encoded at set-up."""
    folder, _ = saved
    pipe = build_pipeline("wan22_t2v", "tiny") if built == "in memory" else load(folder)
    if built == "edited after loading":
        with torch.no_grad():
            pipe.transformer.blocks[1].attn1.to_q.weight[0, 0] += 1.0  # a written page of its weight file
    expected = wan_latents(pipe)
    before = {name: snapshot(getattr(pipe, name)) for name in ENCODED}
    cache = tmp_path / "cache"
    with caplog.at_level(logging.WARNING, logger="flextensor_diffusers.engine.setup"):
        state = enable(pipe, cache)
    at_set_up = list(ENCODED) if built == "in memory" else ["transformer"]
    for name in ENCODED:
        handle = state.handles[name]
        assert handle.config.storage.raw_copies == "none"
        between = isinstance(handle.host.compressed.arrivals.current, arrivals.EncodingBetweenForwards)
        assert between is (name not in at_set_up), name
    said = [r.getMessage() for r in caplog.records if "is encoded before enable returns" in r.getMessage()]
    said = [m for m in said if not m.startswith(type(pipe.vae).__name__)]  # the VAE, which no latent step runs
    assert len(said) == len(at_set_up), said
    host = state.handles["transformer"].host
    assert host.encoded and not host.compressed.arriving  # every payload made before enable returned
    assert host.where().payloads_only_bytes > 0  # the block(s) the files do not hold: their payload only
    assert all(torch.equal(wan_latents(pipe), expected) for _ in range(2))
    assert not any(p.suffix == ".raw" for p in cache.iterdir())
    pipe.disable_flextensor_offload()
    assert not any(p.suffix == ".raw" for p in cache.iterdir())
    for name, snap in before.items():
        assert_same(snap, getattr(pipe, name))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_first_enable_encodes_nothing_by_default_and_the_generations_stay_bitwise(saved, tmp_path) -> None:
    """On CUDA with the defaults (``background_encoding`` left to the plan: between forwards where the encoder's room
    fits): enable packs no block and encodes none; each component's first forward runs with none encoded, the device
    encoder makes them in the gaps (the handles' clock stands still there, so the first gap makes them all), the
    payloads are kept, proven and decoded; every generation is bitwise equal to native's on CUDA, every load verified
    with nothing found, the tier's RAM within its share; the next enable reads the payload files."""
    folder, _ = saved
    native = load(folder)
    native.to("cuda")
    reference = wan_latents(native).cpu()
    del native
    pipe = load(folder)
    cache = tmp_path / "cache"
    options = dict(budget=2**28, device="cuda", compression="lossless", host_budget="1GiB", cache_dir=cache)
    pipe.enable_flextensor_offload(**options)
    state = ft.pipeline_offload(pipe)
    assert all(not state.handles[n].host.encoded for n in ENCODED)
    assert all(state.handles[n].host.compressed.encoding_between_forwards for n in ENCODED)
    watch = Watch(state)
    for _ in range(3):
        assert torch.equal(wan_latents(pipe).cpu(), reference)
    assert all(watch.at_forward[n][0] == (0, 0) for n in ENCODED), watch.at_forward
    assert all_kept(state) and all(state.handles[n].device_copies.decoding for n in EXPERTS)
    for name in ENCODED:
        checks = pipe.flextensor_report()["components"][name]["load_checks"]
        assert checks["checks"] > 0 and checks["faults"] == []
    assert not watch.over_share
    watch.stop()
    pipe.disable_flextensor_offload()
    pipe.enable_flextensor_offload(**options)
    state = ft.pipeline_offload(pipe)
    assert all(state.handles[n].payload_cache.status == "read" for n in ENCODED)
    assert torch.equal(wan_latents(pipe).cpu(), reference)
    pipe.disable_flextensor_offload()
