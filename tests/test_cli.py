"""The command lines as a new user meets them: every documented example runs, every user error is one line."""

from __future__ import annotations

import importlib
import logging
import re
import shlex
import tomllib
from pathlib import Path

import numpy as np
import pytest

from flextensor_diffusers import __main__ as entry
from flextensor_diffusers.engine.config import format_bytes, parse_bytes
from flextensor_diffusers.engine.errors import BudgetError, HostBudgetError
from flextensor_diffusers.media.video import write_mp4
from flextensor_diffusers.pipelines.offload import format_report
from flextensor_diffusers.recipes import common, cosmos_transfer25, ltx2_outpaint, wan22_t2v
from flextensor_diffusers.recipes.options import OptionsError, budget_note, budget_suggestion
from flextensor_diffusers.reports import compare

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {"wan22_t2v": wan22_t2v, "ltx2_outpaint": ltx2_outpaint, "cosmos_transfer25": cosmos_transfer25}
#: The console scripts pyproject.toml installs: the one way the documentation launches each command.
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
README = (ROOT / "README.md").read_text()
#: Where example commands are written for users: they are collected from here, so they cannot drift.
DOCUMENTED = {
    "README.md": README,
    "compare": compare.__doc__,
    "__main__": entry.USAGE,
    **{name: module.__doc__ for name, module in RECIPES.items()},
}
RUNNABLE = {script: target.split(":")[0].rsplit(".", 1)[1] for script, target in SCRIPTS.items()}
COMMAND = re.compile(rf"({'|'.join(s for s in SCRIPTS if s != 'flextensor-diffusers')})\b(.*)")
#: Other ways to launch a command, which the documentation does not use (one way, everywhere).
OTHER_LAUNCHES = re.compile(r"python3? (?:recipes/\w+\.py|-m flextensor_diffusers\.)")


def example_commands() -> list[tuple[str, str, list[str]]]:
    """(where, recipe or "compare", argv) of every documented command that runs tiny random weights."""
    found = []
    for where, text in DOCUMENTED.items():
        for line in text.replace("\\\n", " ").splitlines():
            match = COMMAND.search(line)
            if match and "--random-weights tiny" in line:
                argv = shlex.split(match.group(2).split("&&")[0].split("#")[0].split("`")[0])
                found.append((where, RUNNABLE[match.group(1)], argv))
    return found


def test_examples_are_found_in_every_place_users_read() -> None:
    places = {where for where, _, _ in example_commands()}
    assert places == set(DOCUMENTED), set(DOCUMENTED) - places
    assert {name for _, name, _ in example_commands()} == {*RECIPES, "compare"}


def test_commands_are_launched_one_way_everywhere() -> None:
    """Every place names the console scripts, each of which pyproject.toml points at a function that exists."""
    for where, text in {**DOCUMENTED, "docs/guide.md": (ROOT / "docs" / "guide.md").read_text()}.items():
        assert not OTHER_LAUNCHES.search(text), (where, OTHER_LAUNCHES.search(text).group(0))
    for script, target in SCRIPTS.items():
        module, function = target.split(":")
        assert callable(getattr(importlib.import_module(module), function)), script
    assert {f"flextensor-{name.replace('_', '-')}" for name in RECIPES} < set(SCRIPTS)
    assert all(script in entry.USAGE for script in SCRIPTS if script != "flextensor-diffusers")


def test_every_documented_tiny_example_runs_in_seconds(tmp_path, monkeypatch, capsys) -> None:
    """Each distinct example (same options, same run) as its command line runs it, in a scratch folder."""
    monkeypatch.chdir(tmp_path)
    done: set[str] = set()
    for where, name, argv in example_commands():
        argv = [*argv, "-q"]  # no progress bars (after "--" for compare: the recipe takes it)
        if name == "compare":
            cut = argv.index("--")
            key = repr((name, argv[:cut], RECIPES[argv[argv.index("--recipe") + 1]].parse_args(argv[cut + 1 :])))
        else:
            key = repr((name, RECIPES[name].parse_args(argv)))
        if key in done:
            continue
        done.add(key)
        if name == "compare":
            report = compare.main(argv)
            assert report["fidelity"]["latents"]["bitwise_equal"], (where, argv)
        else:
            info = RECIPES[name].main(argv)
            assert Path(info["output"]).exists(), (where, argv)
            assert info["frames_written"] == info["frames"] and info["compile"] == "none"
    assert len(done) >= 5  # wan, ltx2 twice (two canvases), cosmos, compare
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "it/s" not in captured.err  # -q: no bars
    assert "offload: budget " in captured.out and " profile in profiles: " in captured.out  # one line, without -v
    assert "wrote report/report.html (made the folder report)\n" in captured.out  # compare's --out was made


