"""A recipe run inside a cgroup memory limit, on the CPU: does ``--host-budget auto`` see the limit?

Saves a Wan2.2 pipeline with the tiny configuration's text encoder and VAE and widened experts (about 2.8 GiB
each in bfloat16, the dtype the recipe loads, so that the weights stay mapped from their files; built once into
``--folder``), makes a child memory cgroup (v2 where its memory controller can
be used, else v1) per run, with ``--limit``, and runs ``flextensor-wan22-t2v --model FOLDER`` inside it for each
``--code LABEL=PATH`` (PYTHONPATH: the code under test, and for comparison a checkout that reads only the host's
RAM). Each run's command, exit status, output, the cgroup's peak usage and its OOM kills go to ``--out``.

Needs root and a writable cgroup hierarchy (a container usually has neither). Run from the repository root:

    python benchmarks/cgroup_limit_run.py --limit 5.5GiB --code base=/tmp/ft-base --code this=$PWD \\
        --out benchmarks/results/cgroup_limit_cpu.log
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WIDE_EXPERT = {"num_attention_heads": 8, "attention_head_dim": 128, "ffn_dim": 4096, "num_layers": 88}
GENERATION = ["--frames", "9", "--height", "32", "--width", "32", "--steps", "2", "-q"]


def save_wide(folder: Path) -> None:
    """The tiny pipeline with ``WIDE_EXPERT`` experts, saved with ``save_pretrained`` (weights mapped from their
    files once loaded: every host copy is new memory)."""
    from flextensor_diffusers.recipes import models

    real = models.load_config

    def config(model: str, size: str) -> dict:
        cfg = real(model, size)
        for name in ("transformer", "transformer_2"):
            cfg[name].update(WIDE_EXPERT)
        return {**cfg, "dtype": "bfloat16", "vae_dtype": "bfloat16"}  # as the recipe loads it: nothing converted

    models.load_config = config
    try:
        models.build_pipeline("wan22_t2v", "tiny").save_pretrained(folder, max_shard_size="1GB")
    finally:
        models.load_config = real


class Cgroup:
    """A child memory cgroup with a limit (None: none), v2 where usable, else v1; removed by `close`."""

    def __init__(self, name: str, limit: int | None) -> None:
        v2 = Path("/sys/fs/cgroup")
        self.v2 = "memory" in (v2 / "cgroup.controllers").read_text() if (v2 / "cgroup.controllers").exists() else False
        self.path = (v2 if self.v2 else v2 / "memory") / name
        self.path.mkdir()
        if limit is not None:
            (self.path / ("memory.max" if self.v2 else "memory.limit_in_bytes")).write_text(str(limit))

    def join(self) -> None:
        """In the child before exec: this process (and its children) in the cgroup."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak_bytes(self) -> int:
        return int((self.path / ("memory.peak" if self.v2 else "memory.max_usage_in_bytes")).read_text())

    def oom_kills(self) -> int:
        events = (self.path / ("memory.events" if self.v2 else "memory.oom_control")).read_text().split("\n")
        return sum(int(line.split()[1]) for line in events if line.startswith("oom_kill "))

    def close(self) -> None:
        self.path.rmdir()


def run(label: str, code: str, limit: int | None, argv: list[str], log: list[str]) -> None:
    """One recipe run in a new cgroup under ``limit``, with a new profile folder (a profiling generation each time)."""
    cgroup = Cgroup(f"ft-cgroup-run-{os.getpid()}-{len(log)}", limit)
    env = {**os.environ, "PYTHONPATH": code}
    profiles = tempfile.mkdtemp(prefix="ft-cgroup-profiles-")
    command = [sys.executable, "-m", "flextensor_diffusers.recipes.wan22_t2v", *argv, "--profile-dir", profiles]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, preexec_fn=cgroup.join, capture_output=True, text=True, cwd=code)
        seconds = time.perf_counter() - start
        said = [
            f"## {label}: limit {limit if limit is None else f'{limit / 2**30:.2f} GiB'} "
            f"(cgroup {'v2' if cgroup.v2 else 'v1'} {cgroup.path})",
            f"$ PYTHONPATH={code} {' '.join(command[1:])}",
            f"exit status {done.returncode}{' (killed: SIGKILL)' if done.returncode == -9 else ''}, "
            f"{seconds:.1f} s, cgroup peak usage {cgroup.peak_bytes() / 2**30:.2f} GiB (page cache included), "
            f"OOM kills {cgroup.oom_kills()}",
            "--- stdout",
            done.stdout.rstrip(),
            "--- stderr (warnings of torch and diffusers' imports left out)",
            "\n".join(line for line in done.stderr.splitlines() if "_pytree.py" not in line and "torchao" not in line),
            "",
        ]
    finally:
        cgroup.close()
        shutil.rmtree(profiles, ignore_errors=True)
    print("\n".join(said[:3]), flush=True)
    log.extend(said)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", type=Path, default=Path("/tmp/ft-cgroup-wide/wan22"))
    parser.add_argument("--limit", required=True, help="the cgroup's memory limit, e.g. 5.5GiB")
    parser.add_argument("--code", action="append", required=True, help="LABEL=PYTHONPATH, run in this order")
    parser.add_argument("--budget", default="512MiB", help="the recipe's --budget (on the CPU it is RAM too)")
    parser.add_argument("--unlimited-too", action="store_true", help="also run the last --code with no limit")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from flextensor_diffusers.engine.config import parse_bytes

    if not args.folder.exists():
        save_wide(args.folder)
    limit = parse_bytes(args.limit)
    log = [f"# {' '.join(sys.argv)}", f"folder {args.folder}: {WIDE_EXPERT} experts", ""]
    for n, spec in enumerate(args.code):
        label, code = spec.split("=", 1)
        out = Path("/tmp") / f"ft-cgroup-{label}.mp4"
        argv = ["--model", str(args.folder), "--budget", args.budget, *GENERATION, "--output", str(out)]
        run(f"{label}, --host-budget auto (the default)", code, limit, [*argv, "--json", f"{out}.json"], log)
        if n == len(args.code) - 1:
            run(f"{label}, --host-budget none", code, limit, [*argv, "--host-budget", "none"], log)
            if args.unlimited_too:
                unlimited = ["--output", f"/tmp/ft-cgroup-{label}-unlimited.mp4"]
                argv = [*argv[:-2], *unlimited, "--host-budget", "none"]
                run(f"{label}, --host-budget none, no limit", code, None, argv, log)
                log.append(same_video(Path(f"/tmp/ft-cgroup-{label}.mp4"), Path(unlimited[1])))
    args.out.write_text("\n".join(log) + "\n")


def same_video(limited: Path, unlimited: Path) -> str:
    """Whether the run under the limit wrote the same mp4, byte for byte, as the one with everything in RAM."""
    import hashlib

    if not (limited.exists() and unlimited.exists()):
        return f"## videos: {limited} or {unlimited} missing"
    digests = [hashlib.sha256(path.read_bytes()).hexdigest()[:16] for path in (limited, unlimited)]
    same = "the same bytes" if digests[0] == digests[1] else "DIFFERENT"
    return f"## videos: {limited.name} {digests[0]}, {unlimited.name} {digests[1]}: {same}"


if __name__ == "__main__":
    main()
