"""Offloaded outputs stay bitwise native wherever the native weights sit: every packed view keeps its tensor's
alignment class and strides (``units.py``), and ``remove()`` gives both back. See docs/guide.md, "Where weights sit".

Weights are built at several placements: fresh, loaded by ``from_pretrained`` (views of a mapped safetensors
file, at unaligned addresses), offset into memory of their own at classes 4, 8, 20 and 100 bytes, and
transposed, strided and expanded (stride 0). The model computes matrix-vector products in FP32 (one input
row), the kernels that choose their path by the weight's address on an MKL CPU.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from torch import nn

import flextensor_diffusers as ft
from flextensor_diffusers.engine import Phase
from flextensor_diffusers.engine.units import (
    ALIGNMENT,
    CPU_ALIGNMENT,
    aligned_buffer,
    class_modulus,
    find_units,
    is_dense,
    plan_layout,
    repeats_beyond_expansion,
    span_nbytes,
)
from flextensor_diffusers.storage.codec import decode_into
from flextensor_diffusers.storage.host_memory import host_buffer, shared_file_buffer

DIM = 48
FORWARDS = 5  # discovery, profiling, three steady


class RowBlock(nn.Module):
    def __init__(self, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim, dtype=dtype)
        self.mix = nn.Linear(dim, dim, bias=False, dtype=dtype)
        self.conv = nn.Conv1d(1, 2, 3, padding=1, dtype=dtype)
        self.register_buffer("scale", torch.rand(dim, dtype=dtype) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.proj(x)) * self.scale + 0.1 * self.mix(x)
        return x + y + 0.01 * self.conv(y[:, None]).sum(1)


class RowNet(ModelMixin, ConfigMixin):
    """Matrix-vector products (one input row) in every block and outside them, a convolution, buffers."""

    @register_to_config
    def __init__(self, dim: int = DIM, depth: int = 4, dtype: str = "float32") -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim, dtype=getattr(torch, dtype))
        self.blocks = nn.ModuleList([RowBlock(dim, getattr(torch, dtype)) for _ in range(depth)])
        self.register_buffer("shift", torch.randn(dim, dtype=getattr(torch, dtype)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x) + self.shift
        for block in self.blocks:
            x = block(x)
        return x


def fresh(dtype: torch.dtype = torch.float32, dim: int = DIM) -> RowNet:
    torch.manual_seed(0)
    return RowNet(dim, dtype=str(dtype).removeprefix("torch."))


def at_class(values: torch.Tensor, address_class: int) -> torch.Tensor:
    """A contiguous copy of ``values`` in memory of its own whose first byte's address is ≡ ``address_class``
    (mod `ALIGNMENT`): its own storage, as ``from_pretrained`` gives each tensor of a mapped file."""
    nbytes = values.numel() * values.element_size()
    memory = bytearray(nbytes + 2 * ALIGNMENT)
    start = (address_class - torch.frombuffer(memory, dtype=torch.uint8).data_ptr()) % ALIGNMENT
    placed = torch.frombuffer(memory, dtype=values.dtype, count=values.numel(), offset=start).view(values.shape)
    placed.copy_(values)
    return placed


def transposed(values: torch.Tensor, address_class: int) -> torch.Tensor:
    return at_class(values.t().contiguous(), address_class).t()


def strided(values: torch.Tensor, address_class: int) -> torch.Tensor:
    """``values`` as every other element of a row twice as long (gaps between the elements)."""
    wide = torch.zeros(*values.shape[:-1], 2 * values.shape[-1], dtype=values.dtype)
    wide[..., ::2] = values
    return at_class(wide, address_class)[..., ::2]


def expanded(values: torch.Tensor, address_class: int) -> torch.Tensor:
    """The first row of ``values`` repeated along dim 0 (stride 0): the values change, native with them."""
    return at_class(values[:1].clone(), address_class).expand(values.shape)


Place = Callable[[str, torch.Tensor], torch.Tensor]


def placed(model: nn.Module, place: Place) -> nn.Module:
    """``model`` with every parameter and buffer moved to ``place(name, values)`` (``.data`` re-pointed)."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        t.data = place(name, t.data)
    return model


