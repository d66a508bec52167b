"""benchmarks/time_to_video.py end to end on the CPU (tiny Wan2.2, 2 steps): every row has the schema's fields, its
phases fit in its total, and every configuration's frames are bitwise native's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Issue 48's schema: the fields of every row.
FIELDS = (
    "config",
    "first_run",
    "distinct_experts",
    "text_encoder",
    "frames",
    "height",
    "width",
    "steps",
    "load_s",
    "enable_s",
    "profiling_s",
    "first_step_at_s",
    "steps_s",
    "decode_s",
    "mp4_s",
    "total_s",
    "peak_host_anon_bytes",
    "peak_host_file_bytes",
    "peak_allocated_bytes",
    "budget_bytes",
    "bitwise_equal",
    "command",
    "code_commit",
)
PHASES = ("load_s", "enable_s", "profiling_s", "text_encoding_s", "steps_s", "decode_s", "mp4_s")


def run_small(tmp_path: Path, out: Path, *args: str) -> dict:
    """time_to_video.py --small at 2 steps of 5 x 16 x 16 frames, its work folder in ``tmp_path``: its result."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "time_to_video.py"), "--small", "--steps", "2"]
    cmd += ["--frames", "5", "--height", "16", "--width", "16", "--workdir", str(tmp_path / "work"), "--out", str(out)]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run([*cmd, *args], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_time_to_video_small_writes_a_row_per_run_with_the_schema(tmp_path: Path) -> None:
    """Then a second process, as the GPU calls run it (one configuration a call at 40 steps): later runs only, from
    the first process's profile and payload file, compared with its native frames' digest (``--reference``)."""
    out = tmp_path / "ttv.json"
    result = run_small(tmp_path, out, "--configs", "native,ram,host32_compressed:first", "--keep-workdir")
    assert result["skipped"] == [], result["skipped"]
    rows = result["runs"]
    assert [(r["config"], r["first_run"]) for r in rows] == [
        ("native", True),
        ("ram", True),
        ("ram", False),
        ("host32_compressed", True),
    ]
    for row in rows:
        missing = [f for f in FIELDS if f not in row]
        assert not missing, (row["config"], missing)
        assert row["total_s"] >= sum(row[p] for p in PHASES) - 1e-3, row
        assert row["bitwise_equal"] is True, row
        assert row["distinct_experts"] and row["text_encoder"]
        assert (row["frames"], row["height"], row["width"], row["steps"]) == (5, 16, 16, 2)
        assert len(row["step_s"]) == 2 and "fewer than the recipe's 40" in row["steps_note"]
        assert row["peak_host_anon_bytes"] > 0 and row["peak_host_file_bytes"] > 0
        assert 0 < row["peak_host_anon_after_enable_bytes"] <= row["peak_host_anon_bytes"]
        assert "not read from disk" in row["load"]
    assert [r["profiled_in"] for r in rows] == [None, "generation", "saved profile", "generation"]
    assert ".raw" not in rows[-1]["cache_dir_bytes"] and rows[-1]["cache_dir_bytes"][".payloads"] > 0  # built in memory
    assert all(r["budget_bytes"] == 400_000 for r in rows[1:]) and rows[0]["budget_bytes"] is None
    second = run_small(
        tmp_path, tmp_path / "later.json", "--configs", "native,host32_compressed:later", "--reference", str(out)
    )
    assert second["skipped"] == [], second["skipped"]
    later = second["runs"]
    assert [(r["config"], r["first_run"], r["profiled_in"]) for r in later] == [
        ("native", True, None),
        ("host32_compressed", False, "saved profile"),
    ]
    assert all(
        r["bitwise_equal"] is True and r["bitwise_against"].startswith("native:first of ttv.json") for r in later
    )
    assert {r["frames_sha256"] for r in [*rows, *later]} == {rows[0]["frames_sha256"]}