def run_main(cli, argv, capsys) -> str:
    """The stderr of a command that must stop with exit status 2."""
    with pytest.raises(SystemExit) as info:
        cli(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


TINY = ["--random-weights", "tiny", "--device", "cpu", "-q"]
HERE = str(Path(__file__).parent)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--budget", "-1"], "error: --budget -1 must be positive: pass e.g. --budget 24GiB"),
        (["--budget", "0"], "error: --budget 0 must be positive"),
        (["--budget", "abc"], "error: --budget abc: cannot parse it: pass bytes or a number with a unit"),
        (["--frames", "0"], "error: --frames 0 must be a positive whole number"),
        (["--frames", "-3"], "error: --frames -3 must be a positive whole number"),
        (["--frames", "10"], "error: --frames 10: Wan2.2 makes 4k+1 frames: pass --frames 9 or 13"),
        (["--steps", "0"], "error: --steps 0 must be a positive whole number"),
        (["--fps", "0"], "error: --fps 0 must be a positive whole number"),
        (["--guidance", "-1"], "error: --guidance -1.0 must be 0 or more"),
        (["--height", "30"], "error: --height 30: Wan2.2 needs a multiple of 16: pass --height 16"),
        (["--width", "832"], "error: --width 832 is more than the transformer of tiny random weights can place"),
        (["--frames", "129"], "error: --frames 129 is more than the transformer of tiny random weights can place"),
        (
            ["--host-budget", "8GiB", "--compression", "lossless", "--raw-copies", "ram"],
            "error: --host-budget with --compression keeps the compressed copies only (the raw ones wait on disk): "
            "drop --raw-copies ram",
        ),
        (
            ["--host-budget", "8GiB", "--gpus", "2"],
            "error: --host-budget cannot be combined with --gpus 2 yet (the ranks share one host copy",
        ),
        (
            ["--background-encoding"],
            "error: --background-encoding compresses while the raw copies stream: add --compression lossless",
        ),
        (["--compile", "full"], "error: --compile full compiles each denoiser whole, which offloading cannot stream"),
        (["--output", f"{__file__}/x.mp4"], f"error: --output {__file__}/x.mp4: {__file__} is not a writable folder"),
        (["--output", HERE], f"error: --output {HERE} is a folder: pass --output {HERE}/NAME.mp4"),
        (["--output", "videos/"], "error: --output videos/ is a folder: pass --output videos/NAME.mp4"),
        (["--output", "videos"], "error: --output videos: the file written there is .mp4: pass --output videos.mp4"),
        (["--output", "clip.avi"], "error: --output clip.avi: the file written there is .mp4: pass --output clip.mp4"),
        (["--json", "summary"], "error: --json summary: the file written there is .json: pass --json summary.json"),
        (["--json", HERE], f"error: --json {HERE} is a folder: pass --json {HERE}/NAME.json"),
        (["--json", "runs/"], "error: --json runs/ is a folder: pass --json runs/NAME.json"),
        (["--profile-dir", __file__], f"error: --profile-dir {__file__}: {__file__} is not a writable folder"),
    ],
)
def test_user_errors_are_one_line_naming_the_flag(argv, says, capsys) -> None:
    err = run_main(wan22_t2v.cli, [*TINY, *argv], capsys)
    assert err.startswith(says) and len(err.strip().splitlines()) == 1, err


def test_the_host_budget_flag_defaults_to_auto_and_none_keeps_all_in_ram() -> None:
    """``--host-budget`` is ``auto`` unless typed (the offload decides whether a tier is needed), ``none`` is the
    Python ``None`` (every host copy in RAM), and ``auto`` goes with ``--gpus N`` (the ranks' shared copy stays in
    RAM) where a sized budget is refused; ``--raw-copies`` is passed only as typed, so ``auto`` may still turn the
    compressed tier on."""
    assert wan22_t2v.parse_args(TINY).host_budget == "auto"
    assert wan22_t2v.parse_args([*TINY, "--host-budget", "none"]).host_budget is None
    assert wan22_t2v.parse_args([*TINY, "--host-budget", "auto", "--gpus", "2"]).host_budget == "auto"
    compressed = wan22_t2v.parse_args([*TINY, "--compression", "lossless", "--raw-copies", "ram"])
    assert compressed.host_budget == "auto" and compressed.raw_copies == "ram"  # a tier, if needed, refuses it then


