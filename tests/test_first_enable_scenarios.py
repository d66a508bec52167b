"""What a user does to a pipeline during its first enable under a host budget with compression (issue 48): while its
blocks are encoded between forwards (some made, not all), and right after the payloads are adopted. Each scenario
runs on a native pipeline loaded from the same folder alongside, and every output is bitwise equal to native's or
refused at once in one line naming the fix: LoRA calls, an interrupted generation, other shapes, other prompts,
disable, a second enable (its payload file read, or tampered with), weight reads, another expert's weights loaded.

The pacing is `tests.test_first_enable`'s (one block encoded a gap, on a clock that moves only when the test says):
a two-step generation runs two forwards of each expert, so after one of them each expert has encoded some of its
four blocks, and after two it has kept them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import flextensor_diffusers as ft
from flextensor_diffusers.storage import arrivals, payload_cache
from flextensor_diffusers.storage.read_guard import WeightReadRefused
from tests import test_first_enable
from tests.models import assert_same, snapshot, wan_latents
from tests.test_first_enable import ENCODED, EXPERTS, all_kept, enable
from tests.test_host_tier import digest, load

#: `tests.test_first_enable`'s fixtures: its pacing (one block encoded a gap, autouse) and its folder.
one_block_a_gap, saved = test_first_enable.one_block_a_gap, test_first_enable.saved
RAW_COPIES = pytest.mark.parametrize("raw_copies", ["none", "disk"])


def latents(pipe, **overrides: object) -> torch.Tensor:
    """Two steps: one per expert, each run twice (CFG), so each expert encodes two blocks a generation."""
    return wan_latents(pipe, **{"num_inference_steps": 2, **overrides})


def mid_encoding(state: ft.PipelineOffload) -> bool:
    """Some of the first expert's blocks encoded between forwards, not all (the phase the scenarios run in)."""
    current = state.handles["transformer"].host.compressed.arrivals.current
    return isinstance(current, arrivals.EncodingBetweenForwards) and 0 < current.encoded_units < 4


class Pair:
    """A native and an offloaded pipeline, both loaded from ``folder``, given the same calls."""

    def __init__(self, folder: Path, cache: Path, **options: object) -> None:
        self.native, self.offloaded = load(folder), load(folder)
        self.state = enable(self.offloaded, cache, **options)

    def do(self, step) -> None:
        step(self.native)
        step(self.offloaded)

    def same(self, **overrides: object) -> torch.Tensor:
        expected = latents(self.native, **overrides)
        assert torch.equal(latents(self.offloaded, **overrides), expected)
        return expected

    def until_kept(self, tries: int = 4) -> torch.Tensor:
        for _ in range(tries):
            self.same()
            if all_kept(self.state):
                return self.same()
        raise AssertionError("the payloads were never kept")


def until_kept(pipe, state: ft.PipelineOffload, tries: int = 4) -> None:
    for _ in range(tries):
        if all_kept(state):
            return
        latents(pipe)
    assert all_kept(state)


@RAW_COPIES
def test_lora_calls_while_encoding_and_after_adoption_follow_native(saved, tmp_path, raw_copies) -> None:
    """``load_lora_weights`` mid-encoding (the edit begins the encoding again), ``set_adapters``, ``fuse_lora`` /
    ``unfuse_lora`` and ``unload_lora_weights``: the latents after each equal native's with the same calls."""
    pytest.importorskip("peft")
    from tests.test_lora_methods import load as load_lora
    from tests.test_lora_methods import lora_state_dict

    pair = Pair(saved[0], tmp_path / "cache", raw_copies=raw_copies)
    plain = pair.same()
    assert mid_encoding(pair.state)
    pair.do(load_lora("transformer", lora_state_dict(pair.native, 1), "a"))
    assert not torch.equal(pair.same(), plain)
    pair.do(lambda pipe: pipe.set_adapters(["a"], adapter_weights=[0.5]))
    pair.same()
    pair.do(lambda pipe: pipe.fuse_lora(components=["transformer"], lora_scale=0.75))
    pair.same()
    pair.do(lambda pipe: pipe.unfuse_lora(components=["transformer"]))
    pair.same()
    pair.until_kept()  # adopted with the LoRA loaded
    pair.do(lambda pipe: pipe.unload_lora_weights())
    unloaded = pair.same()  # not quite ``plain`` natively either: unfuse_lora subtracts what fuse_lora added
    pair.offloaded.disable_flextensor_offload()
    assert torch.equal(latents(pair.offloaded), unloaded)


