"""A pipeline made from an offloaded pipeline's components (``OtherPipeline(**pipe.components)``) shares its offload
when it asks for the same, before or after the first pipeline ran; anything else is refused before anything
changes, naming the fix."""

from __future__ import annotations

import pytest
import torch

import flextensor_diffusers as ft
from flextensor_diffusers.recipes.models import build_pipeline
from tests.models import wan_latents

BUDGET = 250_000


def latents(pipe) -> torch.Tensor:
    return wan_latents(pipe, num_inference_steps=2)


@pytest.fixture(scope="module")
def native() -> tuple[torch.Tensor, torch.Tensor]:
    """The latents of the pipeline, and of one made from its components (with the constructor's defaults for
    what is not a component: Wan2.2's ``boundary_ratio``)."""
    pipe = build_pipeline("wan22_t2v", "tiny")
    return latents(pipe), latents(type(pipe)(**pipe.components))


@pytest.mark.parametrize("first_ran", [False, True], ids=["before any run", "after a run"])
def test_a_pipeline_of_the_same_components_shares_the_offload(native: tuple, first_ran: bool) -> None:
    native, native_other = native
    pipe = build_pipeline("wan22_t2v", "tiny")
    pipe.enable_flextensor_offload(budget=BUDGET, device="cpu")
    if first_ran:
        assert torch.equal(latents(pipe), native)
    other = type(pipe)(**pipe.components)
    state = other.enable_flextensor_offload(budget=BUDGET, device="cpu")
    assert state is ft.pipeline_offload(pipe) is ft.pipeline_offload(other)  # one offload, one set of host copies
    assert torch.equal(latents(other), native_other)
    assert torch.equal(latents(pipe), native)
    assert torch.equal(latents(other), native_other)
    with pytest.raises(ft.OffloadStateError, match="disable it first"):
        other.enable_flextensor_offload(budget=BUDGET, device="cpu")  # already enabled on this one
    with pytest.raises(ft.OffloadStateError, match="disable_flextensor_offload"):
        other.to("cpu")
    other.disable_flextensor_offload()  # disabled for both: the components are the same modules
    assert ft.pipeline_offload(pipe) is None
    assert torch.equal(latents(pipe), native)
    pipe.enable_flextensor_offload(budget=BUDGET, device="cpu")  # and can be enabled again
    assert torch.equal(latents(pipe), native)


@pytest.mark.parametrize("first_ran", [False, True], ids=["before any run", "after a run"])
def test_other_options_or_other_components_are_refused_naming_the_fix(first_ran: bool) -> None:
    pipe = build_pipeline("wan22_t2v", "tiny")
    pipe.enable_flextensor_offload(budget=BUDGET, device="cpu")
    if first_ran:
        latents(pipe)
    other = type(pipe)(**pipe.components)
    with pytest.raises(ft.OffloadStateError, match=r"other options \(budget\): enable with the same options"):
        other.enable_flextensor_offload(budget=2 * BUDGET, device="cpu")
    assert ft.pipeline_offload(other) is None
    single = type(pipe)(**{**pipe.components, "transformer_2": None})  # only some of the offloaded components
    with pytest.raises(ft.OffloadStateError, match=r"not all this pipeline's .*disable_flextensor_offload\(\)"):
        single.enable_flextensor_offload(budget=BUDGET, device="cpu")
    assert ft.pipeline_offload(single) is None and "to" not in vars(single)
    pipe.disable_flextensor_offload()
    single.enable_flextensor_offload(budget=BUDGET, device="cpu")  # the fix named works
    latents(single)


def test_a_component_offloaded_with_a_handle_of_its_own_is_refused_as_such() -> None:
    pipe = build_pipeline("wan22_t2v", "tiny")
    handle = ft.offload(pipe.transformer, include_patterns=["blocks.*"], gpu_budget=BUDGET, device="cpu")
    with pytest.raises(ft.OffloadStateError, match=r"'transformer' are offloaded already.*remove\(\)"):
        pipe.enable_flextensor_offload(budget=BUDGET, device="cpu")
    handle.remove()