def test_output_mistakes_stop_before_anything_loads(tmp_path, monkeypatch, capsys) -> None:
    def load(*args, **kwargs):
        raise AssertionError("loaded before the output was checked")

    monkeypatch.setattr(wan22_t2v, "load", load)
    err = run_main(wan22_t2v.cli, [*TINY, "--output", str(tmp_path)], capsys)
    assert err.startswith(f"error: --output {tmp_path} is a folder") and len(err.splitlines()) == 1
    for folder in (f"{tmp_path}/new/", "videos/"):  # named as a folder, existing or not
        err = run_main(wan22_t2v.cli, [*TINY, "--output", folder], capsys)
        assert err == f"error: --output {folder} is a folder: pass --output {folder}NAME.mp4\n"
    avi, mp4 = tmp_path / "clip.avi", tmp_path / "clip.mp4"
    err = run_main(wan22_t2v.cli, [*TINY, "--output", str(avi)], capsys)
    assert err == f"error: --output {avi}: the file written there is .mp4: pass --output {mp4}\n"
    if Path("/proc/self").exists():  # os.access says yes to root there; making a file says no
        err = run_main(wan22_t2v.cli, [*TINY, "--output", "/proc/flextensor/x.mp4"], capsys)
        assert err.startswith("error: --output /proc/flextensor/x.mp4: /proc is not a writable folder"), err
    err = run_main(compare.cli, ["--recipe", "wan22_t2v", "--out", __file__, "--", *TINY], capsys)
    report = Path(__file__).parent / "report"
    assert err.strip() == f"error: --out {__file__} is a file; the report is a folder of files: pass --out {report}"


def test_missing_folders_are_made_and_said_and_an_unplanned_vae_is_explained(tmp_path, capsys) -> None:
    """Nothing is made silently: the mp4's folder, the --json's folder, a new --profile-dir; a replaced file is said
    too. The VAE, seen once in a recipe run, reads "profiling": a line under the table says why."""
    output, summary, profiles = tmp_path / "a" / "b" / "fox.mp4", tmp_path / "c" / "run.json", tmp_path / "p"
    argv = [*TINY, "--output", str(output), "--json", str(summary), "--profile-dir", str(profiles)]
    info = wan22_t2v.main(argv)
    out = capsys.readouterr().out
    inline = "none yet: each component's first forwards profile it, in this generation (a new folder)"
    assert f"profile in {profiles}: {inline}\n" in out
    assert "generation " in out and "(profiled in its first forwards: 7 forwards unplanned, included)" in out
    assert f"wrote {output} (9 frames, 32x32; made the folder {output.parent})\n" in out
    assert out.endswith(f"wrote {summary} (made the folder {summary.parent})\n"), out
    assert info["made_folder"] == str(output.parent) and output.exists() and summary.exists()
    # the RAM available at enable (the least of the host's, its cgroups' and its rlimits') and where it came from
    assert info["ram_available_bytes"] > 0 and info["ram_available_source"] in out
    assert f"RAM available at enable {format_bytes(info['ram_available_bytes'])}: " in out
    assert re.search(r"^vae .* profiling$", out, re.MULTILINE)
    assert "\nphase: vae ran once in this run (a VAE decodes once per generation" in out
    wan22_t2v.main(argv)
    out = capsys.readouterr().out
    assert f"profile in {profiles}: found: planned from the first step\n" in out
    assert "(planned from a saved profile; 1 forward unplanned)" in out  # the VAE's decode, once per generation
    assert f"wrote {output} (9 frames, 32x32; replaced the file that was there)\n" in out
    assert out.endswith(f"wrote {summary} (replaced the file that was there)\n")


def test_flags_are_never_abbreviated(capsys) -> None:
    """``--frame 5`` is not taken for ``--frames 5`` (nor ``--rec`` for ``--recipe``)."""
    for cli, argv in ((wan22_t2v.cli, [*TINY, "--frame", "5"]), (compare.cli, ["--rec", "wan22_t2v"])):
        with pytest.raises(SystemExit) as stopped:
            cli(argv)
        assert stopped.value.code == 2 and "unrecognized arguments: --" in capsys.readouterr().err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_asking_for_cuda_without_it_names_the_flag(capsys) -> None:
    err = run_main(wan22_t2v.cli, ["--random-weights", "tiny", "--device", "cuda"], capsys)
    assert err.startswith("error: --device cuda: no CUDA device is visible") and "pass --device cpu" in err


