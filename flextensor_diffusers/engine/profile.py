"""Profiles on disk: what was measured, for which model, device and workload.

A profile lets a later run skip discovery and profiling. It is only reused when it describes the
same model (names, shapes and dtypes of every tensor, and the same units), the same device, and the
same workload (shapes and dtypes of the inputs); otherwise the reason is given.

A ``profile_dir`` is read and written only when it is a folder of this user's that other users cannot write
(`private_files`; made 0700 when missing): a profile written by someone else would plan this user's budget.
Each profile is written to a new 0600 file (``mkstemp``) and renamed over its name.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..storage.private_files import PROFILE_FOLDER, check_private_folder, private_folder
from .errors import ProfileMismatchError
from .planner import Call, WorkloadProfile
from .subclasses import representation

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
#: An instance attribute by which a module that computes otherwise than its class says how (a string, e.g. a
#: feed-forward in chunks): part of the fingerprint, so that activations measured one way never plan the other.
VARIANT_ATTRIBUTE = "_flextensor_variant"


def model_fingerprint(model: nn.Module, unit_names: list[str]) -> dict[str, Any]:
    """A digest of every tensor's name, shape and dtype, of the unit list, and of modules' variants."""
    digest = hashlib.sha256()
    dtypes: dict[str, int] = {}
    count = 0
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(
        model.named_buffers(remove_duplicate=False)
    ):
        digest.update(f"{name}:{tuple(t.shape)}:{t.dtype}{representation(t)};".encode())
        dtypes[str(t.dtype)] = dtypes.get(str(t.dtype), 0) + t.numel()
        count += 1
    digest.update(("|".join(unit_names)).encode())
    for name, module in model.named_modules():
        if (variant := module.__dict__.get(VARIANT_ATTRIBUTE)) is not None:
            digest.update(f";{name}:{variant}".encode())
    return {"class": type(model).__name__, "sha256": digest.hexdigest(), "tensors": count, "dtypes": dtypes}


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def workload_signature(args: tuple, kwargs: dict) -> str:
    """Shapes and dtypes of the tensors passed to the model's forward (scalars by value)."""

    def describe(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return f"T{tuple(x.shape)}:{str(x.dtype).removeprefix('torch.')}"
        if isinstance(x, (list, tuple)):
            return [describe(v) for v in x]
        if isinstance(x, dict):
            return {str(k): describe(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
        if isinstance(x, (int, float, bool, str)) or x is None:
            return x
        return type(x).__name__

    return json.dumps({"args": describe(list(args)), "kwargs": describe(kwargs)}, sort_keys=True)


@dataclass
class SavedProfile:
    fingerprint: dict[str, Any]
    device: str
    workload: str
    profile: WorkloadProfile
    torch_version: str = torch.__version__
    format_version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["profile"]["calls"] = [asdict(c) for c in self.profile.calls]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SavedProfile:
        if data.get("format_version") != FORMAT_VERSION:
            raise ProfileMismatchError(
                f"profile format {data.get('format_version')} is not {FORMAT_VERSION}: delete it to re-profile"
            )
        p = dict(data["profile"])
        p["calls"] = [Call(**c) for c in p["calls"]]
        return cls(
            fingerprint=data["fingerprint"],
            device=data["device"],
            workload=data["workload"],
            profile=WorkloadProfile(**p),
            torch_version=data.get("torch_version", ""),
            format_version=data["format_version"],
        )

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # A name of its own in the same folder, renamed when complete: an interrupted write leaves the old file
        # or nothing, and two processes saving at once do not write into one temporary file.
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as file:
                file.write(json.dumps(self.to_json(), indent=1))
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    @classmethod
    def load(cls, path: str | Path) -> SavedProfile:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ProfileMismatchError(f"cannot read profile {path}: {exc}; delete it to re-profile") from exc
        return cls.from_json(data)

    def mismatch(self, fingerprint: dict[str, Any], device: str) -> str | None:
        """Why this profile does not describe ``fingerprint`` on ``device``; None when it does."""
        mine, theirs = self.fingerprint, fingerprint
        if mine["class"] != theirs["class"]:
            return f"it was recorded for a {mine['class']}, this model is a {theirs['class']}"
        if sorted(mine["dtypes"]) != sorted(theirs["dtypes"]):
            return f"it was recorded with dtypes {sorted(mine['dtypes'])}, this model has {sorted(theirs['dtypes'])}"
        if mine["sha256"] != theirs["sha256"]:
            return (
                f"it was recorded for another model or unit selection ({mine['tensors']} tensors, digest "
                f"{mine['sha256'][:12]}; this one: {theirs['tensors']} tensors, {theirs['sha256'][:12]})"
            )
        if self.device != device:
            return f"it was recorded on {self.device!r}, this device is {device!r}"
        return None


class ProfileStore:
    """The profiles of one offloaded model: per workload signature, in memory for this process and,
    with ``profile`` or ``profile_dir``, on disk. A saved profile of another model, dtype or device is
    refused (or ignored with ``reprofile``); so is ``profile`` recorded for other inputs."""

    def __init__(
        self,
        model_class: str,
        fingerprint: dict[str, Any],
        device: str,
        profile: str | Path | None,
        profile_dir: str | Path | None,
        reprofile: bool,
    ) -> None:
        self.model_class = model_class
        self.fingerprint = fingerprint
        self.device = device
        self.profile_file = Path(profile) if profile is not None else None
        self.profile_dir = Path(profile_dir) if profile_dir is not None else None
        if self.profile_dir is not None and os.path.lexists(self.profile_dir):  # before packing: refused at once
            check_private_folder(self.profile_dir, PROFILE_FOLDER)
        self.reprofile = reprofile
        self.known: dict[str, SavedProfile] = {}
        #: The ``profile`` file, checked at once against this model (the workload is checked at first use).
        self.given = self.load(self.profile_file) if self.profile_file is not None else None

    def load(self, path: Path) -> SavedProfile | None:
        """The profile at ``path`` when it describes this model and device; None when there is none."""
        if not path.exists():
            return None
        saved = SavedProfile.load(path)
        reason = saved.mismatch(self.fingerprint, self.device)
        if reason is None:
            return saved
        if not self.reprofile:
            raise ProfileMismatchError(
                f"profile {path} does not match: {reason}. Delete it or point OffloadConfig.profile elsewhere, "
                "or pass reprofile_on_mismatch=True to profile again"
            )
        logger.warning("profile %s does not match (%s); profiling again", path, reason)
        return None

    def path_for(self, signature: str) -> Path | None:
        """Where the profile of this model, device and workload lives (None: not kept)."""
        if self.profile_file is not None:
            return self.profile_file
        if self.profile_dir is None:
            return None
        slug = re.sub(r"[^A-Za-z0-9]+", "-", self.device).strip("-").lower()
        workload = hashlib.sha256(signature.encode()).hexdigest()[:12]
        return self.profile_dir / f"{self.model_class}-{self.fingerprint['sha256'][:12]}-{slug}-{workload}.json"

    def find(self, signature: str, first: bool) -> SavedProfile | None:
        """A profile of this workload: known in this process, the given file (first workload only),
        or the workload's file in ``profile_dir``; None: it has to be profiled."""
        saved = self.known.get(signature)
        path = self.path_for(signature)
        if saved is None and first and self.given is not None:
            saved, self.given = self.given, None
        elif saved is None and self.profile_dir is not None and path is not None:
            saved = self.load(path)
        if saved is None:
            return None
        if saved.workload == signature:
            self.known[signature] = saved
            return saved
        if not self.reprofile:
            raise ProfileMismatchError(
                f"profile {path} was recorded for inputs {saved.workload}, these are {signature}. "
                "Delete it, use profile_dir= to keep one profile per workload, or pass "
                "reprofile_on_mismatch=True to profile this workload"
            )
        logger.warning("profile %s was recorded for other inputs; profiling again", path)
        return None

    def record(self, signature: str, profile: WorkloadProfile) -> SavedProfile:
        """Keep a freshly measured profile (and save it where profiles are kept)."""
        saved = SavedProfile(self.fingerprint, self.device, signature, profile)
        self.known[signature] = saved
        path = self.path_for(signature)
        if path is not None:
            if self.profile_dir is not None:
                private_folder(self.profile_dir, PROFILE_FOLDER)
            saved.save(path)
            logger.info("saved profile %s", path)
        return saved
