"""Files written whole or not at all.

Every file the commands write (mp4s, the summary JSON, the report's JSON, HTML and PNGs, the profile index) goes
to a temporary name in the target's folder and is renamed over the target once it is complete and on disk. A
reader never sees a half-written file, and a write that fails or is interrupted (Ctrl-C) leaves the file that
was there before, or none. The temporary file is in the same folder because a rename is atomic only within one
file system.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

#: Part of every temporary name (``.NAME.RANDOM.partial.SUFFIX``): a process killed outright (SIGKILL, power
#: loss) can leave one behind, never a file at the target's name.
PARTIAL = ".partial"


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A new, empty temporary file beside ``path``, renamed to ``path`` when the block ends; deleted when the
    block raises (``KeyboardInterrupt`` included). Missing folders on the way to ``path`` are created.

    The temporary name keeps ``path``'s suffix, so writers that choose a format by extension (PyAV) still do;
    it is created new (never an existing name, never through a link) with the usual permissions (0666 less the
    umask: these are the user's outputs, not the package's cache), which the rename keeps.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.stem}.{secrets.token_hex(4)}{PARTIAL}{path.suffix}")
    os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666))
    try:
        yield temporary
        with open(temporary, "rb") as written:  # on disk before the name points at it
            os.fsync(written.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def missing_folder(path: str | Path) -> Path | None:
    """The folder of ``path`` when it does not exist yet (writing ``path`` makes it, and any missing above it),
    so that a command can say it made it; None when it exists."""
    folder = Path(path).parent
    return None if folder.exists() else folder


def write_bytes(path: str | Path, data: bytes) -> Path:
    """``data`` at ``path``, atomically (see `atomic_path`)."""
    with atomic_path(path) as temporary:
        temporary.write_bytes(data)
    return Path(path)


def write_text(path: str | Path, text: str) -> Path:
    """``text`` as UTF-8 at ``path``, atomically (see `atomic_path`)."""
    return write_bytes(path, text.encode("utf-8"))