def test_no_weights_is_one_line_and_verbose_shows_the_traceback(capsys) -> None:
    err = run_main(wan22_t2v.cli, [], capsys)
    assert err.startswith("error: wan22_t2v: no weights: pass --model PATH") and len(err.strip().splitlines()) == 1
    err = run_main(wan22_t2v.cli, ["--budget", "-1", "-v", "--random-weights", "tiny"], capsys)
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("error: --budget -1 must be positive")


def test_a_budget_too_small_names_the_smallest_budget_exactly_and_it_works(tmp_path, capsys) -> None:
    """The hint is in the unit that shows it (KiB here, not a rounded "0.01 GiB"), rounded up: typed, it runs."""
    argv = [*TINY, "--output", str(tmp_path / "x.mp4"), "--profile-dir", str(tmp_path)]
    err = run_main(wan22_t2v.cli, [*argv, "--budget", "100KiB"], capsys)
    said = re.fullmatch(
        r"error: --budget 100KiB is too small for this pipeline: the smallest workable budget is "
        r"(\d+\.\d\d) KiB; pass --budget (\d+\.\d\d)KiB\n",
        err,
    )
    assert said and said.group(1) == said.group(2), err
    info = wan22_t2v.main([*argv, "--budget", f"{said.group(2)}KiB"])
    assert Path(info["output"]).exists()


def test_budget_suggestions_are_the_least_value_that_works_as_typed() -> None:
    for required in (1, 1023, 1024, 1025, 124_938, 2**20 + 1, 2**30 + 1, 5 * 2**40 + 7):
        text = budget_suggestion(required)
        assert parse_bytes(text) >= required, (required, text)
        number, unit = re.fullmatch(r"([\d.]+)(\w*)", text).groups()
        if unit:  # a hundredth less would not do
            assert parse_bytes(f"{float(number) - 0.01:.2f}{unit}") < required, (required, text)
    assert budget_suggestion(1023) == "1023" and budget_suggestion(2**30 + 1) == "1.01GiB"


def test_a_budget_too_small_is_refused_before_the_weights_load(tmp_path, capsys, monkeypatch) -> None:
    """Random weights: the architecture is built on the meta device only, then the budget refused."""
    builds = []
    real = wan22_t2v.load

    def load(options, device, attach=False):
        builds.append(attach)
        return real(options, device, attach=attach)

    monkeypatch.setattr(wan22_t2v, "load", load)
    argv = [*TINY, "--budget", "100KiB", "--output", str(tmp_path / "x.mp4"), "--profile-dir", str(tmp_path)]
    err = run_main(wan22_t2v.cli, argv, capsys)
    assert "smallest workable budget" in err
    assert builds == [True]  # the meta-device skeleton; no weights were made


def test_budget_errors_round_the_suggestion_up_and_use_the_flag() -> None:
    line = common.error_line(BudgetError("gpu_budget too small", required_bytes=2**30 + 1), "1GiB")
    assert line == (
        "--budget 1GiB is too small for this pipeline: the smallest workable budget is 1.01 GiB; pass --budget 1.01GiB"
    )
    line = common.error_line(HostBudgetError("too small", required_bytes=200_000), "auto", "100KB")
    assert line.endswith("the smallest workable host budget is 195.32 KiB; pass --host-budget 195.32KiB")
    auto = 'host_budget="auto" (--host-budget auto) is 1.00 KiB, ... of the RAM available (...): raise that limit'
    assert common.error_line(HostBudgetError(auto, required_bytes=200_000), "auto", "auto") == auto  # names the RAM
    assert common.error_line(BudgetError("Pass gpu_budget >= 5"), "5") == "Pass --budget >= 5"


def test_a_decimal_budget_is_printed_in_gib() -> None:
    assert budget_note("24gb") == "budget: 24gb = 22.35 GiB (GB are powers of ten; write GiB for powers of two)"
    assert budget_note("24GiB") is None and budget_note("auto") is None and budget_note("250000") is None


