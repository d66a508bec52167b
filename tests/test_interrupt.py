"""Ctrl-C as a user presses it: a real SIGINT sent to a command in another process, at a moment it announces.

Each command (the recipe's launcher in ``recipes/``, compare's module) runs under a small driver that wraps
one step (the mp4's first packets written, the transformer's first call in the real generation) to print a
marker and wait for the signal, so the signal lands there and nowhere else, without sleeping. Every wait is
bounded.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = "waiting for Ctrl-C"
#: Seconds to reach the marker (start Python, import torch and diffusers, build the tiny pipeline, profile).
START_S = 300
#: Seconds from the signal to the process's end.
END_S = 120

DRIVER = f"""
import runpy, signal, sys
import flextensor_diffusers as ft
from flextensor_diffusers.recipes import wan22_t2v

def wait_for_ctrl_c(*args):
    print({MARKER!r}, flush=True)
    signal.pause()  # the SIGINT's KeyboardInterrupt is raised here

where, command, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
if where == "writing the mp4":  # once the file has begun: its first packets muxed
    import av
    from tests.fakes import open_that_stops

    av.open = open_that_stops(av.open, wait_for_ctrl_c)
else:  # "generating": in the offloaded run's real generation (the profiling one makes latents only)
    generate = wan22_t2v.generate

    def generate_then_wait(pipe, options, device, steps, output_type, **extra):
        if output_type == "np" and ft.pipeline_offload(pipe) is not None:
            pipe.transformer.register_forward_pre_hook(wait_for_ctrl_c)
        return generate(pipe, options, device, steps, output_type, **extra)

    wan22_t2v.generate = generate_then_wait
# As a user launches them: the recipe's launcher (a clone not installed), compare's module as __main__.
if command == "compare":
    sys.argv = ["flextensor-compare", *argv]
    runpy.run_module("flextensor_diffusers.reports.compare", run_name="__main__")
else:
    sys.argv = [{str(ROOT / "recipes" / "wan22_t2v.py")!r}, *argv]
    runpy.run_path(sys.argv[0], run_name="__main__")
"""

TINY = ["--random-weights", "tiny", "--device", "cpu", "-q"]


#: What installed libraries print when diffusers imports them (torchao 0.18 under torch 2.14: a deprecation logged
#: by torch's pytree registry, and diffusers' note that it cannot import torchao's tensor types): not the package's
#: words, so not counted in the one line a Ctrl-C prints.
IMPORT_NOISE = re.compile(
    r"W\d{4} [\d:.]+ +\d+ \S*torch/utils/_pytree\.py:\d+\] |Unable to import `torchao` Tensor objects"
)


@dataclass
class Finished:
    returncode: int
    stderr: list[str]
    stdout: list[str] = field(default_factory=list)


def run_and_interrupt(folder: Path, where: str, command: str, argv: list[str]) -> Finished:
    """Start the driver, wait (bounded) for its marker, send SIGINT, wait (bounded) for it to end."""
    driver = folder / "driver.py"
    driver.write_text(DRIVER)
    paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]  # the package and tests.fakes
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    process = subprocess.Popen(
        [sys.executable, str(driver), where, command, *argv],
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out: list[str] = []
    err: list[str] = []
    reached = threading.Event()

    def read_stdout() -> None:
        for line in process.stdout:
            out.append(line.rstrip("\n"))
            if line.startswith(MARKER):
                reached.set()

    def read_stderr() -> None:
        err.extend(line.rstrip("\n") for line in process.stderr if not IMPORT_NOISE.match(line))

    readers = [threading.Thread(target=read_stdout), threading.Thread(target=read_stderr)]
    for reader in readers:
        reader.start()
    try:
        assert reached.wait(START_S), f"never reached {where!r}: {out[-5:]} {err[-5:]}"
        process.send_signal(signal.SIGINT)
        process.wait(END_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(END_S)
        for reader in readers:
            reader.join(END_S)
    return Finished(process.returncode, err, out)


def leftovers(folder: Path) -> list[str]:
    """Files a write left behind under a temporary name."""
    return sorted(path.name for path in folder.rglob("*") if ".partial" in path.name)


def test_ctrl_c_while_the_mp4_is_written_keeps_the_old_file_and_says_so(tmp_path) -> None:
    output = tmp_path / "videos" / "fox.mp4"
    output.parent.mkdir()
    output.write_bytes(b"the earlier video")
    argv = [*TINY, "--output", str(output), "--json", str(tmp_path / "run.json"), "--profile-dir", str(tmp_path)]
    finished = run_and_interrupt(tmp_path, "writing the mp4", "recipe", argv)
    assert finished.returncode == 130, finished
    assert finished.stderr == [
        f"wan22_t2v: interrupted (Ctrl-C) during writing {output}; not written: {output}, {tmp_path / 'run.json'} "
        "(what was there before is unchanged)"
    ]
    assert output.read_bytes() == b"the earlier video" and not (tmp_path / "run.json").exists()
    assert leftovers(tmp_path) == []


def test_ctrl_c_while_generating_is_one_line_and_writes_nothing(tmp_path) -> None:
    output = tmp_path / "fox.mp4"
    argv = [*TINY, "--output", str(output), "--profile-dir", str(tmp_path / "profiles")]
    finished = run_and_interrupt(tmp_path, "generating", "recipe", argv)
    assert finished.returncode == 130, finished
    assert finished.stderr == [
        f"wan22_t2v: interrupted (Ctrl-C) during the generation; not written: {output} "
        "(what was there before is unchanged)"
    ]
    assert not output.exists() and leftovers(tmp_path) == []


def test_ctrl_c_in_compare_is_one_line_and_leaves_no_partial_report(tmp_path) -> None:
    out = tmp_path / "report"
    argv = ["--recipe", "wan22_t2v", "--out", str(out), "-q", "--", *TINY, "--profile-dir", str(tmp_path / "p")]
    finished = run_and_interrupt(tmp_path, "generating", "compare", argv)
    assert finished.returncode == 130, finished
    files = ", ".join(str(out / name) for name in ("native.mp4", "offloaded.mp4", "report.json", "report.html"))
    assert finished.stderr == [
        f"compare: interrupted (Ctrl-C) during the offloaded generation; not written: {files} "
        "(what was there before is unchanged)"
    ]
    assert not out.exists() or list(out.iterdir()) == []