CLASSES = [4, 8, 20, 100, 0, 36, 260]


def every_class(name: str, values: torch.Tensor) -> torch.Tensor:
    return at_class(values, CLASSES[sum(map(ord, name)) % len(CLASSES)])


def strides_of_every_kind(name: str, values: torch.Tensor) -> torch.Tensor:
    """Transposed and strided weights, an expanded one, strided and expanded buffers; classes 4 and 20."""
    if name.endswith("proj.weight"):
        return transposed(values, 4)
    if name.endswith("mix.weight"):
        return expanded(values, 20)
    if name.endswith(("inp.weight", "scale", "conv.weight")):
        return strided(values, 20)
    if name == "shift":
        return expanded(values, 4)
    return at_class(values, 4)


def loaded(tmp_path: Path) -> nn.Module:
    """Saved and loaded again: ``from_pretrained`` leaves views of the mapped safetensors file."""
    fresh().save_pretrained(tmp_path / "rownet")
    model = RowNet.from_pretrained(tmp_path / "rownet")
    assert any(p.data_ptr() % 16 for p in model.parameters()), "precondition: some weights sit unaligned"
    return model


PLACEMENTS: dict[str, Callable[[Path], nn.Module]] = {
    "fresh": lambda tmp: fresh(),
    "from_pretrained": loaded,
    **{f"class{c}": (lambda tmp, c=c: placed(fresh(), lambda n, v: at_class(v, c))) for c in (4, 8, 20, 100)},
    "mixed_classes": lambda tmp: placed(fresh(), every_class),
    "strided": lambda tmp: placed(fresh(), strides_of_every_kind),
    "bf16_strided": lambda tmp: placed(fresh(torch.bfloat16), strides_of_every_kind),
}


def row(model: nn.Module) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(1, model.inp.in_features, dtype=model.inp.weight.dtype)


def outputs(model: nn.Module, n: int = FORWARDS) -> list[torch.Tensor]:
    x = row(model)
    with torch.inference_mode():
        return [model(x) for _ in range(n)]


def placements(model: nn.Module) -> dict[str, tuple[int, tuple[int, ...], torch.device, torch.Tensor]]:
    """Per parameter and buffer: address modulo `ALIGNMENT`, strides, device and a copy of its values."""
    return {
        name: (t.data_ptr() % ALIGNMENT, t.stride(), t.device, t.detach().clone(memory_format=torch.contiguous_format))
        for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    }


def smallest_budget(model: nn.Module, **options: object) -> int:
    """The least budget offload accepts for ``model`` (it refuses less at once, before packing anything)."""
    with pytest.raises(ft.BudgetError) as refused:
        ft.offload(model, include_patterns=["blocks.*"], gpu_budget=1, device="cpu", **options)
    return refused.value.required_bytes


