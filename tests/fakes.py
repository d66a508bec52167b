"""Stand-ins for optional packages, installed through Python's own import machinery (no download, no real package)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from pathlib import Path

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
