"""Small models for the engine tests: attention blocks, tied weights, buffers, a unit run twice."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

import flextensor_diffusers as ft


class Block(nn.Module):
    def __init__(self, dim: int, heads: int = 2, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim, dtype=dtype)
        self.qkv = nn.Linear(dim, 3 * dim, dtype=dtype)
        self.out = nn.Linear(dim, dim, dtype=dtype)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim, dtype=dtype), nn.GELU(), nn.Linear(2 * dim, dim, dtype=dtype))
        self.register_buffer("scale", torch.full((dim,), 0.5, dtype=dtype))
        self.register_buffer("step", torch.zeros((), dtype=torch.int64), persistent=False)
        self.gate = nn.Parameter(torch.randn(dim, dtype=torch.float32))  # mixed dtypes in one unit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)
        x = x + self.out(a) * self.scale + self.gate.to(x.dtype) * 0.01
        return x + self.ff(x)


class Stack(nn.Module):
    """Embedding tied to the head, blocks, and block 1 called a second time at the end."""

    def __init__(self, dim: int = 32, depth: int = 4, vocab: int = 50, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, dtype=dtype)
        self.blocks = nn.ModuleList([Block(dim, dtype=dtype) for _ in range(depth)])
        self.head = nn.Linear(dim, vocab, bias=False, dtype=dtype)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("pos", torch.randn(1, 64, dim, dtype=dtype))
        self.repeat = 1

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[:, : tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        for _ in range(self.repeat):
            x = self.blocks[1](x)
        return self.head(x)


#: Call arguments of a short tiny-Wan2.2 generation (both experts run, with CFG).
TINY_WAN_CALL = dict(
    prompt="a cat walking on the beach",
    negative_prompt="blurry",
    num_frames=9,
    height=32,
    width=32,
    num_inference_steps=4,
    guidance_scale=4.0,
)


def wan_latents(pipe, **overrides) -> torch.Tensor:
    """Latents of one seeded tiny-Wan2.2 generation (no VAE decode)."""
    call = {**TINY_WAN_CALL, **overrides}
    return pipe(**call, output_type="latent", generator=torch.Generator().manual_seed(0)).frames


#: Recipe arguments for the tiny Wan2.2 pipeline on the CPU; the budget streams its transformer blocks.
TINY_WAN_ARGV = [
    "--random-weights",
    "tiny",
    "--frames",
    "9",
    "--height",
    "32",
    "--width",
    "32",
    "--steps",
    "2",
    "--budget",
    "250000",
    "--device",
    "cpu",
]


def snapshot(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.device, int]]:
    """Every parameter and buffer: a copy of its bytes, its device and its object identity."""
    out = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        out[name] = (t.detach().clone().cpu(), t.device, id(t))
    return out


def assert_same(before: dict, model: nn.Module) -> None:
    after = snapshot(model)
    assert before.keys() == after.keys()
    for name, (data, device, ident) in before.items():
        data2, device2, ident2 = after[name]
        assert device2 == device, name
        assert ident2 == ident, name
        assert data2.dtype == data.dtype and data2.shape == data.shape, name
        assert torch.equal(
            data2.view(torch.uint8) if data2.dim() else data2, data.view(torch.uint8) if data.dim() else data
        ), name


def assert_refused_as_it_was(pipe, error: type[Exception], match: str, **enable: object) -> None:
    """``pipe.enable_flextensor_offload(**enable)`` raises ``error`` matching ``match``, and leaves the pipeline as it
    was: no offload, the transformer's tensors unchanged."""
    import pytest

    import flextensor_diffusers as ft

    before = snapshot(pipe.transformer)
    with pytest.raises(error, match=match):
        pipe.enable_flextensor_offload(**enable)
    assert ft.pipeline_offload(pipe) is None
    assert_same(before, pipe.transformer)


def set_host_overhead(monkeypatch, own: int, reserve: int) -> None:
    """The process's own memory measures ``own`` bytes and the host budget's reserve is ``reserve`` bytes
    (module-level names, as `HostOverhead.measure` reads them): a tiny model's host budget is planned in
    its host copies' bytes with both at 0, since hundreds of MB of Python and torch would dwarf it."""
    from flextensor_diffusers.storage import host_budget

    monkeypatch.setattr(host_budget, "process_own_bytes", lambda modules: own)
    monkeypatch.setattr(host_budget, "HOST_RESERVE_BYTES", reserve)


def set_ram_available(monkeypatch, nbytes: int) -> None:
    """The RAM available to the process (what ``host_budget="auto"`` and the refusal before packing decide from)
    reads ``nbytes``, as the host's (a module-level name, as `enable` reads it once)."""
    from flextensor_diffusers.storage import host_budget
    from flextensor_diffusers.storage.machine_memory import HOST, AvailableMemory, MemoryBound

    ram = AvailableMemory((MemoryBound(HOST, "set by the test", max(nbytes, 2**40), nbytes),))
    monkeypatch.setattr(host_budget, "available_ram", lambda: ram)