def record_views(model: nn.Module) -> tuple[dict[str, set[tuple[int, tuple[int, ...]]]], list]:
    """What each block's tensors look like while it computes: (address mod `CPU_ALIGNMENT`, strides) seen."""
    seen: dict[str, set[tuple[int, tuple[int, ...]]]] = {}

    def hook(prefix: str) -> Callable[..., None]:
        def record(module: nn.Module, args: object) -> None:
            for name, t in [*module.named_parameters(), *module.named_buffers()]:
                seen.setdefault(f"{prefix}.{name}", set()).add((t.data_ptr() % CPU_ALIGNMENT, t.stride()))

        return record

    hooks = [block.register_forward_pre_hook(hook(f"blocks.{i}")) for i, block in enumerate(model.blocks)]
    return seen, hooks


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_offloaded_outputs_stay_bitwise_native_and_remove_gives_every_placement_back(placement, tmp_path) -> None:
    model = PLACEMENTS[placement](tmp_path)
    native = outputs(model)
    assert all(torch.equal(out, native[0]) for out in native)  # native itself repeats bitwise
    before = placements(model)
    handle = ft.offload(model, include_patterns=["blocks.*"], gpu_budget=smallest_budget(model), device="cpu")
    seen, hooks = record_views(model)
    offloaded = outputs(model)
    for hook in hooks:
        hook.remove()
    assert handle.phase is Phase.STEADY and handle.plan is not None and not handle.plan.resident
    for i, out in enumerate(offloaded):
        assert torch.equal(out, native[0]), f"forward {i}: max abs {(out - native[0]).abs().max().item():.3g}"
    for name, views in seen.items():  # the views blocks computed from: native class and strides, every call
        address, stride = before[name][:2]
        assert views == {(address % CPU_ALIGNMENT, stride)}, name

    handle.remove()
    after = placements(model)
    for name, (address, stride, device, values) in before.items():
        assert after[name][:3] == (address, stride, device), name
        assert torch.equal(after[name][3].view(-1).view(torch.uint8), values.view(-1).view(torch.uint8)), name
    assert all(torch.equal(out, native[0]) for out in outputs(model, 2))


def test_a_matrix_vector_product_offloaded_keeps_the_path_its_native_address_chose(tmp_path) -> None:
    """The kernel-level case: one linear layer whose FP32 weight sits at each class mod 16 natively. On a
    machine whose GEMV picks its path by the weight's address (MKL on the EPYC CI runner) the natives differ
    between classes; offloaded, each stays equal to its own native."""
    torch.manual_seed(0)
    weight, x = torch.randn(256, 256), torch.randn(1, 256)
    natives = {}
    for address_class in (0, 4, 8, 12):
        model = nn.Sequential(nn.Identity(), nn.Linear(256, 256, bias=False))
        model[1].weight.data = at_class(weight, address_class)
        with torch.inference_mode():
            natives[address_class] = model(x)
        handle = ft.offload(model, include_patterns=["1"], gpu_budget=10**6, device="cpu")
        with torch.inference_mode():
            assert all(torch.equal(model(x), natives[address_class]) for _ in range(FORWARDS)), address_class
        handle.remove()


def test_the_cpu_kernels_distinguish_no_alignment_beyond_the_class_modulus() -> None:
    """Classes on the CPU are taken modulo `CPU_ALIGNMENT` (64): a weight 64·k bytes further computes the same
    on this machine, here for the kernels that do depend on the address (FP32 and FP64 GEMV) and a few that
    do not. If this fails, a kernel here picks its path by a larger alignment: raise `CPU_ALIGNMENT`."""
    torch.manual_seed(0)
    cases = {
        "gemv fp32": (torch.randn(1, 96), torch.randn(64, 96), F.linear),
        "gemv fp64": (torch.randn(1, 96, dtype=torch.float64), torch.randn(64, 96, dtype=torch.float64), F.linear),
        "gemm fp32": (torch.randn(8, 96), torch.randn(64, 96), F.linear),
        "conv2d fp32": (torch.randn(1, 4, 8, 8), torch.randn(8, 4, 3, 3), F.conv2d),
        "gemv bf16": (torch.randn(1, 96).bfloat16(), torch.randn(64, 96).bfloat16(), F.linear),
    }
    for name, (x, weight, op) in cases.items():
        for address_class in range(0, CPU_ALIGNMENT, weight.element_size()):
            reference = op(x, at_class(weight, address_class))
            for further in range(address_class + CPU_ALIGNMENT, ALIGNMENT, CPU_ALIGNMENT):
                assert torch.equal(op(x, at_class(weight, further)), reference), (name, address_class, further)


