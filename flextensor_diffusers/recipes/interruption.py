"""What a command was doing and which of its files it had written: the one line a Ctrl-C prints.

A command (a recipe, or compare) keeps a `RunProgress`: the files it means to write, the stage it is in,
and the files written so far. A ``KeyboardInterrupt`` anywhere in the run becomes an `Interrupted`, still a
``KeyboardInterrupt`` for Python callers, whose message is that line; the command line prints it alone and
exits with 130 (128 + SIGINT, what a shell reports for a process stopped by Ctrl-C). Files are written whole
or not at all (`media.files`), so "not written" means the path holds what it held before, or nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

#: Exit status of a command stopped by Ctrl-C.
INTERRUPT_EXIT = 130


class Interrupted(KeyboardInterrupt):
    """A Ctrl-C, with the line that says what was interrupted and what was and was not written."""


@dataclass
class RunProgress:
    """The stage a command is in and its outputs, written or not.

    ``outputs``: every file (or folder) the command means to write, in the order it writes them.
    """

    command: str
    outputs: list[Path]
    stage: str = "starting"
    written: list[Path] = field(default_factory=list)

    @contextlib.contextmanager
    def during(self, stage: str) -> Iterator[None]:
        """Name the stage the block runs (``the generation``, ``writing wan-t2v.mp4``)."""
        self.stage = stage
        yield

    def wrote(self, path: Path) -> None:
        self.written.append(path)

    def interrupted_line(self) -> str:
        """``wan22_t2v: interrupted (Ctrl-C) during the generation; not written: wan-t2v.mp4 (...)``."""
        line = f"{self.command}: interrupted (Ctrl-C) during {self.stage}"
        if self.written:
            line += f"; written: {', '.join(map(str, self.written))}"
        missing = [path for path in self.outputs if path not in self.written]
        if missing:
            line += f"; not written: {', '.join(map(str, missing))} (what was there before is unchanged)"
        return line

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """Turn a ``KeyboardInterrupt`` in the block into an `Interrupted` that says where it landed."""
        try:
            yield
        except Interrupted:
            raise
        except KeyboardInterrupt as exc:
            raise Interrupted(self.interrupted_line()) from exc