def test_help_shows_every_flag_with_text_and_its_default(capsys) -> None:
    for module in RECIPES.values():
        with pytest.raises(SystemExit):
            module.parse_args(["--help"])
        text = capsys.readouterr().out
        for flag in ("--frames", "--steps", "--profile-dir", "--output", "--budget", "--compile", "--fps"):
            described = re.search(rf"^  (?:-\w, )?{flag}(?: \S+)?\s+\S", text, re.MULTILINE) or re.search(
                rf"^  (?:-\w, )?{flag}(?: \S+)?\n\s{{10,}}\S", text, re.MULTILINE
            )
            assert described, (module.__name__, flag)
        assert "with tiny weights" in text and "(default: profiles)" in text and "examples:" in text
    with pytest.raises(SystemExit):
        ltx2_outpaint.parse_args(["--help"])
    text = capsys.readouterr().out
    assert "--height" not in text and "--width" not in text  # --canvas sets both
    with pytest.raises(SystemExit):
        compare.main(["--help"])
    assert "-- RECIPE_ARGS" in capsys.readouterr().out


def test_module_entry_lists_the_recipes_and_compare(capsys) -> None:
    assert entry.main([]) == 0
    out = capsys.readouterr().out
    assert all(f"flextensor-{name.replace('_', '-')}" in out for name in RECIPES) and "flextensor-compare" in out
    assert entry.main(["wan"]) == 2


def test_tiny_defaults_are_quick_sizes_and_full_defaults_the_published_ones(tmp_path) -> None:
    tiny = wan22_t2v.parse_args(["--random-weights", "tiny"])
    assert (tiny.frames, tiny.height, tiny.width, tiny.steps) == (9, 32, 32, 2)
    full = wan22_t2v.parse_args(["--random-weights", "full"])
    assert (full.frames, full.height, full.width, full.steps) == (81, 480, 832, 40)
    ltx = ltx2_outpaint.parse_args(["--random-weights", "tiny"])
    assert (ltx.frames, ltx.width, ltx.height, ltx.source_size) == (9, 64, 64, (32, 32))
    cosmos = cosmos_transfer25.parse_args(["--random-weights", "tiny"])
    assert (cosmos.frames, cosmos.height, cosmos.width, cosmos.chunk) == (5, 32, 32, 16)
    with pytest.raises(AttributeError):  # frozen: nothing writes into the options after parsing
        tiny.frames = 5  # type: ignore[misc]


def test_compare_refuses_a_bad_memory_cap_and_says_a_good_one_is_ignored_on_the_cpu(monkeypatch, capsys) -> None:
    err = run_main(compare.cli, ["--recipe", "wan22_t2v", "--memory-cap", "abc", "--", *TINY], capsys)
    assert err.strip() == "error: --memory-cap abc: pass a positive size with a unit, e.g. --memory-cap 24GB"
    err = run_main(compare.cli, ["--recipe", "wan22_t2v", "--", *TINY, "--compile", "full", "--no-offload"], capsys)
    assert (
        err.strip()
        == "error: --compile full cannot be offloaded, and compare runs offloaded too: pass --compile regional"
    )
    assert wan22_t2v.parse_args([*TINY, "--compile", "full", "--no-offload"]).compile == "full"  # natively it is fine

    def stop(*args, **kwargs):
        raise OptionsError("stopped after the checks")

    monkeypatch.setattr(wan22_t2v, "load", stop)
    with pytest.raises(SystemExit):
        compare.cli(["--recipe", "wan22_t2v", "--memory-cap", "24GB", "--", *TINY])
    captured = capsys.readouterr()
    assert "stopped after the checks" in captured.err  # the note came first, before loading:
    assert "note: --memory-cap and --offload-memory-cap have no effect on the CPU" in captured.out