def test_views_keep_classes_and_strides_and_unit_sizes_do_not_depend_on_them() -> None:
    """The mechanism, whatever the machine's kernels: views at the native classes (mod `CPU_ALIGNMENT` on the
    CPU) with the native strides (gaps and stride 0 included); flat buffers at multiples of `ALIGNMENT`; the
    same unit sizes for the same model at any placement, so budgets and saved profiles carry over."""
    models = [fresh(), placed(fresh(), every_class), placed(fresh(), strides_of_every_kind)]
    sizes = []
    for model in models:
        before = placements(model)
        handle = ft.offload(model, include_patterns=["blocks.*"], gpu_budget=10**7, device="cpu")
        # internal: the device copies' flat buffers are checked for alignment too; nothing public holds them
        buffers, positions = handle.device_copies.buffers, handle.host.positions
        flats = [buffers.base, *buffers.resident.values(), *buffers.slots, *(u.host for u in positions)]
        assert all(flat.data_ptr() % ALIGNMENT == 0 for flat in flats)
        for unit in positions:
            for packed in unit.tensors:
                prefix = f"{unit.name}." if unit.index >= 0 else ""
                address, stride = before[prefix + packed.names[0]][:2]
                assert packed.offset % CPU_ALIGNMENT == address % CPU_ALIGNMENT
                assert packed.stride == stride == packed.tensor.stride()
                assert packed.origin.alignment_class == address
                assert packed.tensor.data_ptr() % CPU_ALIGNMENT == address % CPU_ALIGNMENT  # active copy
                assert packed.view_of(unit.host).data_ptr() % CPU_ALIGNMENT == address % CPU_ALIGNMENT
        sizes.append([u.nbytes for u in positions])
        handle.remove()
    assert sizes[0] == sizes[1]  # the same tensors at other classes: the same sizes
    spans = {p.names[0]: p.nbytes for p in handle.units[0].tensors}
    assert spans["mix.weight"] == DIM * 4  # expanded: one row
    assert spans["scale"] == (2 * DIM - 1) * 4  # every other element: the gaps between them too


@pytest.mark.parametrize("device", ["cpu", "cuda:0"])  # layouts only: no device is used
def test_the_canonical_layout_of_shared_weights_is_the_same_in_every_process(device: str) -> None:
    """Shared host memory needs one layout for every process, and a follower's model is on the meta device:
    every tensor contiguous at class 0, the same offsets for a model whatever its placement or device."""
    device = torch.device(device)
    with torch.device("meta"):
        follower = RowNet()
    layouts = []
    for model in (follower, fresh(), placed(fresh(), every_class), placed(fresh(), strides_of_every_kind)):
        layout = plan_layout(model, find_units(model, ["blocks.*"]), device, meta_ok=True, canonical=True)
        for unit in [layout.base, *layout.units]:
            assert all(p.offset % class_modulus(device) == 0 for p in unit.tensors)
            assert all(p.stride == torch.empty(p.shape, device="meta").stride() for p in unit.tensors)
        layouts.append([(u.nbytes, [(p.offset, p.nbytes) for p in u.tensors]) for u in [layout.base, *layout.units]])
    assert all(layout == layouts[0] for layout in layouts)


def test_elements_that_share_memory_beyond_an_expand_are_refused_where_they_cannot_be_rebuilt() -> None:
    """A layout only ``as_strided`` makes (rows overlapping by all but one element) cannot be written element by
    element: computing where it is, it is packed byte for byte; laid out canonically it is refused, naming it."""
    model = fresh()
    block = model.blocks[1]
    overlapping = at_class(torch.rand(DIM + 2), 8).as_strided((3, DIM), (1, 1))
    block.register_buffer("window", overlapping)
    with pytest.raises(ft.FlexTensorError, match=r"'blocks\.1\.window' has strides \(1, 1\).*contiguous"):
        plan_layout(model, find_units(model, ["blocks.*"]), torch.device("cpu"), canonical=True)
    native = outputs(model)
    before = placements(model)
    handle = ft.offload(model, include_patterns=["blocks.*"], gpu_budget=smallest_budget(model), device="cpu")
    assert all(torch.equal(out, native[0]) for out in outputs(model))
    handle.remove()
    after = placements(model)
    assert after["blocks.1.window"][:2] == before["blocks.1.window"][:2]
    assert torch.equal(after["blocks.1.window"][3], before["blocks.1.window"][3])


