"""torch.compile with offload: regional compilation in either order is bitwise equal to the same
compilation run natively, with no recompilation once warm, and disable restores every tensor;
whole-model compilation and CUDA graphs are refused at the call.

The tiny Wan2.2 pipeline (both experts) on the CPU with inductor (needs a C compiler); a shared
inductor cache keeps the compile time of the module small.
"""

from __future__ import annotations

import pytest
import torch

import flextensor_diffusers as ft
from flextensor_diffusers.pipelines.compile import compile_pipeline
from flextensor_diffusers.recipes.models import build_pipeline
from tests.models import assert_same, enable_with_one_component_in_ram, set_host_overhead, snapshot, wan_latents

BUDGET = 250_000  # streams the transformer blocks through two slots


def generate(pipe, **shape) -> torch.Tensor:
    return wan_latents(pipe, num_inference_steps=3, **shape)


def graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]  # torch private: its graph counter


@pytest.fixture(scope="module", autouse=True)
def inductor_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
        yield


@pytest.fixture(scope="module")
def native_regional() -> torch.Tensor:
    """The natively, regionally compiled output (two generations are equal: checked)."""
    pipe = build_pipeline("wan22_t2v", "tiny")
    compile_pipeline(pipe, "regional")
    runs = [generate(pipe) for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    return runs[0]


@pytest.mark.parametrize("order", ["compile, then enable", "enable, then compile"])
def test_regional_compile_with_offload_is_bitwise_equal_to_native_regional(native_regional, order: str) -> None:
    pipe = build_pipeline("wan22_t2v", "tiny")
    before = {name: snapshot(getattr(pipe, name)) for name in ("transformer", "transformer_2")}
    if order == "compile, then enable":
        compile_pipeline(pipe, "regional")
        pipe.enable_flextensor_offload(budget=BUDGET, device="cpu")
    else:
        pipe.enable_flextensor_offload(budget=BUDGET, device="cpu")
        compile_pipeline(pipe, "regional")
    outs = [generate(pipe) for _ in range(2)]
    warm = graphs()
    outs.append(generate(pipe))
    assert graphs() == warm, "recompiled after warm-up"
    for out in outs:
        assert torch.equal(out, native_regional)
    report = pipe.flextensor_report()["components"]
    assert report["transformer"]["phase"] == "steady" and report["transformer"]["streamed_units"] > 0
    pipe.disable_flextensor_offload()
    for name, snap in before.items():
        assert_same(snap, getattr(pipe, name))
    assert torch.equal(generate(pipe), native_regional)


def test_blocks_compiled_natively_for_two_shapes_stream_without_recompiling() -> None:
    """Offloading keeps the compiled regions native compilation made: no recompilation (which, for
    blocks already seen at two shapes, would be a dynamic-shape graph with other numerics)."""
    pipe = build_pipeline("wan22_t2v", "tiny")
    compile_pipeline(pipe, "regional")
    shapes = [dict(height=32, width=32), dict(height=48, width=32)]
    refs = [generate(pipe, **shape) for shape in shapes]
    pipe.enable_flextensor_offload(budget=BUDGET, device="cpu")
    before = graphs()
    for _ in range(2):
        for shape, ref in zip(shapes, refs, strict=True):
            assert torch.equal(generate(pipe, **shape), ref)
    assert graphs() == before
    pipe.disable_flextensor_offload()


def test_regional_compile_with_one_expert_on_disk_is_bitwise_equal_and_does_not_recompile(
    native_regional, tmp_path, monkeypatch
) -> None:
    """A host budget of one expert: each switch reads the other expert back from its cache file into new
    host buffers. The compiled blocks run on them as natively compiled, and no switch recompiles them."""
    set_host_overhead(monkeypatch, own=0, reserve=0)
    pipe = build_pipeline("wan22_t2v", "tiny")
    compile_pipeline(pipe, "regional")
    enable_with_one_component_in_ram(pipe, BUDGET, tmp_path)
    outs = [generate(pipe) for _ in range(2)]
    warm = graphs()
    outs.append(generate(pipe))
    assert graphs() == warm, "recompiled after warm-up"
    assert all(torch.equal(out, native_regional) for out in outs)
    assert len(pipe.flextensor_report()["host_tier"]["disk_reads_s"]) >= 3  # the experts took turns in RAM
    pipe.disable_flextensor_offload()
    assert torch.equal(generate(pipe), native_regional)


def test_compiling_after_profiling_profiles_again() -> None:
    """The plan is made from compiled compute times: compiling a steady handle's blocks sends it back
    to a warm-up forward and a profiling forward."""
    pipe = build_pipeline("wan22_t2v", "tiny")
    pipe.enable_flextensor_offload(budget=BUDGET, device="cpu")
    generate(pipe)
    handle = ft.pipeline_offload(pipe).handles["transformer"]
    assert handle.phase.value == "steady"
    plans = handle.counters["plans"]
    compile_pipeline(pipe, "regional")
    assert handle.phase.value == "discovery"
    generate(pipe)
    assert handle.phase.value == "steady" and handle.counters["plans"] == plans + 1
    assert handle.counters["discovery"] == 2
    pipe.disable_flextensor_offload()


def test_whole_model_compile_is_refused_in_every_order() -> None:
    """Whole-model compilation would break its graph at every block: outputs would differ from native
    whole-model compilation. Refused at the call, naming regional compilation; nothing is changed."""
    pipe = build_pipeline("wan22_t2v", "tiny")
    before = snapshot(pipe.transformer)
    pipe.transformer.compile()  # compile, then enable
    with pytest.raises(ft.FlexTensorError, match="compile_repeated_blocks"):
        pipe.enable_flextensor_offload(budget=BUDGET, device="cpu")
    assert ft.pipeline_offload(pipe) is None and type(pipe.transformer).__name__ == "WanTransformer3DModel"
    assert_same(before, pipe.transformer)

    pipe = build_pipeline("wan22_t2v", "tiny")
    pipe.transformer = torch.compile(pipe.transformer)  # the wrapper, then enable
    with pytest.raises(ft.FlexTensorError, match="compile_repeated_blocks"):
        pipe.enable_flextensor_offload(budget=BUDGET, device="cpu")

    pipe = build_pipeline("wan22_t2v", "tiny")
    pipe.enable_flextensor_offload(budget=BUDGET, device="cpu")
    with pytest.raises(ft.FlexTensorError, match="compile_repeated_blocks"):  # enable, then compile in place
        compile_pipeline(pipe, "full")
    transformer = pipe.transformer
    pipe.transformer = torch.compile(transformer)  # enable, then the wrapper: refused at its first call
    with pytest.raises(ft.FlexTensorError, match="compile_repeated_blocks"):
        generate(pipe)
    pipe.transformer = transformer
    ref = build_pipeline("wan22_t2v", "tiny")
    assert torch.equal(generate(pipe), generate(ref))  # still right after the refusal
    pipe.disable_flextensor_offload()


def test_cuda_graph_modes_are_refused_at_the_call() -> None:
    pipe = build_pipeline("wan22_t2v", "tiny")
    pipe.enable_flextensor_offload(budget=BUDGET, device="cpu")
    with pytest.raises(ft.FlexTensorError, match=r"CUDA graphs.*max-autotune-no-cudagraphs"):
        pipe.transformer.compile_repeated_blocks(fullgraph=True, mode="reduce-overhead")
    with pytest.raises(ft.FlexTensorError, match="CUDA graphs"):
        pipe.transformer.blocks[0].compile(mode="max-autotune")
    pipe.disable_flextensor_offload()
    other = build_pipeline("wan22_t2v", "tiny")
    other.transformer.compile_repeated_blocks(fullgraph=True, mode="reduce-overhead")
    with pytest.raises(ft.FlexTensorError, match="CUDA graphs"):
        other.enable_flextensor_offload(budget=BUDGET, device="cpu")
    assert ft.pipeline_offload(other) is None


def test_models_without_declared_repeated_blocks_compile_their_streamed_blocks() -> None:
    """Cosmos' models declare no ``_repeated_blocks``: regional compilation compiles each block the
    offload patterns stream (here a block stack), and offloading keeps those regions."""
    from flextensor_diffusers.pipelines.compile import compile_blocks
    from tests.models import Stack

    torch.manual_seed(0)
    model, x = Stack(depth=3).eval().requires_grad_(False), torch.randint(0, 50, (2, 16))
    compile_blocks("transformer", model)
    assert all(block.__dict__.get("_compiled_call_impl") is not None for block in model.blocks)
    with torch.inference_mode():
        ref = model(x)
        handle = ft.offload(model, include_patterns=["blocks.*"], gpu_budget=100_000, device="cpu")
        before = graphs()
        outs = [model(x) for _ in range(3)]
    assert graphs() == before and all(torch.equal(o, ref) for o in outs)
    handle.remove()
