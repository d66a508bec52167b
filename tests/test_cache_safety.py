"""Cache files on a machine shared with other users (issue 46): the default folder is the user's own (0700), a
folder another user could write into or redirect is refused before anything is packed, every file is made new
(0600) without following a link planted at its name, and a payload read back is checked against what this process
holds in memory, not against the record in the file.

The links are planted where another user would have to guess: at the names the package uses, for this process's
id and the few hundred after it (the old temporary names included), pointing at a file of the user's outside the
folder. Each operation must leave that file byte for byte as it was, and either succeed with a fresh file of its
own or refuse with one line. These tests run as root in CI: a folder of "another user" is one chowned to 12345.
"""

from __future__ import annotations

import json
import os
import stat
import zlib
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import flextensor_diffusers as ft
from flextensor_diffusers.engine import setup
from flextensor_diffusers.engine.config import cache_folder
from flextensor_diffusers.engine.units import align
from flextensor_diffusers.recipes.models import build_pipeline
from flextensor_diffusers.storage.cache_files import RawCacheFile, map_cache_file, write_cache_file
from flextensor_diffusers.storage.codec import EncodedUnit
from flextensor_diffusers.storage.payload_cache import FILE_ALIGNMENT, PayloadCache
from tests.models import (
    Stack,
    assert_refused_as_it_was,
    assert_same,
    enable_with_one_component_in_ram,
    set_host_overhead,
    snapshot,
    wan_latents,
)

VICTIM_BYTES = b"a file of the user's, outside the cache folder: weights must never land here\n"
#: Process ids a link is planted for: this one and the next ones (a guess at the next runs of the package).
PIDS_AHEAD = 300
BUDGET = 250_000  # the tiny Wan2.2 pipeline's transformer blocks stream (as in tests.test_host_tier)
OTHER_UID = 12345


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file of the user's outside every cache folder, which planted links point at."""
    path = tmp_path / "home" / "notes.txt"
    path.parent.mkdir()
    path.write_bytes(VICTIM_BYTES)
    return path


def next_pids() -> range:
    return range(os.getpid(), os.getpid() + PIDS_AHEAD)


def plant(names: Iterable[Path], victim: Path) -> int:
    """A symbolic link to ``victim`` at each of ``names``; how many."""
    count = 0
    for name in names:
        name.symlink_to(victim)
        count += 1
    return count


def assert_untouched(victim: Path) -> None:
    assert victim.read_bytes() == VICTIM_BYTES
    assert sorted(p.name for p in victim.parent.iterdir()) == [victim.name]


def assert_private_file(path: Path) -> None:
    """A regular file (not a link), of this user's, mode 0600."""
    found = os.lstat(path)
    assert stat.S_ISREG(found.st_mode), path
    assert found.st_uid == os.geteuid()
    assert stat.S_IMODE(found.st_mode) == 0o600, oct(found.st_mode)


def private_cache(tmp_path: Path) -> Path:
    return cache_folder(tmp_path / "cache")


def fake_units(sizes: list[int]) -> tuple[list[SimpleNamespace], list[torch.Tensor]]:
    """Stand-ins for units (what the cache files read of them: their size and host bytes) and their bytes."""
    hosts = [torch.arange(n, dtype=torch.int64).remainder(251).to(torch.uint8) for n in sizes]
    return [SimpleNamespace(nbytes=n, host=h) for n, h in zip(sizes, hosts, strict=True)], hosts


# ------------------------------------------------------------------------------------ folders