def test_compressed_copies_describe_strided_spans_and_decode_bitwise() -> None:
    """The codec's segments are the packed spans, gaps and classes included: tensors at a class that is a
    multiple of 16 are coded, the others stored raw; each payload decodes to the bytes of every span, and
    outputs stay native (whether the plan loads compressed is the planner's choice, from measured times)."""

    def place(name: str, values: torch.Tensor) -> torch.Tensor:
        if name.endswith("proj.weight"):
            return transposed(values, 16)
        if name.endswith("mix.weight"):
            return strided(values, 48)
        return strides_of_every_kind(name, values)  # expanded, strided and contiguous at classes 4 and 20

    model = placed(fresh(torch.bfloat16, dim=256), place)  # blocks large enough to be worth compressing
    native = outputs(model)
    budget = 2 * smallest_budget(model, compression="lossless")
    handle = ft.offload(model, include_patterns=["blocks.*"], gpu_budget=budget, device="cpu", compression="lossless")
    assert all(torch.equal(out, native[0]) for out in outputs(model))
    for unit in handle.units:
        encoded = handle.host.encoded[unit.index]
        assert [(s.offset, s.nbytes, s.dtype) for s in encoded.segments] == [
            (p.offset, p.nbytes, p.dtype) for p in unit.tensors
        ]
        coded = {p.names[0] for p in unit.tensors if p.offset % 16 == 0 and p.nbytes >= 512}
        assert coded == {"proj.weight", "mix.weight"}
        assert encoded.coded_raw_nbytes == sum(p.nbytes for p in unit.tensors if p.names[0] in coded)
        decoded = torch.zeros(unit.nbytes, dtype=torch.uint8)
        decode_into(encoded, encoded.payload, decoded)
        for packed in unit.tensors:
            span = slice(packed.offset, packed.offset + packed.nbytes)
            assert torch.equal(decoded[span], unit.host[span]), packed.names[0]
    handle.remove()
    assert all(torch.equal(out, native[0]) for out in outputs(model, 2))


def test_buffers_units_are_copied_into_start_at_the_alignment() -> None:
    """Views keep their classes only if every flat buffer starts at a multiple of `ALIGNMENT`."""
    for nbytes in (0, 1, 4095, 10_000, 3 << 20, 40 << 20):
        assert host_buffer(nbytes).data_ptr() % ALIGNMENT == 0
    for nbytes, address_class in itertools.product((1, 513, 70_000), (0, 4, 64, 300)):
        buffer = aligned_buffer(nbytes, torch.device("cpu"), address_class)
        assert buffer.numel() == nbytes and buffer.data_ptr() % ALIGNMENT == address_class


def test_shared_file_buffers_start_at_the_alignment(tmp_path) -> None:
    assert shared_file_buffer(tmp_path / "unit.bin", 10_000).data_ptr() % ALIGNMENT == 0


@pytest.mark.parametrize(
    ("shape", "stride", "span", "dense", "repeats"),
    [
        ((4, 6), (6, 1), 24, True, False),  # contiguous
        ((6, 4), (1, 6), 24, True, False),  # transposed
        ((4, 3), (6, 2), 23, False, False),  # every other element: gaps
        ((4, 6), (0, 1), 6, False, False),  # expanded rows
        ((3, 6), (1, 1), 8, False, True),  # overlapping windows: only as_strided makes them
        ((2, 0, 3), (0, 3, 1), 0, True, False),  # no elements
        ((), (), 1, True, False),  # a scalar
    ],
)
def test_spans_and_layouts(shape, stride, span, dense, repeats) -> None:
    assert span_nbytes(shape, stride, 2) == 2 * span
    assert is_dense(shape, stride) is dense
    assert repeats_beyond_expansion(shape, stride) is repeats