class Interrupted(Exception):
    """What the user's callback or hook raises."""


def raise_at_step(step: int):
    def callback(pipe, index: int, timestep, kwargs: dict) -> dict:
        if index == step:
            raise Interrupted
        return kwargs

    return callback


def interrupted_in(pipe, block: torch.nn.Module) -> None:
    """A generation of ``pipe`` interrupted by an exception from ``block``'s forward pre-hook (inside an expert's
    forward, its units streaming)."""

    def interrupt(*args) -> None:
        raise Interrupted

    hook = block.register_forward_pre_hook(interrupt)
    try:
        with pytest.raises(Interrupted):
            latents(pipe)
    finally:
        hook.remove()


@RAW_COPIES
@pytest.mark.parametrize("where", ["callback", "block hook"])
def test_a_generation_interrupted_while_encoding_leaves_the_next_ones_bitwise(
    saved, tmp_path, raw_copies, where
) -> None:
    """An exception from ``callback_on_step_end`` (between forwards) or from a block's forward hook (inside an expert's
    forward, its units streaming) mid-encoding: the next generations, until adoption and after, are native's."""
    folder, _ = saved
    pair = Pair(folder, tmp_path / "cache", raw_copies=raw_copies)
    reference = pair.same()
    assert mid_encoding(pair.state)
    pipe = pair.offloaded
    if where == "callback":
        call = {"callback_on_step_end": raise_at_step(0), "num_inference_steps": 4}
        with pytest.raises(Interrupted):
            wan_latents(pipe, **call)
    else:
        interrupted_in(pipe, pipe.transformer.blocks[2])
    assert torch.equal(latents(pipe), reference)
    assert torch.equal(pair.until_kept(), reference)
    pipe.disable_flextensor_offload()
    for name in ENCODED:
        expected = getattr(pair.native, name).state_dict()
        assert all(torch.equal(t, expected[k]) for k, t in getattr(pipe, name).state_dict().items()), name


def test_shapes_and_prompts_changed_between_generations_while_encoding_follow_native(saved, tmp_path) -> None:
    """Other frames, height and width, and another prompt, generation after generation, from mid-encoding to after
    adoption: each equal to native's with the same call."""
    pair = Pair(saved[0], tmp_path / "cache")
    pair.same()
    assert mid_encoding(pair.state)
    for overrides in (
        {"num_frames": 5},
        {"height": 48, "width": 64},
        {"prompt": "a dog on a skateboard", "negative_prompt": "dark"},
        {"num_frames": 13, "height": 16, "width": 32},
        {},
    ):
        pair.same(**overrides)
    assert all_kept(pair.state)
    pair.same(num_frames=5, height=48)


@RAW_COPIES
@pytest.mark.parametrize("when", ["mid-encoding", "after adoption"])
def test_disable_restores_every_tensor_and_leaves_the_folder_untouched(saved, tmp_path, raw_copies, when) -> None:
    folder, reference = saved
    before_folder = digest(folder)
    pipe = load(folder)
    before = {name: snapshot(getattr(pipe, name)) for name in (*ENCODED, "vae")}
    state = enable(pipe, tmp_path / "cache", raw_copies=raw_copies)
    latents(pipe)
    if when == "mid-encoding":
        assert mid_encoding(state)
    else:
        until_kept(pipe, state)
    pipe.disable_flextensor_offload()
    for name, snap in before.items():
        assert_same(snap, getattr(pipe, name))
    assert digest(folder) == before_folder
    assert torch.equal(wan_latents(pipe), reference)


@RAW_COPIES
def test_enable_again_after_disable_mid_encoding_and_after_adoption(saved, tmp_path, raw_copies) -> None:
    """Disabled mid-encoding (no payload file yet), enabled again: encoded from the start; kept, disabled, enabled
    again: the payload file written by the first is read. Every generation native's."""
    folder, _ = saved
    pair = Pair(folder, tmp_path / "cache", raw_copies=raw_copies)
    pipe, cache = pair.offloaded, tmp_path / "cache"
    reference = pair.same()
    assert mid_encoding(pair.state)
    pipe.disable_flextensor_offload()
    pair.state = enable(pipe, cache, raw_copies=raw_copies)
    assert torch.equal(pair.until_kept(), reference)
    pipe.disable_flextensor_offload()
    state = enable(pipe, cache, raw_copies=raw_copies)
    assert all(state.handles[n].payload_cache.status == "read" for n in ENCODED)
    assert torch.equal(latents(pipe), reference) and torch.equal(wan_latents(pipe), wan_latents(pair.native))
    pipe.disable_flextensor_offload()