def test_the_default_cache_folder_is_the_users_own_made_0700(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    folder = cache_folder(None)
    assert folder == tmp_path / "xdg" / "flextensor-diffusers"
    found = os.lstat(folder)
    assert stat.S_ISDIR(found.st_mode) and found.st_uid == os.geteuid()
    assert stat.S_IMODE(found.st_mode) == 0o700
    assert cache_folder(None) == folder  # made before: accepted as it is


def test_a_link_planted_at_the_default_folder_is_refused_not_followed(tmp_path, monkeypatch, victim) -> None:
    (tmp_path / "xdg").mkdir()
    (tmp_path / "xdg" / "flextensor-diffusers").symlink_to(victim.parent)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with pytest.raises(ft.FlexTensorError, match=r"is a symbolic link.*cache_dir") as refused:
        cache_folder(None)
    assert len(str(refused.value).splitlines()) == 1
    assert_untouched(victim)


def open_to_all(tmp_path: Path) -> Path:
    folder = tmp_path / "open"
    folder.mkdir()
    folder.chmod(0o777)
    return folder


def of_another_user(tmp_path: Path) -> Path:
    if os.geteuid() != 0:
        pytest.skip("making a folder of another user needs root")
    folder = tmp_path / "theirs"
    folder.mkdir(mode=0o700)
    os.chown(folder, OTHER_UID, OTHER_UID)
    return folder


def linked(tmp_path: Path) -> Path:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    return tmp_path / "link"


REFUSED_FOLDERS = {
    "mode 0777": (open_to_all, r"can be written by other users \(mode 0777\): pass another cache_dir"),
    "another user's": (of_another_user, rf"belongs to another user \(uid {OTHER_UID}.*pass another cache_dir"),
    "a symbolic link": (linked, r"is a symbolic link.*pass another cache_dir"),
}


@pytest.mark.parametrize("kind", list(REFUSED_FOLDERS))
@pytest.mark.parametrize("written", ["payload file", "raw cache file"])
def test_a_cache_dir_others_can_reach_is_refused_before_packing(tmp_path, kind: str, written: str) -> None:
    """A ``cache_dir`` other users could write or redirect: refused with one line naming ``cache_dir`` before
    anything is packed (every tensor as it was, same objects), nothing written there; the model can then be
    offloaded with a folder of the user's own."""
    make_folder, refusal = REFUSED_FOLDERS[kind]
    folder = make_folder(tmp_path)
    files = {"payload file": dict(compression_cache=True), "raw cache file": dict(raw_copies="disk")}[written]
    torch.manual_seed(0)
    model = Stack(dim=32, depth=3).eval().requires_grad_(False)
    before = snapshot(model)
    config = dict(include_patterns=["blocks.*"], gpu_budget=2**30, device="cpu", compression="lossless", **files)
    with pytest.raises(ft.FlexTensorError, match=refusal) as refused:
        ft.offload(model, cache_dir=folder, **config)
    assert len(str(refused.value).splitlines()) == 1
    assert_same(before, model)
    assert not any(Path(folder).iterdir())
    ft.offload(model, cache_dir=tmp_path / "mine", **config).remove()


def test_the_host_tiers_cache_dir_is_refused_before_packing(tmp_path, monkeypatch) -> None:
    set_host_overhead(monkeypatch, own=0, reserve=0)
    refusal = r"can be written by other users \(mode 0777\): pass another cache_dir"
    enable = dict(budget=BUDGET, device="cpu", host_budget="1GiB", cache_dir=open_to_all(tmp_path))
    assert_refused_as_it_was(build_pipeline("wan22_t2v", "tiny"), ft.FlexTensorError, refusal, **enable)


def test_a_profile_dir_others_can_write_is_refused_before_packing(tmp_path) -> None:
    model = Stack(dim=32, depth=3).eval()
    before = snapshot(model)
    with pytest.raises(ft.FlexTensorError, match=r"profile folder .*\(mode 0777\): pass another profile_dir"):
        ft.offload(
            model, include_patterns=["blocks.*"], gpu_budget=2**30, device="cpu", profile_dir=open_to_all(tmp_path)
        )
    assert_same(before, model)


# ------------------------------------------------------------------------------------ files


def test_write_cache_file_replaces_planted_links_and_never_follows_them(tmp_path, victim) -> None:
    """The host tier's cache file of a component, ``NAME-HASH-PID.bin``: links at that name for the next few hundred
    pids and at its temporary names (old and new style) are never followed; this process's file is a new one."""
    folder = private_cache(tmp_path)
    stem = "transformer-0123456789abcdef"
    names = [folder / f"{stem}-{pid}.bin" for pid in next_pids()]
    temporaries = [n.with_name(f"{n.name}.tmp") for n in names] + [
        n.with_name(f"{n.name}.{pid}.tmp") for n in names[:1] for pid in next_pids()
    ]
    assert plant(names + temporaries, victim) == 3 * PIDS_AHEAD
    units, hosts = fake_units([1000, 4096, 17])
    path = folder / f"{stem}-{os.getpid()}.bin"
    write_cache_file(path, units, hosts)  # type: ignore[arg-type]
    assert_untouched(victim)
    assert_private_file(path)
    views = map_cache_file(path, units)  # type: ignore[arg-type]
    assert all(torch.equal(v, h) for v, h in zip(views, hosts, strict=True))
    path.unlink()
    path.symlink_to(victim)  # planted after it was written: mapping it again refuses, in one line
    with pytest.raises(ft.FlexTensorError, match=r"cannot map the weight cache .*cache_dir") as refused:
        map_cache_file(path, units)  # type: ignore[arg-type]
    assert len(str(refused.value).splitlines()) == 1
    assert_untouched(victim)


def test_a_raw_cache_file_replaces_a_planted_link_and_never_follows_it(tmp_path, victim) -> None:
    folder = private_cache(tmp_path)
    where = folder / f"Stack-0123456789abcdef-{os.getpid()}-7f00deadbeef.raw"
    plant([where], victim)
    units, hosts = fake_units([600, 3000])
    raw = RawCacheFile(where, units)  # type: ignore[arg-type]
    rooms = [raw.stand_in(i, unit) for i, unit in enumerate(units)]  # type: ignore[arg-type]
    assert all(torch.equal(r, h) for r, h in zip(rooms, hosts, strict=True))
    assert_private_file(where)
    assert_untouched(victim)
    raw.close()
    assert not os.path.lexists(where)
    assert_untouched(victim)


def test_set_up_writes_its_raw_cache_file_new_whatever_is_planted_at_its_name(tmp_path, monkeypatch, victim) -> None:
    """``raw_copies="disk"`` without a raw home: set-up's cache file (its name carries the handle's address, so a
    link is planted at the very name set-up chooses, just before it makes the file) is a new private file; the
    outputs are bitwise, the planted file untouched, and removal deletes the cache file."""
    folder = private_cache(tmp_path)
    made: list[Path] = []

    def planted_first(where: Path, units: list) -> RawCacheFile:
        plant([where], victim)
        made.append(where)
        return RawCacheFile(where, units)

    monkeypatch.setattr(setup, "RawCacheFile", planted_first)
    torch.manual_seed(0)
    model = Stack(dim=64, depth=3).eval().requires_grad_(False)
    x = torch.randint(0, 50, (2, 8))
    with torch.inference_mode():
        native = model(x)
    handle = ft.offload(
        model, include_patterns=["blocks.*"], gpu_budget=2**30, device="cpu", compression="lossless",
        raw_copies="disk", cache_dir=folder,
    )  # fmt: skip
    with torch.inference_mode():
        assert all(torch.equal(model(x), native) for _ in range(3))
    (where,) = made
    assert_private_file(where)
    handle.remove()
    assert not os.path.lexists(where)
    assert_untouched(victim)


def fake_encoded(sizes: list[int]) -> dict[int, EncodedUnit]:
    """Payloads as a payload file stores them (their launch parameters are not read here)."""
    torch.manual_seed(1)
    return {
        index: EncodedUnit(
            payload=torch.randint(0, 256, (n,), dtype=torch.uint8),
            raw_nbytes=2 * n,
            stored_nbytes=n,
            segments=(),
            chunk=4096,
            n16=0,
            n32=0,
            n_pieces=0,
            coded_raw_nbytes=0,
        )
        for index, n in enumerate(sizes)
    }


def test_a_payload_file_is_written_new_whatever_is_planted_at_its_names(tmp_path, victim) -> None:
    folder = private_cache(tmp_path)
    cache = PayloadCache(folder, "WanTransformer3DModel", "ab" * 32)
    temporaries = [cache.path.with_name(f"{cache.path.name}.{pid}.tmp") for pid in next_pids()]
    plant([cache.path, *temporaries], victim)
    encoded = fake_encoded([5000, 123])
    assert cache.write(encoded, strict=True)
    assert_private_file(cache.path)
    assert_untouched(victim)
    views = cache.map()
    assert all(torch.equal(views[i], e.payload) for i, e in encoded.items())
    assert [p for p in folder.iterdir() if not p.is_symlink()] == [cache.path]  # no temporary file left


def rewrite_payload_and_its_record(path: Path, index: int) -> None:
    """Change unit ``index``'s payload in the file at ``path`` and its record's CRC-32 to match: the file is
    consistent in itself, as one rewritten by someone who knows its format would be."""
    data = bytearray(path.read_bytes())
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    data_start = align(8 + length, FILE_ALIGNMENT)
    record = next(r for r in header["units"] if r["index"] == index)
    start = data_start + record["offset"]
    data[start] ^= 0xFF
    record["crc32"] = zlib.crc32(bytes(data[start : start + record["payload_nbytes"]]))
    blob = json.dumps(header).encode()
    assert align(8 + len(blob), FILE_ALIGNMENT) == data_start
    data[: 8 + len(blob)] = len(blob).to_bytes(8, "little") + blob
    path.write_bytes(bytes(data))


def test_a_payload_changed_on_disk_with_its_record_is_refused_at_the_read_back(tmp_path) -> None:
    """The file's own record changed with the payload: a reader that trusted the file would take it (a new
    `PayloadCache` reading the file does); the read back checks the CRC-32 held in memory since the write, and
    refuses it in one line. An untouched payload of the same file still reads back. Reading the header again
    does not make the file's record the one trusted."""
    folder = private_cache(tmp_path)
    cache = PayloadCache(folder, "WanTransformer3DModel", "cd" * 32)
    encoded = fake_encoded([3000, 9000])
    assert cache.write(encoded, strict=True)
    into = torch.empty(9000, dtype=torch.uint8)
    cache.read_payload(1, into)
    assert torch.equal(into, encoded[1].payload)
    rewrite_payload_and_its_record(cache.path, 1)
    fresh = PayloadCache(folder, "WanTransformer3DModel", "cd" * 32)
    assert fresh.open() and not torch.equal(fresh.read_checked(1), encoded[1].payload)  # consistent in itself
    with pytest.raises(ft.FlexTensorError, match=r"unit 1 .* changed on disk since they were written") as refused:
        cache.read_payload(1, into)
    assert len(str(refused.value).splitlines()) == 1
    cache.read_payload(0, into[:3000])
    assert torch.equal(into[:3000], encoded[0].payload)
    assert cache.open()  # the header read again (a set-up after an edit does): nothing of it is vouched for yet
    with pytest.raises(ft.FlexTensorError, match=r"unit 1 .* changed on disk since they were written"):
        cache.read_payload(1, into)


def test_the_host_tiers_cache_files_never_follow_links_planted_for_the_next_pids(tmp_path, monkeypatch, victim) -> None:
    """A pipeline whose components take turns in RAM, the others in cache files named ``NAME-HASH-PID.bin``:
    links planted at those names (and their old temporary names) for the next few hundred pids change nothing.
    Two generations bitwise, this process's files new and 0600, the planted file untouched."""
    set_host_overhead(monkeypatch, own=0, reserve=0)
    pipe = build_pipeline("wan22_t2v", "tiny")
    reference = wan_latents(pipe)
    probe = tmp_path / "probe"
    enable_with_one_component_in_ram(pipe, BUDGET, probe)  # names the files this model's components get
    names = [p.name for p in probe.glob("*.bin")]
    pipe.disable_flextensor_offload()
    assert names
    cache = private_cache(tmp_path)
    stems = {name.rsplit("-", 1)[0] for name in names}
    planted = [cache / f"{stem}-{pid}.bin{tail}" for stem in stems for pid in next_pids() for tail in ("", ".tmp")]
    plant(planted, victim)
    enable_with_one_component_in_ram(pipe, BUDGET, cache)
    assert all(torch.equal(wan_latents(pipe), reference) for _ in range(2))
    for name in names:
        assert_private_file(cache / name)
    pipe.disable_flextensor_offload()
    assert_untouched(victim)


def test_shared_weights_live_in_a_private_folder_and_a_reachable_one_is_refused(tmp_path) -> None:
    """The creator makes the shared folder 0700 and its files 0600; a folder of that name that other users can
    write, or another user's, is refused before packing."""
    torch.manual_seed(0)
    model = Stack(dim=32, depth=3).eval()
    config = dict(include_patterns=["blocks.*"], gpu_budget=2**30, device="cpu")
    handle = ft.offload(model, shared_host=ft.SharedHostMemory("mine", create=True, root=tmp_path), **config)
    folder = tmp_path / "flextensor-mine"
    assert stat.S_IMODE(os.lstat(folder).st_mode) == 0o700
    files = list(folder.iterdir())
    assert any(f.name == "manifest.json" for f in files) and len(files) > 1
    for path in files:
        assert_private_file(path)
    handle.remove()
    reachable = tmp_path / "flextensor-open"
    reachable.mkdir()
    reachable.chmod(0o777)
    before = snapshot(model)
    shared = ft.SharedHostMemory("open", create=True, root=tmp_path)
    with pytest.raises(ft.FlexTensorError, match=r"shared weights folder .*\(mode 0777\): pick another shared_host"):
        ft.offload(model, shared_host=shared, **config)
    assert_same(before, model)
    assert not any(reachable.iterdir())