def test_component_table_aligns_long_class_names_and_explains_its_columns() -> None:
    component = {
        "resident_weight_bytes": 1024,
        "streamed_unit_bytes": 0,
        "streamed_units": 0,
        "units": 2,
        "stall_ms": 0.0,
        "overlap_pct": None,
        "phase": "steady",
        "host_ram_bytes": 4096,
        "host_places": {"ram_raw_bytes": 4096, "ram_compressed_bytes": 0, "disk_bytes": 0, "arriving": False},
        "unit_bytes": 1000,
        "transfer_unit_bytes": 700,
    }
    report = {
        "device": "cpu",
        "budget_bytes": 2**30,
        "peak_allocated_bytes": None,
        "vae_tiling": True,
        "component_switches": 3,
        "process_host_bytes": 2**20,
        "components": {
            "text_encoder": {**component, "class": "Qwen2_5_VLForConditionalGeneration"},
            "vae": {**component, "class": "AutoencoderKLWan", "overlap_pct": 97.5, "streamed_units": 1},
        },
    }
    lines = format_report(report).splitlines()
    header, *rows = lines[1:4]
    assert all(row.index("steady") == header.index("phase") for row in rows)  # columns line up
    assert all(row.index("iB") == rows[0].index("iB") for row in rows)  # right-aligned sizes
    legend = "\n".join(lines[4:])
    assert all(k in legend for k in ("units:", "overlap:", "switches:", "host RAM:", "link:", "waits:"))
    assert all(" 0.70 " in row for row in rows)  # a compressed load moves 0.70 of the bytes


def test_diffusers_empty_fp32_list_warning_is_filtered() -> None:
    common.setup_logging(False)
    logger = logging.getLogger("diffusers.models.modeling_utils")
    keep = logging.LogRecord(logger.name, logging.WARNING, "", 0, "other warning", None, None)
    drop = logging.LogRecord(
        logger.name, logging.WARNING, "", 0, "X should be kept in float32: []. Casting", None, None
    )
    assert logger.filter(keep) and not logger.filter(drop)


def test_the_outpainting_help_example_is_quick(tmp_path) -> None:
    """The --help example (tiny defaults) makes 9 frames, not the source's 97."""
    clip = tmp_path / "clip.mp4"
    write_mp4(clip, np.zeros((20, 32, 32, 3), dtype=np.uint8))
    options = ltx2_outpaint.parse_args(["--random-weights", "tiny", "--input", str(clip)])
    assert options.frames == 9 and options.steps == 2


def test_progress_bars_are_labelled_and_quiet_turns_them_off(capsys) -> None:
    class Pipe:
        def set_progress_bar_config(self, **kwargs) -> None:
            self.config = kwargs

    pipe = Pipe()
    common.label_generation(pipe, "profiling generation", quiet=False)
    assert pipe.config == {"desc": "profiling generation", "disable": None}  # None: off when not a terminal
    common.label_generation(pipe, "generation", quiet=True)
    assert pipe.config == {"desc": "generation", "disable": True}
    with common.stage("loading weights", quiet=True):
        pass
    assert capsys.readouterr().err == ""


def test_running_out_of_gpu_memory_is_one_line_naming_the_budget(monkeypatch, capsys) -> None:
    def out_of_memory(options):
        raise __import__("torch").OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")

    monkeypatch.setattr(wan22_t2v, "run", out_of_memory)
    err = run_main(wan22_t2v.cli, [*TINY, "--budget", "20GiB"], capsys)
    assert err.startswith("error: the GPU ran out of memory under --budget 20GiB (CUDA out of memory. Tried")
    assert "pass a smaller --budget" in err and len(err.strip().splitlines()) == 1


def python_examples(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.DOTALL)