@pytest.mark.parametrize("where", [0.01, 0.5, 0.97])
def test_a_tampered_payload_file_is_refused_or_encoded_again_never_wrong_latents(saved, tmp_path, where) -> None:
    """One byte flipped in every payload file the first enable wrote: the next enable refuses it in one line, or
    reads it as refused and encodes again; either way no generation differs from native's."""
    folder, reference = saved
    cache = tmp_path / "cache"
    pipe = load(folder)
    state = enable(pipe, cache)
    until_kept(pipe, state)
    pipe.disable_flextensor_offload()
    payload_cache.wait_for_all_writes()
    files = sorted(p for p in cache.iterdir() if p.suffix == ".payloads")
    assert files
    for path in files:
        data = bytearray(path.read_bytes())
        data[int(where * (len(data) - 1))] ^= 0x10
        path.write_bytes(bytes(data))
    before = {name: snapshot(getattr(pipe, name)) for name in ENCODED}
    try:
        state = enable(pipe, cache)
    except ft.FlexTensorError as refused:
        assert len(str(refused).splitlines()) == 1
        for name, snap in before.items():
            assert_same(snap, getattr(pipe, name))
        assert torch.equal(wan_latents(pipe), reference)
        return
    assert all(state.handles[n].payload_cache.status.startswith("refused") for n in ENCODED)
    for _ in range(4):
        assert torch.equal(wan_latents(pipe), reference)
    pipe.disable_flextensor_offload()
    for name, snap in before.items():
        assert_same(snap, getattr(pipe, name))


