"""Files of this user's, in folders of this user's: where every file the package writes is made.

Cache files, payload files, raw cache files and shared weights hold a model's weights, and a process maps them
and reads them back into the weights it computes with. On a machine with several users none of that may be
within another user's reach: they must not read the bytes, nor make this process write through a link they
planted (a file of the user's outside the folder overwritten, or a mapping that faults), nor swap a file this
process reads back. So:

* A folder written into is this user's own (``st_uid`` is the effective uid), not a symbolic link (checked with
  ``lstat``), and not writable by its group or by others (any ``g+w``/``o+w`` is refused, sticky or not). A
  folder made here is made 0700 (``mkdir`` does not follow a link planted at its name: it fails instead). A
  refusal is one line naming the option that chose the folder (`FolderUse`), before anything is packed.
* A file made here is new: ``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600, at a name of its own (the process id
  and random digits, `temporary_name`); a final name is reached by ``os.replace``, which replaces whatever
  entry is there (a link included) and never follows it (`fresh_file`).
* A file opened again (read, mapped) is opened with ``O_NOFOLLOW`` and checked to be a regular file of this
  user's (`open_own_file`); a mapping is made through that descriptor (`map_descriptor`), never by the name
  again, so what is mapped is what was checked.

The folders above the one checked are not: the default folder is under the user's home
(``platformdirs.user_cache_dir``, which honours ``$XDG_CACHE_HOME``), and a folder the user names in a shared
place such as ``/tmp`` cannot be renamed by others there (the sticky bit).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

import platformdirs
import torch

from ..engine.errors import FlexTensorError

#: Files made here: read and written by this user only.
FILE_MODE = 0o600
#: Folders made here: entered by this user only.
FOLDER_MODE = 0o700
#: A new file, never an existing name nor through a link, not inherited by child processes.
CREATE_NEW = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
#: The name of the per-user cache folder (`default_cache_folder`).
APP_NAME = "flextensor-diffusers"


@dataclass(frozen=True)
class FolderUse:
    """What a folder is for, as its refusals say: ``what`` it is and the ``fix`` naming the option that chose it."""

    what: str
    fix: str


CACHE_FOLDER = FolderUse("the weight cache folder", "pass another cache_dir")
SHARED_FOLDER = FolderUse("the shared weights folder", "pick another shared_host namespace or shared_host_root")
PROFILE_FOLDER = FolderUse("the profile folder", "pass another profile_dir")


def default_cache_folder() -> Path:
    """This user's cache folder for the package (``~/.cache/flextensor-diffusers`` on Linux, or under
    ``$XDG_CACHE_HOME``): never a folder shared with other users, such as the temp folder."""
    return Path(platformdirs.user_cache_dir(APP_NAME, appauthor=False))


def private_folder(folder: str | os.PathLike[str], use: FolderUse = CACHE_FOLDER) -> Path:
    """``folder``, made (0700, its missing parents as ``mkdir -p`` makes them) when missing, and checked
    (`check_private_folder`); refused with one line naming ``use``'s option."""
    folder = Path(folder)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):  # made before, or something planted there: the check says which
            os.mkdir(folder, FOLDER_MODE)
    except OSError as exc:
        raise FlexTensorError(f"cannot create {use.what} {folder} ({exc}): {use.fix}") from exc
    check_private_folder(folder, use)
    return folder


def check_private_folder(folder: Path, use: FolderUse = CACHE_FOLDER) -> None:
    """Refuse ``folder`` (one line naming ``use``'s option) unless it is a real folder of this user's that only
    this user may write into, and that this process can write (see the module docstring)."""
    try:
        found = os.lstat(folder)
    except OSError as exc:
        raise FlexTensorError(f"cannot use {use.what} {folder} ({exc}): {use.fix}") from exc
    if stat.S_ISLNK(found.st_mode):
        raise FlexTensorError(
            f"{use.what} {folder} is a symbolic link, which its owner can point elsewhere: {use.fix} (the real folder)"
        )
    if not stat.S_ISDIR(found.st_mode):
        raise FlexTensorError(f"{use.what} {folder} is not a folder: {use.fix}")
    if found.st_uid != os.geteuid():
        raise FlexTensorError(
            f"{use.what} {folder} belongs to another user (uid {found.st_uid}, this process runs as {os.geteuid()}): "
            f"{use.fix}, one of your own"
        )
    mode = stat.S_IMODE(found.st_mode)
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise FlexTensorError(
            f"{use.what} {folder} can be written by other users (mode {mode:04o}): {use.fix}, or chmod go-w it"
        )
    if not os.access(folder, os.W_OK):
        raise FlexTensorError(f"{use.what} {folder} is not writable: {use.fix}")


def temporary_name(path: Path) -> Path:
    """A name beside ``path`` for the temporary file it is written to: ``path``'s name, this process's id (so that
    a later process can tell a stale one, `payload_cache.remove_stale_temporaries`), random digits and ``.tmp``.
    Created with `create_new`, a name in use (a collision, or a planted entry) is refused, never reused."""
    return path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def create_new(path: str | os.PathLike[str], flags: int) -> int:
    """A descriptor of a new file at ``path``, mode 0600: never an existing file, never through a link. Also the
    ``opener`` of ``open(path, "wb", opener=create_new)``."""
    return os.open(path, flags | CREATE_NEW, FILE_MODE)


def fresh_file(path: Path, flags: int = os.O_RDWR) -> int:
    """A descriptor of a new, empty file of this user's (0600) at ``path``, whatever was there before: made at a
    `temporary_name` and renamed over ``path`` (a link there is replaced, not followed)."""
    tmp = temporary_name(path)
    fd = create_new(tmp, flags)
    try:
        os.replace(tmp, path)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    return fd


def open_own_file(path: str | os.PathLike[str], flags: int = os.O_RDONLY) -> int:
    """A descriptor of the existing file at ``path``, opened without following a link, and checked to be a
    regular file of this user's; else ``OSError`` (``ELOOP`` for a link, ``EPERM`` otherwise), which callers
    turn into their own refusal."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)
    found = os.fstat(fd)
    if not stat.S_ISREG(found.st_mode) or found.st_uid != os.geteuid():
        os.close(fd)
        raise OSError(errno.EPERM, "not a regular file of this user's", str(path))
    return fd


def descriptor_path(fd: int) -> str:
    """A name that opens the very file ``fd`` refers to (``/proc/self/fd/N``; ``/dev/fd/N`` where there is no
    ``/proc``): what `torch.from_file` is given, so that it maps the file checked, not whatever the name holds."""
    return f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else f"/dev/fd/{fd}"


def map_descriptor(fd: int, size: int, shared: bool) -> torch.Tensor:
    """The first ``size`` bytes of the file ``fd`` refers to, mapped as a uint8 tensor (``shared``: writes reach
    the file; else a private mapping). The mapping outlives ``fd``."""
    return torch.from_file(descriptor_path(fd), shared=shared, size=size, dtype=torch.uint8)


def map_own_file(path: Path, size: int, shared: bool) -> torch.Tensor:
    """`map_descriptor` of the file at ``path``, opened by `open_own_file` (for writing when ``shared``)."""
    fd = open_own_file(path, os.O_RDWR if shared else os.O_RDONLY)
    try:
        return map_descriptor(fd, size, shared)
    finally:
        os.close(fd)