def test_the_readme_python_example_runs_on_the_tiny_pipeline(tmp_path, monkeypatch, capsys) -> None:
    """The copy-paste example, as written, in a scratch folder: it offloads, generates, reports and restores."""
    monkeypatch.chdir(tmp_path)
    examples = python_examples(README)
    tiny = [code for code in examples if "build_pipeline(" in code]
    assert len(tiny) == 1 and "torch_dtype" not in README  # diffusers 0.42 deprecates torch_dtype for dtype
    exec(compile(tiny[0], "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "(9, 32, 32, 3)" in out and re.search(r"^transformer .* 4/4 .* steady$", out, re.MULTILINE), out
    for code in examples:  # the others need real weights: they must at least be Python
        compile(code, "README.md", "exec")


#: What users read: the README, the guide, the results' README.
READMES = (ROOT / "README.md", ROOT / "docs/guide.md", ROOT / "benchmarks/results/README.md")


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    return {
        re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        for heading in re.findall(r"^#{1,6} (.+)$", text, re.MULTILINE)
    }


def test_links_in_the_readmes_point_at_files_and_headings_that_exist() -> None:
    for readme in READMES:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", readme.read_text()):
            if "://" in target:
                continue
            path = readme.parent / target if target else readme
            assert path.exists(), (readme.name, target)
            if anchor:
                assert anchor in heading_anchors(path.read_text()), (readme.name, target, anchor)


#: Folders of the repository (and of the package, which the guide names without its prefix) that prose cites.
CITED_FOLDERS = ("tests", "benchmarks", "scripts", "docs", "assets", "recipes", "engine", "pipelines", "reports")


def mentioned_paths(text: str) -> set[str]:
    """Files and folders of the repository a text names: ``engine/handle.py``, ``tests/test_cli.py``, ``.ci/run``,
    and bare script names (``units.py``, ``gpu_proof.sh``), braces expanded (``{tiny,full}.json``)."""
    folders = "|".join((r"\.ci", "flextensor_diffusers", *CITED_FOLDERS))
    found = set(re.findall(rf"(?<![\w/.$-])((?:{folders})/[\w./{{}},-]*)", text))
    found |= set(re.findall(r"(?<![\w/.-])(\w+\.(?:py|sh))\b", text))
    paths = set()
    for path in found:
        path = path.rstrip(".,")
        braces = re.search(r"\{([^}]*)\}", path)
        options = braces.group(1).split(",") if braces else [""]
        paths |= {path.replace(braces.group(0), o) if braces else path for o in options}
    return paths


def test_every_file_the_readme_and_the_guide_name_exists() -> None:
    """No removed script (``diag_overlap.py``, ``setup_h200.sh``) or engine module (``runtime.py``) is cited."""
    names = {path.name for path in ROOT.rglob("*") if ".git" not in path.parts}
    for doc in (ROOT / "README.md", ROOT / "docs/guide.md"):
        for path in mentioned_paths(doc.read_text()):
            if "/" not in path:  # a bare file name: somewhere in the repository
                assert path in names, (doc.name, path)
            else:
                candidates = (ROOT / path, ROOT / "flextensor_diffusers" / path)
                assert any(c.exists() for c in candidates), (doc.name, path)
    assert not (ROOT / "ALIGNMENT_FINDINGS.md").exists()  # folded into docs/guide.md


def test_mentioned_paths_finds_what_the_docs_cite() -> None:
    text = "`engine/runtime.py` and diag_overlap.py, `tests/test_cli.py`, wan22_t2v/{tiny,full}.json, `.ci/run`."
    assert mentioned_paths(text) == {"engine/runtime.py", "diag_overlap.py", "tests/test_cli.py", ".ci/run"}
    assert mentioned_paths("assets/wan22_t2v/{tiny,full}.json") == {
        "assets/wan22_t2v/tiny.json",
        "assets/wan22_t2v/full.json",
    }


def test_the_readme_is_a_short_read_with_its_guarantees() -> None:
    """A five-minute read: set-up, a Python example, recipes, how it works, options, guarantees, results."""
    assert len(README.splitlines()) <= 230
    guarantees = " ".join(README[README.index("## Guarantees and limits") :].split("\n## ")[0].split())
    for promise in (
        "bitwise equal to native",
        "its own device copy while it runs and its host copy otherwise",
        "version counters",
        "`.data`",
        "autograd through a streamed unit",
        "a view of its own weights",
        "plain (non-submodule) reference",
        "whole process's peak of allocated memory",
        "cuBLAS workspace",
        "mod 64 bytes on the CPU (512 on CUDA)",
    ):
        assert promise in guarantees, promise


def test_every_install_of_an_extra_keeps_the_editable_install_and_names_an_extra_that_exists() -> None:
    """``pip install ".[x]"`` without ``-e`` would replace the editable install; every place a user reads an
    install line (the README, the guide, the messages in the package) says ``pip install -e ".[x]"``."""
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    texts = {path: path.read_text() for path in (ROOT / "README.md", ROOT / "docs/guide.md")}
    texts |= {path: path.read_text() for path in (ROOT / "flextensor_diffusers").rglob("*.py")}
    named = set()
    for path, text in texts.items():
        for line in re.findall(r"pip install[^\n`]*", text):
            if "torch==" in line and "-e" in line:  # the README's set-up line: torch pinned, then the package
                named |= set(re.findall(r'-e "\.\[([\w,-]+)\]"', line))
                continue
            assert re.search(r'pip install -e "\.\[[\w-]+\]"', line), (path.name, line)
            named |= set(re.findall(r'-e "\.\[([\w-]+)\]"', line))
    assert named and named <= extras, named - extras
    assert {"cosmos", "cosmos-guardrail", "lpips", "st-lpips"} <= named
