"""Quantized weights stream bitwise, or are refused at set-up with the fix named.

The tiny Wan2.2 pipeline quantized five ways (torchao int8 and float8 weight-only, optimum-quanto qint8, diffusers'
layerwise float8 casting, GGUF Q8_0 / Q4_0 linears), run natively, then offloaded at the smallest budget it accepts:
three generations bitwise equal, then ``disable`` restores every weight bit-exact (the same objects, their type and
metadata). Made-up subclasses (a wrapper, a wrapper inside a wrapper, inner tensors at unaligned addresses and
transposed) check the principle on a block stack: placement kept, edits found or adopted, ``state_dict``, and the
refusals. Each library is skipped where it is not installed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import flextensor_diffusers as ft
from flextensor_diffusers.engine import Phase
from flextensor_diffusers.recipes.models import build_pipeline
from tests.models import Stack, setup_minimum, wan_latents

TRANSFORMERS = ("transformer", "transformer_2")


# ------------------------------------------------------------------------------------------------ quantizers


def torchao_int8(module: nn.Module) -> None:
    quantization = pytest.importorskip("torchao.quantization")
    quantization.quantize_(module, quantization.Int8WeightOnlyConfig())


def torchao_float8(module: nn.Module) -> None:
    quantization = pytest.importorskip("torchao.quantization")
    quantization.quantize_(module, quantization.Float8WeightOnlyConfig())


def quanto_qint8(module: nn.Module) -> None:
    quanto = pytest.importorskip("optimum.quanto")
    quanto.quantize(module, weights=quanto.qint8)
    quanto.freeze(module)


def layerwise_float8(module: nn.Module) -> None:
    module.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)


def gguf_linears(kind: str) -> Callable[[nn.Module], None]:
    """Every linear of the transformer blocks becomes diffusers' ``GGUFLinear`` with a ``GGUFParameter`` of the
    ``gguf`` package's quantized bytes, as diffusers' GGUF loading makes them. (Not the time embedder: Wan casts the
    timestep to its first weight's dtype, which would be uint8.)"""

    def quantize(module: nn.Module) -> None:
        gguf = pytest.importorskip("gguf")
        from diffusers.quantizers.gguf.utils import GGUFLinear, GGUFParameter

        qtype = getattr(gguf.GGMLQuantizationType, kind)
        for parent in list(module.blocks.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is not nn.Linear or child.in_features % 32:
                    continue
                layer = GGUFLinear(child.in_features, child.out_features, child.bias is not None, torch.float32)
                blocks = gguf.quants.quantize(child.weight.detach().float().numpy(), qtype)
                layer.weight = GGUFParameter(torch.from_numpy(blocks), quant_type=qtype)
                layer.bias = child.bias
                setattr(parent, name, layer)

    return quantize


QUANTIZERS = {
    "torchao int8": torchao_int8,
    "torchao float8": torchao_float8,
    "quanto qint8": quanto_qint8,
    "layerwise float8": layerwise_float8,
    "gguf Q8_0": gguf_linears("Q8_0"),
    "gguf Q4_0": gguf_linears("Q4_0"),
}


def quantized_pipeline(quantize: Callable[[nn.Module], None], perturbed: bool = False):
    """The tiny Wan2.2 pipeline, both transformers quantized (``perturbed``: their weights changed first)."""
    pipe = build_pipeline("wan22_t2v", "tiny")
    for name in TRANSFORMERS:
        if perturbed:
            generator = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for p in getattr(pipe, name).parameters():
                    p.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * 0.01)
        quantize(getattr(pipe, name))
    return pipe


def smallest_budget(pipe) -> int:
    """The least budget the transformers stream in (the text encoder, which is not quantized, would need more)."""
    with pytest.raises(ft.BudgetError) as refused:
        pipe.enable_flextensor_offload(budget=1, device="cpu", components=list(TRANSFORMERS))
    assert refused.value.required_bytes is not None
    return refused.value.required_bytes


def enable_at_smallest(pipe, **options: object) -> None:
    pipe.enable_flextensor_offload(budget=smallest_budget(pipe), device="cpu", components=list(TRANSFORMERS), **options)


# ------------------------------------------------------------------------------------------------ snapshots


def describe(t: torch.Tensor, address: bool = True) -> tuple:
    """Everything that makes ``t`` what it is, read independently of the package: its type and metadata, and for a
    wrapper subclass each inner tensor (by ``__tensor_flatten__``), else its device, dtype, shape, strides, bytes
    and (``address``) its address modulo 64, the alignment class the CPU kernels see."""
    if type(t) not in (torch.Tensor, nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, ctx = t.__tensor_flatten__()
        inner = [(n, describe(getattr(t, n), address)) for n in names]
        return (type(t), repr(ctx), t.device, tuple(t.shape), inner)
    if isinstance(t, Opaque):  # no bytes of its own, nothing to flatten it by: what it holds
        return (Opaque, describe(t.payload, address))
    meta = repr(sorted((k, repr(v)) for k, v in vars(t).items() if k != "_is_param"))
    plain = t.detach().as_subclass(torch.Tensor)
    data = plain.contiguous().reshape(-1).view(torch.uint8).clone()
    described = (type(t), meta, t.device, t.dtype, tuple(t.shape), t.stride(), data)
    return (*described, t.data_ptr() % 64) if address else described


def snapshot(model: nn.Module) -> dict[str, tuple]:
    held = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return {name: (id(t), describe(t)) for name, t in held}


def assert_same(before: dict[str, tuple], after: dict[str, tuple]) -> None:
    assert before.keys() == after.keys()
    for name, (ident, described) in before.items():
        assert after[name][0] == ident, f"{name} is another object"
        assert_described_equal(described, after[name][1], name)


def assert_described_equal(a: object, b: object, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where  # type: ignore[arg-type]
    elif isinstance(a, (tuple, list)):
        assert isinstance(b, type(a)) and len(a) == len(b), where
        for x, y in zip(a, b, strict=True):
            assert_described_equal(x, y, where)
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


# ------------------------------------------------------------------------------------------------ the pipeline


@pytest.mark.parametrize("kind", list(QUANTIZERS))
def test_quantized_pipeline_streams_bitwise_at_the_smallest_budget(kind: str) -> None:
    pipe = quantized_pipeline(QUANTIZERS[kind])
    native = wan_latents(pipe)
    before = {name: snapshot(getattr(pipe, name)) for name in TRANSFORMERS}
    enable_at_smallest(pipe)
    for _ in range(3):
        assert torch.equal(wan_latents(pipe), native)
    report = pipe.flextensor_report()["components"]
    assert all(report[name]["phase"] == "steady" and report[name]["streamed_units"] > 0 for name in TRANSFORMERS)
    pipe.disable_flextensor_offload()
    for name in TRANSFORMERS:
        assert_same(before[name], snapshot(getattr(pipe, name)))
    assert torch.equal(wan_latents(pipe), native)


def test_a_lora_added_to_quantized_experts_after_enable_is_bitwise_and_deleted_cleanly() -> None:
    """peft wraps each targeted quantized linear (its weight moves to ``base_layer``): the weight is still the
    model's, so it keeps streaming; the adapter's generations, and those after ``delete_adapters``, equal native's."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["to_q", "to_k"], init_lora_weights=False)

    def with_lora(pipe) -> list[torch.Tensor]:
        torch.manual_seed(5)
        pipe.transformer.add_adapter(config, adapter_name="style")
        outputs = [wan_latents(pipe)]
        pipe.transformer.delete_adapters("style")
        return [*outputs, wan_latents(pipe)]

    native = with_lora(quantized_pipeline(QUANTIZERS["torchao int8"]))
    pipe = quantized_pipeline(QUANTIZERS["torchao int8"])
    enable_at_smallest(pipe)
    wan_latents(pipe)  # planned before the adapter comes
    offloaded = with_lora(pipe)
    assert all(torch.equal(a, b) for a, b in zip(offloaded, native, strict=True))
    assert not torch.equal(native[0], native[1])  # the adapter changed the output
    assert pipe.flextensor_report()["components"]["transformer"]["streamed_units"] > 0
    pipe.disable_flextensor_offload()


@pytest.mark.parametrize("kind", ["torchao int8", "quanto qint8", "gguf Q4_0"])
def test_state_dict_and_load_state_dict_while_offloaded(kind: str) -> None:
    """``state_dict()`` while offloaded gives the native quantized tensors (rebuilt over the host copies); loading
    another quantized state dict (torchao copies into the weights, quanto swaps in new ones) lands in the host
    copies: outputs equal the native pipeline loaded alike."""
    pipe, reference = quantized_pipeline(QUANTIZERS[kind]), quantized_pipeline(QUANTIZERS[kind])
    other = quantized_pipeline(QUANTIZERS[kind], perturbed=True)
    native_state = {k: describe(v, address=False) for k, v in pipe.transformer.state_dict().items()}
    enable_at_smallest(pipe)
    wan_latents(pipe, num_inference_steps=2)
    offloaded_state = {k: describe(v, address=False) for k, v in pipe.transformer.state_dict().items()}
    assert native_state.keys() == offloaded_state.keys()
    for name, described in native_state.items():
        assert_described_equal(described, offloaded_state[name], name)
    state = other.transformer.state_dict()
    pipe.transformer.load_state_dict(state)
    reference.transformer.load_state_dict(state)
    assert torch.equal(wan_latents(pipe), wan_latents(reference))
    pipe.disable_flextensor_offload()


def test_lossless_compression_streams_quantized_units_or_says_why_not() -> None:
    pipe = quantized_pipeline(torchao_int8)
    native = wan_latents(pipe)
    enable_at_smallest(pipe, compression="lossless")
    for _ in range(2):
        assert torch.equal(wan_latents(pipe), native)
    lines = pipe.flextensor_report()["components"]["transformer"]["unit_compression"]
    assert lines and all(line.startswith(("compressed ", "raw: ")) for line in lines.values()), lines
    pipe.disable_flextensor_offload()


def test_a_mostly_int8_unit_streams_raw_and_the_report_says_so() -> None:
    quantization = pytest.importorskip("torchao.quantization")
    model = Stack(dim=256, depth=3, dtype=torch.bfloat16)
    quantization.quantize_(model.blocks, quantization.Int8WeightOnlyConfig())
    handle = ft.offload(model, include_patterns=["blocks.*"], gpu_budget=2**30, device="cpu", compression="lossless")
    lines = [unit.compression for unit in handle.stats().units]
    assert all(line is not None and line.startswith("raw: ") and "int8" in line for line in lines), lines
    handle.remove()


def test_planner_counts_the_bytes_streamed_int8_half_of_bf16() -> None:
    """A unit's size is its leaves' packed bytes: int8 weight-only takes about half the bf16 unit's bytes, and each
    load moves exactly that."""
    quantization = pytest.importorskip("torchao.quantization")
    bf16 = Stack(dim=256, depth=3, dtype=torch.bfloat16)
    int8 = copy.deepcopy(bf16)
    quantization.quantize_(int8.blocks, quantization.Int8WeightOnlyConfig())
    sizes = {}
    for name, model in (("bf16", bf16), ("int8", int8)):
        tokens = torch.randint(0, 50, (2, 16))
        handle = ft.offload(model, include_patterns=["blocks.*"], gpu_budget=setup_minimum(model, "cpu"), device="cpu")
        with torch.inference_mode():
            for _ in range(4):
                model(tokens)
        stats = handle.stats()
        sizes[name] = [unit.nbytes for unit in stats.units]
        assert stats.loads and stats.bytes_streamed == sum(unit.nbytes * unit.loads for unit in stats.units)
        handle.remove()
    assert all(q < 0.56 * b for q, b in zip(sizes["int8"], sizes["bf16"], strict=True)), sizes


@pytest.mark.parametrize("budget", ["all resident", "streamed"])
def test_layerwise_casting_copies_never_outlive_a_call(budget: str) -> None:
    """Layerwise casting re-points each layer's weights at new tensors (cast up before, down after its forward):
    after each call the unit views its own buffer again, so its copies are gone when its call is, and the
    activation peak measured while profiling covers them (resident units kept theirs for good before)."""
    from diffusers.hooks import apply_layerwise_casting

    torch.manual_seed(0)
    model = Stack(dim=64, depth=4)
    model.requires_grad_(False)
    apply_layerwise_casting(model.blocks, storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    tokens = torch.randint(0, 50, (2, 16))
    native = forwards(model, tokens, 1)[0]
    gpu_budget = 2**30 if budget == "all resident" else setup_minimum(model, "cpu")
    handle = ft.offload(model, include_patterns=["blocks.*"], gpu_budget=gpu_budget, device="cpu")
    for out in forwards(model, tokens, 5):
        assert torch.equal(out, native)
    assert handle.plan is not None and bool(handle.plan.resident) == (budget == "all resident")
    for unit in handle.units:
        flat = handle.binding.on_device(unit)
        start = flat.data_ptr() if flat is not None else handle.host.host_of(unit).data_ptr()
        for packed in unit.tensors:
            assert packed.tensor.data_ptr() == start + packed.offset, f"{unit.name}.{packed.names[0]}"
            assert packed.tensor.dtype == packed.dtype
    handle.remove()


@pytest.mark.parametrize("kind", ["torchao int8", "quanto qint8"])
def test_regional_compile_of_quantized_blocks_is_bitwise_equal_to_native(kind: str, tmp_path, monkeypatch) -> None:
    """Regionally compiled quantized blocks stream as the same compiled regions. (diffusers' layerwise casting does
    not compile natively: its hooks make parameters inside the region.)"""
    from flextensor_diffusers.pipelines.compile import compile_pipeline

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    native_pipe = quantized_pipeline(QUANTIZERS[kind])
    compile_pipeline(native_pipe, "regional")
    native = wan_latents(native_pipe, num_inference_steps=2)
    pipe = quantized_pipeline(QUANTIZERS[kind])
    compile_pipeline(pipe, "regional")
    enable_at_smallest(pipe)
    for _ in range(2):
        assert torch.equal(wan_latents(pipe, num_inference_steps=2), native)
    assert pipe.flextensor_report()["components"]["transformer"]["streamed_units"] > 0
    pipe.disable_flextensor_offload()


# ------------------------------------------------------------------------------------------------ made-up subclasses


class Int8Rows(torch.Tensor):
    """A made-up weight-only representation: a wrapper over ``qdata`` (int8) and ``scale`` (one float per row),
    with metadata of its own; F.linear dequantizes it."""

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, tag: str = "rows") -> Int8Rows:
        return torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=dtype, device=qdata.device)

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, tag: str = "rows") -> None:
        self.qdata, self.scale, self.tag = qdata, scale, tag

    def __tensor_flatten__(self) -> tuple[list[str], dict]:
        return ["qdata", "scale"], {"dtype": self.dtype, "tag": self.tag}

    @classmethod
    def __tensor_unflatten__(cls, inner: dict, ctx: dict, size: object, stride: object) -> Int8Rows:
        return cls(inner["qdata"], inner["scale"], ctx["dtype"], ctx["tag"])

    def dequantize(self) -> torch.Tensor:
        return self.qdata.to(self.dtype) * self.scale[:, None]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, *rest = args
            return F.linear(x, weight.dequantize(), *rest, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            names, ctx = args[0].__tensor_flatten__()
            inner = {name: getattr(args[0], name).detach() for name in names}
            return cls.__tensor_unflatten__(inner, ctx, None, None)
        raise NotImplementedError(f"{cls.__name__} does not implement {func}")


class Shifted(Int8Rows):
    """A wrapper inside a wrapper: ``base`` (an `Int8Rows`) plus one plain ``shift`` per row."""

    @staticmethod
    def __new__(cls, base: Int8Rows, shift: torch.Tensor) -> Shifted:
        return torch.Tensor._make_wrapper_subclass(cls, base.shape, dtype=base.dtype, device=base.device)

    def __init__(self, base: Int8Rows, shift: torch.Tensor) -> None:
        self.base, self.shift = base, shift

    def __tensor_flatten__(self) -> tuple[list[str], dict]:
        return ["base", "shift"], {"kind": "shifted"}

    @classmethod
    def __tensor_unflatten__(cls, inner: dict, ctx: dict, size: object, stride: object) -> Shifted:
        return cls(inner["base"], inner["shift"])

    def dequantize(self) -> torch.Tensor:
        return self.base.dequantize() + self.shift[:, None]


class Opaque(torch.Tensor):
    """A wrapper with no ``__tensor_flatten__``: nothing says which tensors it computes from."""

    @staticmethod
    def __new__(cls, payload: torch.Tensor) -> Opaque:
        return torch.Tensor._make_wrapper_subclass(cls, payload.shape, dtype=payload.dtype, device=payload.device)

    def __init__(self, payload: torch.Tensor) -> None:
        self.payload = payload

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return cls(args[0].payload)
        raise NotImplementedError(f"{cls.__name__} does not implement {func}")


class WithTable(torch.Tensor):
    """A subclass with bytes of its own that also holds a tensor in an attribute, unnamed."""


def int8_rows(weight: torch.Tensor, unaligned: bool) -> Int8Rows:
    """``weight`` as `Int8Rows`, its ``qdata`` transposed in memory and, with ``unaligned``, its ``scale`` 4 bytes
    past an aligned address: placements the kernels may tell apart, which offloading must keep."""
    scale = weight.abs().amax(dim=1).clamp(min=1e-6) / 127
    q = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
    qdata = torch.empty(q.shape[1], q.shape[0], dtype=torch.int8).t()
    qdata.copy_(q)
    if unaligned:
        scale = torch.empty(scale.numel() + 1, dtype=scale.dtype)[1:].copy_(scale)
    return Int8Rows(qdata, scale.to(weight.dtype), weight.dtype)


def made_up_stack(nested: bool) -> Stack:
    torch.manual_seed(0)
    model = Stack(dim=64, depth=4)
    model.requires_grad_(False)
    for i, block in enumerate(model.blocks):
        for layer in (block.qkv, block.out, block.ff[0], block.ff[2]):
            weight = int8_rows(layer.weight.detach(), unaligned=i % 2 == 0)
            if nested:
                weight = Shifted(weight, torch.randn(weight.shape[0]) * 0.01)
            layer.weight = nn.Parameter(weight, requires_grad=False)
    return model


def forwards(model: nn.Module, tokens: torch.Tensor, n: int) -> list[torch.Tensor]:
    with torch.inference_mode():
        return [model(tokens) for _ in range(n)]


@pytest.mark.parametrize("nested", [False, True], ids=["wrapper", "wrapper in a wrapper"])
def test_made_up_subclass_streams_bitwise_keeps_placement_and_restores(nested: bool) -> None:
    model = made_up_stack(nested)
    tokens = torch.randint(0, 50, (2, 16))
    native = forwards(model, tokens, 1)[0]
    before = snapshot(model)
    native_state = {k: describe(v, address=False) for k, v in model.state_dict().items()}
    weight = model.blocks[0].qkv.weight
    rows = weight.base if nested else weight
    placement = (rows.qdata.stride(), rows.scale.data_ptr() % 64)
    assert placement[0][0] == 1 and placement[1] == 4  # transposed, 4 bytes past an aligned address
    handle = ft.offload(model, include_patterns=["blocks.*"], gpu_budget=setup_minimum(model, "cpu"), device="cpu")
    for out in forwards(model, tokens, 5):  # discovery, profiling, steady
        assert torch.equal(out, native)
    assert handle.phase is Phase.STEADY and handle.plan is not None and handle.plan.num_slots > 0
    assert model.blocks[0].qkv.weight is weight and rows.tag == "rows"
    assert (rows.qdata.stride(), rows.scale.data_ptr() % 64) == placement  # kept while streamed
    offloaded_state = {k: describe(v, address=False) for k, v in model.state_dict().items()}
    assert native_state.keys() == offloaded_state.keys()
    for name, described in native_state.items():
        assert_described_equal(described, offloaded_state[name], name)
    handle.remove()
    assert_same(before, snapshot(model))
    assert torch.equal(forwards(model, tokens, 1)[0], native)


def test_edits_of_a_made_up_subclass_reach_every_copy() -> None:
    """An in-place edit of an inner tensor is found by its version counter; inside ``editing()`` an inner tensor
    swapped for another is adopted, and one of another shape is refused and put back. Outputs follow the native
    model edited alike."""
    model, reference = made_up_stack(False), made_up_stack(False)
    tokens = torch.randint(0, 50, (2, 16))
    handle = ft.offload(model, include_patterns=["blocks.*"], gpu_budget=setup_minimum(model, "cpu"), device="cpu")
    forwards(model, tokens, 4)
    for m in (model, reference):
        with torch.no_grad():
            m.blocks[2].out.weight.scale.mul_(1.5)
    assert torch.equal(forwards(model, tokens, 2)[-1], forwards(reference, tokens, 1)[0])
    with handle.editing():
        weight = model.blocks[1].ff[0].weight
        weight.qdata = weight.qdata.flip(0).contiguous()
    reference_weight = reference.blocks[1].ff[0].weight
    reference_weight.qdata = reference_weight.qdata.flip(0).contiguous()
    assert torch.equal(forwards(model, tokens, 2)[-1], forwards(reference, tokens, 1)[0])
    kept = model.blocks[3].qkv.weight.scale
    with pytest.raises(ft.FlexTensorError, match=r"blocks\.3\.qkv\.weight\.scale"), handle.editing():
        model.blocks[3].qkv.weight.scale = torch.ones(3)
    assert model.blocks[3].qkv.weight.scale is kept
    assert torch.equal(forwards(model, tokens, 1)[0], forwards(reference, tokens, 1)[0])
    handle.remove()


def refused_stack(case: str) -> Stack:
    model = made_up_stack(False)
    layer = model.blocks[1].out
    if case == "no __tensor_flatten__":
        layer.weight = nn.Parameter(Opaque(layer.weight.detach().dequantize()), requires_grad=False)
    elif case == "inner tensors share memory":
        weight = layer.weight
        both = torch.cat([weight.scale, weight.scale])
        weight.scale = both[: weight.scale.numel()]
        layer.register_buffer("twin", both[weight.scale.numel() :])
    elif case == "an unnamed tensor":
        layer.weight.lookup = torch.zeros(4)
    elif case == "a subclass holding a tensor":
        held = torch.Tensor._make_subclass(WithTable, torch.zeros(8))
        held.table = torch.zeros(4)
        layer.register_buffer("held", held)
    elif case == "an inner tensor held elsewhere":
        model.blocks[2].register_buffer("alias", layer.weight.scale)
    return model


@pytest.mark.parametrize(
    "case",
    [
        "no __tensor_flatten__",
        "inner tensors share memory",
        "an unnamed tensor",
        "a subclass holding a tensor",
        "an inner tensor held elsewhere",
    ],
)
def test_a_representation_that_cannot_stream_is_refused_at_set_up_leaving_the_model(case: str) -> None:
    model = refused_stack(case)
    before = snapshot(model)
    with pytest.raises(ft.UnsupportedTensorError, match=r"'blocks\.[12]\.(out|alias).*(dequantize|clone)") as refused:
        ft.offload(model, include_patterns=["blocks.*"], gpu_budget=2**30, device="cpu")
    assert "\n" not in str(refused.value)
    assert_same(before, snapshot(model))


def test_a_pipeline_refuses_the_component_and_names_the_others() -> None:
    pipe = build_pipeline("wan22_t2v", "tiny")
    layer = pipe.transformer_2.blocks[0].attn1.to_q
    layer.weight = nn.Parameter(Opaque(layer.weight.detach().clone()), requires_grad=False)
    before = snapshot(pipe.transformer)
    with pytest.raises(
        ft.UnsupportedTensorError, match=r"^transformer_2: 'blocks\.0\.attn1\.to_q\.weight'.*components="
    ):
        pipe.enable_flextensor_offload(budget=2**30, device="cpu")
    assert ft.pipeline_offload(pipe) is None
    assert_same(before, snapshot(pipe.transformer))


def test_a_saved_profile_tells_a_quantized_model_from_its_original() -> None:
    """Same names, shapes and outer dtypes, other bytes and other activations: another fingerprint."""
    quantization = pytest.importorskip("torchao.quantization")
    from flextensor_diffusers.engine.profile import model_fingerprint

    original = Stack(dim=64, depth=2, dtype=torch.bfloat16)
    quantized = copy.deepcopy(original)
    quantization.quantize_(quantized.blocks, quantization.Int8WeightOnlyConfig())
    assert model_fingerprint(original, [])["sha256"] == model_fingerprint(copy.deepcopy(original), [])["sha256"]
    assert model_fingerprint(original, [])["sha256"] != model_fingerprint(quantized, [])["sha256"]


# ------------------------------------------------------------------------------------------------ on a GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["torchao int8", "layerwise float8"])
def test_quantized_stack_peak_stays_within_the_smallest_budget_on_cuda(kind: str) -> None:
    """On the device: quantized wrappers follow their leaves there, outputs equal native, and the process's peak of
    allocated memory stays within the smallest measured budget (layerwise casting's copies included)."""
    from tests.models import measured_smallest

    def make() -> Stack:
        """The same quantized stack, on the CPU (made anew each time: layerwise casting's hooks hold their module,
        so a deep copy would compute with the original's weights)."""
        torch.manual_seed(0)
        # Units of 32 MB (int8), 24 of them: the 22 a two-slot plan streams (704 MB) outweigh by far the measured
        # budget's activation margin, 5 % of all the process holds on the device (other tests' leftovers included:
        # with 8 units, a reversed run's leftovers made that margin hold every unit, and the plan streamed none).
        model = Stack(dim=2048, depth=24, dtype=torch.bfloat16)
        model.requires_grad_(False)
        if kind == "torchao int8":
            torchao_int8(model.blocks)
        else:
            from diffusers.hooks import apply_layerwise_casting

            apply_layerwise_casting(model.blocks, storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
        return model

    tokens = torch.randint(0, 50, (4, 64), device="cuda")
    native = make().to("cuda")
    with torch.inference_mode():
        expected = native(tokens)
    del native
    model = make()
    budget = measured_smallest(model, lambda probe: forwards(probe, tokens, 3), "cuda", make_probe=make)
    torch.cuda.synchronize()
    ft.reset_peak_memory_stats("cuda")
    handle = ft.offload(model, include_patterns=["blocks.*"], gpu_budget=budget, device="cuda")
    for out in forwards(model, tokens, 5):
        assert torch.equal(out, expected)
    figures = {
        "budget": budget,
        "unit_bytes": [unit.nbytes for unit in handle.units],
        "activation_peak_bytes": handle.profile.activation_peak_bytes if handle.profile is not None else None,
        "resident_weight_bytes": handle.resident_weight_bytes,
    }
    assert handle.plan is not None and handle.plan.num_slots > 0, figures
    torch.cuda.synchronize()
    assert ft.max_memory_allocated("cuda") <= budget  # the engine's own resets folded in
    handle.remove()