def true_or_refused(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> int:
    """Each parameter read directly equals its true value or is refused in one line; the number read."""
    read = 0
    for key, param in model.named_parameters():
        try:
            value = param.detach().clone()
        except WeightReadRefused as refused:
            assert len(str(refused).splitlines()) == 1
            continue
        assert torch.equal(value, expected[key]), key
        read += 1
    return read


@RAW_COPIES
def test_weight_reads_while_encoding_and_after_adoption_are_the_true_weights(saved, tmp_path, raw_copies) -> None:
    """``state_dict()`` equals native's, and each parameter read directly is native's or refused in one line, with
    some blocks encoded and with all adopted; the generations between stay native's."""
    pair = Pair(saved[0], tmp_path / "cache", raw_copies=raw_copies)
    expected = {name: getattr(pair.native, name).state_dict() for name in ENCODED}
    reference = pair.same()
    for phase in ("mid-encoding", "adopted"):
        if phase == "mid-encoding":
            assert mid_encoding(pair.state)
        else:
            until_kept(pair.offloaded, pair.state)
        for name in ENCODED:
            got = getattr(pair.offloaded, name).state_dict()
            assert got.keys() == expected[name].keys()
            assert all(torch.equal(v, expected[name][k]) for k, v in got.items()), name
            true_or_refused(getattr(pair.offloaded, name), expected[name])
        assert torch.equal(latents(pair.offloaded), reference)
    pair.offloaded.disable_flextensor_offload()


@RAW_COPIES
def test_the_other_experts_weights_loaded_mid_encoding_follow_native(saved, tmp_path, raw_copies) -> None:
    """``pipe.transformer.load_state_dict(pipe.transformer_2's state dict)`` mid-encoding (the second expert still
    encoding too), then generations until adoption and after: native's with the same load; disable gives them."""
    pair = Pair(saved[0], tmp_path / "cache", raw_copies=raw_copies)
    pair.same()
    assert mid_encoding(pair.state)
    other = {k: v.clone() for k, v in pair.native.transformer_2.state_dict().items()}
    pair.do(lambda pipe: pipe.transformer.load_state_dict(other))
    pair.until_kept()
    pair.offloaded.disable_flextensor_offload()
    assert all(torch.equal(t, other[k]) for k, t in pair.offloaded.transformer.state_dict().items())


def write_in_place(pipe) -> None:
    with torch.no_grad():
        pipe.transformer.blocks[0].attn1.to_q.weight[0, 0] += 1.0  # block 0: encoded already, mid-encoding


@RAW_COPIES
@pytest.mark.parametrize("when", ["mid-encoding", "after adoption"])
def test_a_direct_write_into_an_encoded_block_reaches_the_outputs(saved, tmp_path, raw_copies, when) -> None:
    """A weight written in place (no LoRA or state-dict method) after its block's payload was made, or after all
    were kept: the payload is not taken for the new bytes; every generation after is native's with the same write."""
    pair = Pair(saved[0], tmp_path / "cache", raw_copies=raw_copies)
    pair.same()
    if when == "mid-encoding":
        assert mid_encoding(pair.state)
    else:
        until_kept(pair.offloaded, pair.state)
    pair.do(write_in_place)
    pair.until_kept()
    pair.offloaded.disable_flextensor_offload()
    assert torch.equal(latents(pair.offloaded), latents(pair.native))


@pytest.mark.parametrize("at", [0, 3])
def test_ctrl_c_while_a_block_is_encoded_between_forwards_leaves_the_generations_bitwise(
    saved, tmp_path, monkeypatch, at
) -> None:
    """A KeyboardInterrupt inside the host encoder (the first block of a gap, or the last block of the expert, whose
    gap would keep its payloads): the generations after are native's and the payloads are still kept in the end."""
    real = arrivals.EncodingBetweenForwards._on_host
    made = [0]

    def interrupted(jobs):
        for each in real(jobs):
            made[0] += 1
            if made[0] == at + 1:
                raise KeyboardInterrupt
            yield each

    pair = Pair(saved[0], tmp_path / "cache")
    monkeypatch.setattr(arrivals.EncodingBetweenForwards, "_on_host", staticmethod(interrupted))
    with pytest.raises(KeyboardInterrupt):
        latents(pair.offloaded)
    assert made[0] == at + 1
    pair.until_kept()
    pair.offloaded.disable_flextensor_offload()


def adopted_unproven(pair: Pair) -> None:
    """One-step generations (the first expert only) until its payloads are kept and none yet proven."""
    host = pair.state.handles["transformer"].host
    for _ in range(6):
        pair.same(num_inference_steps=1)
        if host.encoded and not host.compressed.arriving and host.compressed.unproven == {0, 1, 2, 3}:
            return
    raise AssertionError("the payloads were never kept")


@RAW_COPIES
@pytest.mark.parametrize("then", ["interrupt", "disable", "edit"])
def test_right_after_adoption_before_any_payload_is_proven(saved, tmp_path, raw_copies, then) -> None:
    """The payloads just kept, none proven by a decoded load yet: a generation interrupted in the expert's first
    decoded forward, disable, or an edit; what follows is native's (disable: every tensor as loaded)."""
    pair = Pair(saved[0], tmp_path / "cache", raw_copies=raw_copies)
    before = snapshot(pair.offloaded.transformer)
    adopted_unproven(pair)
    if then == "interrupt":
        interrupted_in(pair.offloaded, pair.offloaded.transformer.blocks[2])
        pair.until_kept()
    elif then == "disable":
        pair.offloaded.disable_flextensor_offload()
        assert_same(before, pair.offloaded.transformer)
        pair.same()
    else:
        torch.manual_seed(1)
        edited = {k: v + 0.01 * torch.randn_like(v) for k, v in pair.native.transformer.state_dict().items()}
        pair.do(lambda pipe: pipe.transformer.load_state_dict(edited))
        pair.until_kept()


@RAW_COPIES
def test_weights_edited_between_two_enables_are_not_read_from_the_old_payload_file(saved, tmp_path, raw_copies) -> None:
    """Kept, disabled (the payload file written), the expert edited, enabled again with the same ``cache_dir``: the
    old file is not taken for the new weights; a second pipeline from the same folder, one block written in place,
    enabled on that ``cache_dir`` too: the same. Every generation native's."""
    cache = tmp_path / "cache"
    pair = Pair(saved[0], cache, raw_copies=raw_copies)
    pair.until_kept()
    pair.offloaded.disable_flextensor_offload()
    payload_cache.wait_for_all_writes()
    torch.manual_seed(3)
    edited = {k: v + 0.01 * torch.randn_like(v) for k, v in pair.native.transformer.state_dict().items()}
    pair.do(lambda pipe: pipe.transformer.load_state_dict(edited))
    pair.state = enable(pair.offloaded, cache, raw_copies=raw_copies)
    assert pair.state.handles["transformer"].payload_cache.status != "read"
    pair.until_kept()
    other = Pair(saved[0], cache, raw_copies="disk")  # enabled before the write: undo it, write, enable again
    other.offloaded.disable_flextensor_offload()
    other.do(write_in_place)
    other.state = enable(other.offloaded, cache, raw_copies="disk")
    other.until_kept()


def one_expert_payloads_in_ram(folder: Path, cache: Path) -> int:
    """`tests.test_first_enable`'s tight host budget: one expert's payloads and the encoder's working memory, not
    both experts' (measured from a run kept, then its payload files deleted)."""
    pipe = load(folder)
    state = enable(pipe, cache)
    until_kept(pipe, state)
    payloads = {n: h.host.compressed.stored_bytes for n, h in state.handles.items()}
    raw = {n: h.host.where().ram_raw_bytes for n, h in state.handles.items()}
    largest = max(u.nbytes for n in ENCODED for u in state.handles[n].units)
    pipe.disable_flextensor_offload()
    working = arrivals.ENCODER_HOST_UNITS * largest
    return max(payloads[n] + sum(raw[o] for o in payloads if o != n) for n in payloads) + working + largest


@RAW_COPIES
def test_under_a_tight_host_budget_a_lora_an_interrupt_and_reads_mid_encoding_follow_native(
    saved, tmp_path, raw_copies
) -> None:
    """The experts taking turns on disk while encoded: a LoRA loaded into the second mid-encoding, a generation
    interrupted in it, ``state_dict()`` of both; generations native's, disable gives the true weights."""
    pytest.importorskip("peft")
    from tests.test_lora_methods import load as load_lora
    from tests.test_lora_methods import lora_state_dict

    host_budget = one_expert_payloads_in_ram(saved[0], tmp_path / "measured")
    pair = Pair(saved[0], tmp_path / "cache", raw_copies=raw_copies, host_budget=host_budget)
    pair.same()
    assert mid_encoding(pair.state)
    pair.do(load_lora("transformer_2", lora_state_dict(pair.native, 1), "a"))
    pair.same()
    interrupted_in(pair.offloaded, pair.offloaded.transformer_2.blocks[1])
    for _ in range(2):
        pair.same()
    for name in EXPERTS:
        expected = getattr(pair.native, name).state_dict()
        assert all(torch.equal(v, expected[k]) for k, v in getattr(pair.offloaded, name).state_dict().items())
    pair.offloaded.disable_flextensor_offload()
    pair.same()


def test_two_pipelines_encoded_at_once_into_one_cache_dir_then_a_third_reads_their_files(saved, tmp_path) -> None:
    """Two pipelines from one folder enabled on one ``cache_dir``, generating in turn while both encode: each kept,
    each native's; both write the same payload files, and a third pipeline's enable reads them, native's."""
    folder, _ = saved
    cache = tmp_path / "cache"
    reference = latents(load(folder))
    first, second = load(folder), load(folder)
    states = [enable(first, cache), enable(second, cache)]
    for _ in range(3):
        assert torch.equal(latents(first), reference) and torch.equal(latents(second), reference)
    assert all(all_kept(state) for state in states)
    first.disable_flextensor_offload()
    second.disable_flextensor_offload()
    third = load(folder)
    state = enable(third, cache)
    assert all(state.handles[n].payload_cache.status == "read" for n in ENCODED)
    assert torch.equal(latents(third), reference)
    third.disable_flextensor_offload()


def test_a_direct_write_into_experts_waiting_on_disk_mid_encoding_reaches_the_outputs(saved, tmp_path) -> None:
    """Under the tight host budget, mid-encoding: weights written in place in both experts (each waiting on disk or
    being encoded): every generation after, and disable, native's with the same writes."""
    host_budget = one_expert_payloads_in_ram(saved[0], tmp_path / "measured")
    pair = Pair(saved[0], tmp_path / "cache", host_budget=host_budget)
    pair.same()

    def write(pipe) -> None:
        with torch.no_grad():
            pipe.transformer_2.blocks[0].attn1.to_q.weight[0, 0] += 1.0
            pipe.transformer.blocks[3].ffn.net[2].weight[0, 0] -= 1.0

    pair.do(write)
    for _ in range(3):
        pair.same()
    pair.offloaded.disable_flextensor_offload()
    pair.same()
