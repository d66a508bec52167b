"""Stand-ins for optional packages, installed through Python's own import machinery (no download, no real package)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch


class FailingImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A package that is installed (``find_spec`` finds it) but whose import fails, as stlpips-pytorch's does
    without IPython."""

    def __init__(self, name: str, error: BaseException) -> None:
        self.name, self.error = name, error

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec:
        return importlib.machinery.ModuleSpec(fullname, self) if fullname == self.name else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: object) -> None:
        raise self.error


def st_lpips_without_ipython(monkeypatch: pytest.MonkeyPatch, hub: Path) -> None:
    """No LPIPS backbone weights in the torch cache (``hub``), and an stlpips-pytorch that fails to import."""
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(hub))
    monkeypatch.delitem(sys.modules, "stlpips_pytorch", raising=False)
    error = ModuleNotFoundError("No module named 'IPython'", name="IPython")
    monkeypatch.setattr(sys, "meta_path", [FailingImport("stlpips_pytorch", error), *sys.meta_path])


class StopAfterFirstPackets:
    """A PyAV output container that calls ``stop`` once its first packets are muxed: the file has begun (header
    and data), as when Ctrl-C lands while an mp4 is written. Everything else goes to the real container."""

    def __init__(self, container: Any, stop: Callable[[], None]) -> None:
        self._container, self._stop = container, stop

    def __enter__(self) -> StopAfterFirstPackets:
        self._container.__enter__()
        return self

    def __exit__(self, *exc: object) -> Any:
        return self._container.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._container, name)

    def mux(self, packets: Any) -> None:
        self._container.mux(packets)
        if packets:
            self._stop()


def open_that_stops(real_open: Callable[..., Any], stop: Callable[[], None]) -> Callable[..., Any]:
    """``av.open`` whose containers opened for writing (``mode="w"``) call ``stop`` after their first packets."""

    def open_then_stop(*args: Any, **kwargs: Any) -> Any:
        container = real_open(*args, **kwargs)
        return StopAfterFirstPackets(container, stop) if kwargs.get("mode") == "w" else container

    return open_then_stop