def enable_with_one_component_in_ram(pipe, budget: int, cache) -> None:
    """Offload with a host budget of the largest component (set `set_host_overhead` to 0 first): Wan2.2's
    experts take turns in RAM, the other waiting in a cache file in ``cache``."""
    pipe.enable_flextensor_offload(budget=budget, device="cpu")
    largest = max(h.host.packed_bytes for h in ft.pipeline_offload(pipe).handles.values())
    pipe.disable_flextensor_offload()
    pipe.enable_flextensor_offload(budget=budget, device="cpu", host_budget=largest + 1, cache_dir=cache)


def setup_minimum(model: nn.Module, device: str, **config: object) -> int:
    """The least budget ``model`` (units ``blocks.*``) streams in before any activation is measured: what the
    refusal of a 1-byte budget names, before anything is packed."""
    import flextensor_diffusers as ft

    try:
        ft.offload(model, include_patterns=["blocks.*"], gpu_budget=1, device=device, **config)
    except ft.BudgetError as refused:
        assert refused.required_bytes is not None
        return refused.required_bytes
    raise AssertionError("a 1-byte budget was accepted")


def measured_smallest(
    model: nn.Module,
    run: Callable[[nn.Module], object],
    device: str,
    make_probe: Callable[[], nn.Module] | None = None,
    offloader: Callable[..., object] | None = None,
    **config: object,
) -> int:
    """The least budget ``model`` (units ``blocks.*``) streams in once its activations are measured: a copy
    (``make_probe()`` where a deep copy would not compute alike: diffusers' hooks hold the module they were
    applied to), offloaded with room to spare by ``offloader`` (``ft.offload`` unless the test offloads its model
    another way: the probe must leave the device in the state the test's own set-up leaves it, since a budget
    bounds everything the process holds there), runs ``run(copy)`` (its forwards); then
    `OffloadHandle.smallest_budget`."""
    import flextensor_diffusers as ft

    probe = make_probe() if make_probe is not None else copy.deepcopy(model).to("cpu")
    offload = offloader if offloader is not None else ft.offload
    handle = offload(probe, include_patterns=["blocks.*"], gpu_budget=2**30, device=device, **config)
    run(probe)
    need = handle.smallest_budget()
    handle.remove()
    return need


def device_headroom(
    device: str, model: nn.Module, x: torch.Tensor, offloader: Callable[..., object] | None = None, **config: object
) -> int:
    """Budget room beyond a small model's weights and two slots. On the CPU, only rounding: nothing counts
    activations there. On CUDA a budget bounds the whole process's peak of allocated memory, with the engine's
    activation margin on all of it: what the process holds already (earlier tests' tensors, the cuBLAS workspace)
    and the model's own activations. So it is measured: a copy of ``model`` (``config`` as the test's) runs ``x``
    twice with room to spare; the room is its smallest budget less the set-up minimum, plus 8 KiB for activations
    measured again."""
    if device != "cuda":
        return 2048

    def run(probe: nn.Module) -> None:
        with torch.inference_mode():
            for _ in range(2):
                probe(x.to("cuda"))

    need = measured_smallest(model, run, "cuda", offloader=offloader, **config)
    return need - setup_minimum(model, "cuda", **config) + 8192


def offload_compressed_on_the_device(model: nn.Module, **kwargs: object):
    """``ft.offload(model, **kwargs)``, every unit encoded before set-up returns unless ``background_encoding`` is
    given (on CUDA the default encodes between forwards where it can); where the device encoder refuses the budget
    (one unit at a time needs more at set-up than the small budgets these tests stream under), again under the
    budget its error names, as it tells a user to."""
    import flextensor_diffusers as ft

    kwargs.setdefault("background_encoding", False)

    for _ in range(3):  # the need measured under a named budget may come out a few KB higher (verify_loads' counters)
        try:
            return ft.offload(model, **kwargs)
        except ft.BudgetError as exc:
            if "compressing the weights" not in str(exc) or exc.required_bytes is None:
                raise
            kwargs = {**kwargs, "gpu_budget": exc.required_bytes + 64 * 1024}
    return ft.offload(model, **kwargs)


def wan_cli_refusal(argv: list[str], capsys) -> str:
    """The Wan2.2 recipe's command line on ``argv``: exit status 2 with one line on stderr, which is returned."""
    import pytest

    from flextensor_diffusers.recipes import wan22_t2v

    with pytest.raises(SystemExit) as info:
        wan22_t2v.cli(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err.strip()
