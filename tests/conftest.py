"""The ``device`` fixture (cpu, and cuda where there is one), a device state of its own for every GPU test, and
``--order`` to run the tests in another order (reverse, or shuffled with a seed) without a plugin."""

from __future__ import annotations

import os
import random

import pytest
import torch

from tests.device_state import settle_cuda

if workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")):
    # Tests run in several worker processes (pytest-xdist): each takes its share of the cores, so that torch's
    # threads do not outnumber them (the tiny models' ops are too small to gain from more).
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
    ),
]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(autouse=True)
def cuda_state_of_its_own(request: pytest.FixtureRequest) -> None:
    """A GPU test starts from a device state of its own (`settle_cuda`), so that what it measures does not depend
    on the tests run before it."""
    if request.node.get_closest_marker("gpu") is not None:
        settle_cuda()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--order",
        default="default",
        help="test order: default, reverse, or shuffle:SEED (files and the tests in each file shuffled; each file's "
        "tests stay together, so that its module fixtures are set up once)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    group_for_workers(items)
    order = config.getoption("--order")
    if order == "default":
        return
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(str(item.path), []).append(item)
    groups = list(files.values())
    if order == "reverse":
        groups = [group[::-1] for group in groups[::-1]]
    elif order.startswith("shuffle:"):
        shuffler = random.Random(int(order.removeprefix("shuffle:")))
        shuffler.shuffle(groups)
        for group in groups:
            shuffler.shuffle(group)
    else:
        raise pytest.UsageError(f"--order {order!r}: use default, reverse or shuffle:SEED")
    items[:] = [item for group in groups for item in group]


def group_for_workers(items: list[pytest.Item]) -> None:
    """Groups for ``-n N --dist loadgroup`` (the README's command, pytest-xdist): each file's tests run in one
    worker, so that its module fixtures are made once; every GPU test runs in one worker too, one after another,
    since a test's device measurements assume the device to itself (without ``-n`` the groups do nothing)."""
    on_gpu = torch.cuda.is_available()
    for item in items:
        gpu = on_gpu and item.get_closest_marker("gpu") is not None
        item.add_marker(pytest.mark.xdist_group("gpu" if gpu else item.path.name))
