"""Fidelity metrics (PSNR, SSIM, max-abs, LPIPS where its weights are local), plots and the HTML page."""

from __future__ import annotations

import base64
import html
import importlib.util
import io
import json
import math
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..engine.config import format_bytes

INF = "inf"  # JSON has no infinity: a PSNR of identical frames is written as this string


def psnr(a: np.ndarray, b: np.ndarray, peak: float = 255.0) -> float:
    """Peak signal-to-noise ratio in dB of two uint8 images; ``math.inf`` when identical."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10.0 * math.log10(peak * peak / mse)


def _gaussian_window(size: int = 11, sigma: float = 1.5) -> torch.Tensor:
    x = torch.arange(size, dtype=torch.float64) - size // 2
    g = torch.exp(-(x**2) / (2 * sigma**2))
    g = g / g.sum()
    return (g[:, None] * g[None, :])[None, None]


def ssim(a: np.ndarray, b: np.ndarray, peak: float = 255.0) -> float:
    """Mean structural similarity (Wang et al. 2004: 11x11 Gaussian, sigma 1.5) over RGB channels."""
    x = torch.from_numpy(a.astype(np.float64)).permute(2, 0, 1)[:, None]
    y = torch.from_numpy(b.astype(np.float64)).permute(2, 0, 1)[:, None]
    size = min(11, x.shape[-1], x.shape[-2])
    w = _gaussian_window(size if size % 2 else size - 1)
    conv = torch.nn.functional.conv2d
    mx, my = conv(x, w), conv(y, w)
    sxx = conv(x * x, w) - mx * mx
    syy = conv(y * y, w) - my * my
    sxy = conv(x * y, w) - mx * my
    c1, c2 = (0.01 * peak) ** 2, (0.03 * peak) ** 2
    s = ((2 * mx * my + c1) * (2 * sxy + c2)) / ((mx * mx + my * my + c1) * (sxx + syy + c2))
    return float(s.mean())


#: torchvision's AlexNet weights, which real LPIPS needs in the local torch cache (nothing is downloaded).
ALEXNET_CHECKPOINT = "alexnet-owt-7be5be79.pth"


def lpips_network(random_backbone: bool = False) -> Any:
    """LPIPS (AlexNet trunk, the package's own calibrated linear layers), in eval mode.

    ``random_backbone``: a randomly initialised trunk (seeded), which needs no download; its numbers
    are not LPIPS but exercise the same code path (the tests use it).
    """
    import lpips

    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        torch.manual_seed(0)
        # lpips builds its trunk with torchvision's deprecated `pretrained=`; the warning is not ours to fix.
        warnings.filterwarnings("ignore", category=UserWarning, module="torchvision")
        return lpips.LPIPS(net="alex", pnet_rand=random_backbone, verbose=False).eval()


@dataclass(frozen=True)
class PerceptualMetric:
    """A perceptual metric this machine can compute offline, or none; ``note`` says which, and why not others."""

    model: Any | None
    name: str | None  # the per-frame key: "lpips" or "st_lpips"
    note: str


#: What installs each optional metric (from the clone, editable, so the set-up's install stays as it is).
LPIPS_INSTALL = 'pip install -e ".[lpips]"'
ST_LPIPS_INSTALL = 'pip install -e ".[st-lpips]"'


def perceptual_metric() -> PerceptualMetric:
    """LPIPS when the lpips package and AlexNet's weights are local; else ST-LPIPS when the optional
    ``stlpips-pytorch`` package (which ships its full weights) is installed; else none, and why.

    Optional metrics never stop a report: a package that is missing, fails to import (stlpips-pytorch imports
    IPython and torchsummary) or fails to load its weights is a sentence in the note, not an exception.
    """
    lpips_metric = _lpips()
    if lpips_metric.model is not None:
        return lpips_metric
    st_metric = _st_lpips()
    if st_metric.model is not None:
        return replace(st_metric, note=f"{st_metric.note} (LPIPS not computed: {lpips_metric.note})")
    return PerceptualMetric(
        None,
        None,
        f"LPIPS not computed: {lpips_metric.note}; nor ST-LPIPS: {st_metric.note}. PSNR, SSIM and max-abs are reported",
    )


def _lpips() -> PerceptualMetric:
    """LPIPS, or no model and why not."""
    checkpoint = Path(torch.hub.get_dir()) / "checkpoints" / ALEXNET_CHECKPOINT
    if importlib.util.find_spec("lpips") is None:
        return PerceptualMetric(None, None, f"the lpips package is not installed ({LPIPS_INSTALL})")
    if not checkpoint.exists():
        why = (
            f"its AlexNet backbone weights are not in the local torch cache ({checkpoint}): copy {ALEXNET_CHECKPOINT} "
            "there (nothing is downloaded)"
        )
        return PerceptualMetric(None, None, why)
    try:
        return PerceptualMetric(lpips_network(), "lpips", "LPIPS (AlexNet, v0.1) computed")
    except Exception as exc:  # a third-party package and a file we did not write: any failure is a note
        return PerceptualMetric(None, None, f"loading it failed ({failure(exc)})")


def _st_lpips() -> PerceptualMetric:
    """ST-LPIPS, or no model and why not."""
    if importlib.util.find_spec("stlpips_pytorch") is None:
        return PerceptualMetric(None, None, f"stlpips-pytorch is not installed ({ST_LPIPS_INSTALL})")
    try:
        from stlpips_pytorch import stlpips

        model = stlpips.LPIPS(net="alex", variant="shift_tolerant", verbose=False).eval()
    except Exception as exc:  # e.g. ModuleNotFoundError: IPython, which the package imports but does not declare
        why = f"importing or loading stlpips-pytorch failed ({failure(exc)}; {ST_LPIPS_INSTALL} installs what it needs)"
        return PerceptualMetric(None, None, why)
    note = "ST-LPIPS (shift-tolerant LPIPS, AlexNet; stlpips-pytorch) computed instead of LPIPS"
    return PerceptualMetric(model, "st_lpips", note)


def failure(exc: BaseException) -> str:
    """``ModuleNotFoundError: No module named 'IPython'``: an exception in one line."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def perceptual_distance(model: Any, a: np.ndarray, b: np.ndarray) -> float:
    """The model's distance between two (H, W, 3) uint8 frames, scaled to [-1, 1] as LPIPS expects."""

    def to(frame: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(frame)).permute(2, 0, 1)[None].float() / 127.5 - 1

    with torch.no_grad():
        return float(model(to(a), to(b)).flatten()[0])


def frame_metrics(
    reference: np.ndarray, test: np.ndarray, perceptual: PerceptualMetric | None = None
) -> dict[str, Any]:
    """Per-frame PSNR, SSIM, max-abs (and LPIPS or ST-LPIPS when available) of two (F, H, W, 3) uint8 videos.

    ``perceptual``: a metric to use instead of finding one (tests pass a random-trunk net). A perceptual
    metric that fails on these frames is left out of every row and its failure said in the note.
    """
    if reference.shape != test.shape:
        raise ValueError(f"videos differ in shape: {reference.shape} vs {test.shape}")
    metric = perceptual or perceptual_metric()
    rows = [pixel_metrics(ref, out) for ref, out in zip(reference, test, strict=True)]
    if metric.model is not None:
        try:
            values = [perceptual_distance(metric.model, ref, out) for ref, out in zip(reference, test, strict=True)]
        except Exception as exc:  # an optional metric never stops the report
            why = f"{metric.name} not computed: it failed on these frames ({failure(exc)})"
            metric = PerceptualMetric(None, None, f"{why}. PSNR, SSIM and max-abs are reported")
        else:
            for row, value in zip(rows, values, strict=True):
                row[metric.name] = round(value, 6)
    return {
        "frames": rows,
        "lpips_note": metric.note,
        "perceptual_metric": metric.name,
        "identical": bool(np.array_equal(reference, test)),
        "measured_on": "uint8 RGB frames before encoding",
    }


def pixel_metrics(reference: np.ndarray, test: np.ndarray) -> dict[str, Any]:
    """PSNR (``"inf"`` when identical), SSIM and max-abs of two (H, W, 3) uint8 frames."""
    value = psnr(reference, test)
    return {
        "psnr_db": INF if math.isinf(value) else round(value, 4),
        "ssim": round(ssim(reference, test), 6),
        "max_abs": int(np.max(np.abs(reference.astype(np.int16) - test.astype(np.int16)))),
    }


def latent_metrics(reference: torch.Tensor, test: torch.Tensor) -> dict[str, Any]:
    same_bits = reference.dtype == test.dtype and reference.shape == test.shape
    if same_bits:
        same_bits = bool(
            torch.equal(
                reference.view(torch.uint8) if reference.dim() else reference,
                test.view(torch.uint8) if test.dim() else test,
            )
        )
    diff = (reference.double() - test.double()).abs()
    return {"bitwise_equal": same_bits, "max_abs": float(diff.max()), "mean_abs": float(diff.mean())}


# ------------------------------------------------------------------------------------------ plots


def _axes() -> tuple[Any, Any]:
    """A figure and its axes, on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(8, 3.2))


def _png(fig: Any) -> bytes:
    """The figure as PNG bytes; the figure is closed."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()


def _finish(fig: Any, ax: Any, xlabel: str, ylabel: str, title: str, empty: str | None = None) -> bytes:
    """Labels, grid and a legend of one line per run (or ``empty`` when no run had data), as PNG."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    elif empty is not None:
        ax.text(0.5, 0.5, empty, ha="center", va="center", transform=ax.transAxes)
    return _png(fig)


def plot_memory(runs: dict[str, dict[str, Any]]) -> bytes:
    """Allocated GPU memory over each run (GPU runs only: the CPU has no allocator counters)."""
    fig, ax = _axes()
    for name, run in runs.items():
        samples = [s for s in run.get("memory_timeline") or [] if s["allocated_bytes"] is not None]
        if samples:
            ax.plot([s["t_s"] for s in samples], [s["allocated_bytes"] / 2**30 for s in samples], label=name, lw=1.5)
    ax.set_ylim(bottom=0)
    return _finish(
        fig,
        ax,
        "time since generation start (s)",
        "GPU allocated (GiB)",
        "GPU memory over time",
        empty="no GPU memory samples",
    )


def steps_figure(runs: dict[str, dict[str, Any]]) -> tuple[Any, Any]:
    """Seconds per denoising step; whole-number steps on x, zero at the bottom of y."""
    from matplotlib.ticker import MaxNLocator

    fig, ax = _axes()
    for name, run in runs.items():
        steps = run.get("step_s") or []
        if steps:
            ax.plot(range(1, len(steps) + 1), steps, marker="o", label=name)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(bottom=0)
    return fig, ax


def plot_steps(runs: dict[str, dict[str, Any]]) -> bytes:
    fig, ax = steps_figure(runs)
    return _finish(fig, ax, "denoising step", "time (s)", "Per-step time", empty="no completed run")


def plot_frames(metrics: dict[str, Any] | None) -> bytes:
    return _png(frames_figure(metrics))


def frames_figure(metrics: dict[str, Any] | None) -> Any:
    """PSNR (finite values only), SSIM, max-abs and the perceptual metric per frame, one panel each.

    An infinite PSNR is no point on a line: frames that are identical are named in the title instead.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    if not metrics:
        fig, ax = _axes()
        ax.text(0.5, 0.5, "no native output to compare with", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return fig
    rows = metrics["frames"]
    name = metrics.get("perceptual_metric")
    panels = [("psnr_db", "PSNR (dB)"), ("ssim", "SSIM"), ("max_abs", "max-abs (0-255)")]
    if name and name in rows[0]:
        panels.append((name, "ST-LPIPS" if name == "st_lpips" else "LPIPS"))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 2.8))
    x = list(range(len(rows)))
    for ax, (key, label) in zip(axes, panels, strict=True):
        values = [r[key] for r in rows]
        if key == "psnr_db":
            finite = [(i, v) for i, v in zip(x, values, strict=True) if v != INF]
            if finite:
                ax.plot(*zip(*finite, strict=True), marker=".")
            identical = len(rows) - len(finite)
            ax.set_title(f"{label}\n{identical} of {len(rows)} frames identical", fontsize=9)
            if not finite:
                ax.text(0.5, 0.5, "identical\n(PSNR infinite)", ha="center", va="center", transform=ax.transAxes)
                ax.set_xticks([])
                ax.set_yticks([])
        else:
            ax.plot(x, values, marker=".")
            ax.set_title(label, fontsize=9)
            if key != "ssim":
                ax.set_ylim(bottom=0)
        ax.set_xlabel("frame")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    fig.suptitle("Per-frame fidelity, offloaded vs native")
    fig.tight_layout()
    return fig


#: Width of the frame strip; wider strips are scaled down (a full-size strip would be ~10 MB).
STRIP_WIDTH = 1600
#: Small frames (tiny runs) are scaled up to this height, pixel for pixel, so that they can be seen.
STRIP_MIN_HEIGHT = 128
LABEL_WIDTH = 90


def frame_strip(videos: dict[str, np.ndarray], count: int = 5) -> bytes:
    """Rows of evenly spaced frames, one row per video, its name left of the row (never over a frame)."""
    from PIL import Image, ImageDraw

    rows = []
    for name, video in videos.items():
        picks = np.linspace(0, len(video) - 1, num=min(count, len(video))).round().astype(int)
        gap = np.full((video.shape[1], 2, 3), 255, dtype=np.uint8)
        row = np.concatenate([part for i in picks for part in (video[i], gap)][:-1], axis=1)
        image = Image.fromarray(row)
        if image.height < STRIP_MIN_HEIGHT:
            scale = -(-STRIP_MIN_HEIGHT // image.height)
            image = image.resize((image.width * scale, image.height * scale), Image.Resampling.NEAREST)
        labelled = Image.new("RGB", (image.width + LABEL_WIDTH, image.height), (255, 255, 255))
        labelled.paste(image, (LABEL_WIDTH, 0))
        ImageDraw.Draw(labelled).text((6, image.height // 2 - 6), name, fill=(0, 0, 0))
        rows.append(np.asarray(labelled))
    width = max(r.shape[1] for r in rows)
    rows = [np.pad(r, ((0, 4), (0, width - r.shape[1]), (0, 0)), constant_values=255) for r in rows]
    return shrink_png(Image.fromarray(np.concatenate(rows, axis=0)))


def shrink_png(image: Any, width: int = STRIP_WIDTH) -> bytes:
    """``image`` (PIL) as PNG bytes, scaled down to ``width`` if wider."""
    from PIL import Image

    if image.width > width:
        image = image.resize((width, round(image.height * width / image.width)), Image.Resampling.LANCZOS)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


# ------------------------------------------------------------------------------------------ page


def _fmt_bytes(n: Any) -> str:
    """Sizes as the command line prints them (``12.50 KiB``, ``11.03 GiB``), so small components do not read 0."""
    return "n/a" if n is None else format_bytes(n)


def _img(data: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(data).decode()}">'


def _table(head: list[str], rows: list[tuple[str, list[Any]]]) -> str:
    out = "<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"
    for label, values in rows:
        out += f"<tr><th>{html.escape(label)}</th>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in values)
        out += "</tr>"
    return out + "</table>"


def summary_table(runs: dict[str, dict[str, Any]]) -> str:
    rows = [
        ("status", [r["status"] for r in runs.values()]),
        ("generation time", [f"{r['generation_s']:.2f} s" if r.get("generation_s") else "—" for r in runs.values()]),
        ("mean step time", [f"{r['mean_step_s']:.3f} s" if r.get("mean_step_s") else "—" for r in runs.values()]),
        ("profiling generation", [f"{r['profiling_s']:.2f} s" if r.get("profiling_s") else "—" for r in runs.values()]),
        (
            "profiled in",
            [
                f"{r['profiled_in']}, {r['unplanned_forwards']} forwards unplanned" if r.get("profiled_in") else "—"
                for r in runs.values()
            ],
        ),
        ("peak allocated", [_fmt_bytes(r.get("peak_allocated_bytes")) for r in runs.values()]),
        ("peak reserved", [_fmt_bytes(r.get("peak_reserved_bytes")) for r in runs.values()]),
    ]
    stages = dict.fromkeys(s for r in runs.values() for s in r.get("stage_peak_allocated_bytes") or {})
    for stage in stages:  # the allocator's peak while each component (or the VAE decode) ran
        peaks = [(r.get("stage_peak_allocated_bytes") or {}).get(stage) for r in runs.values()]
        rows.append((f"peak in {stage}", [_fmt_bytes(v) if v is not None else "—" for v in peaks]))
    return _table(["", *runs], rows)


def offload_table(report: dict[str, Any] | None) -> str:
    """Per component of the offloaded run: what stayed resident, what was streamed, stalls, overlap."""
    if not report:
        return "<p>no offload report</p>"
    head = ["component", "class", "resident", "streamed", "units streamed / found", "stall ms", "overlap", "phase"]
    rows = []
    for name, c in report["components"].items():
        overlap = "" if c.get("overlap_pct") is None else f"{c['overlap_pct']:.1f}%"
        values = [c["class"], _fmt_bytes(c["resident_weight_bytes"]), _fmt_bytes(c["streamed_unit_bytes"])]
        values += [f"{c['streamed_units']}/{c['units']}", f"{c['stall_ms']:.1f}", overlap, c["phase"]]
        rows.append((name, values))
    legend = (
        "<p class='note'>units: repeated blocks streamed / found (0/0: the component moves whole); overlap: share "
        "of copy time hidden behind compute (blank: nothing was streamed); component switches: "
        f"{html.escape(str(report.get('component_switches')))} (each switch gives the previous component's "
        "memory back).</p>"
    )
    return _table(head, rows) + legend


def fidelity_section(report: dict[str, Any]) -> str:
    fid = report.get("fidelity")
    if not fid:
        return f"<p>{html.escape(report.get('fidelity_note', 'no comparison'))}</p>"
    frames = fid["frames"]["frames"]
    finite = [f["psnr_db"] for f in frames if f["psnr_db"] != INF]
    psnr_text = f"min PSNR {min(finite):.2f} dB" if finite else "PSNR infinite on every frame (identical)"
    same = fid.get("identical") or {}
    identical = (
        f"<b>Frames identical</b> — before encoding (uint8 RGB, what the metrics compare): "
        f"{fid['frames']['identical']}; mp4 files byte for byte: {same.get('mp4_bytes', 'n/a')}; "
        f"decoded mp4 frames: {same.get('decoded', 'n/a')}."
    )
    return (
        f"<p><b>Latents bitwise equal:</b> {fid['latents']['bitwise_equal']} "
        f"(max-abs {fid['latents']['max_abs']:.3g}).</p><p>{identical}</p>"
        f"<p>{psnr_text}; min SSIM {min(f['ssim'] for f in frames):.6f}; "
        f"max-abs {max(f['max_abs'] for f in frames)}.</p><p>{html.escape(fid['frames']['lpips_note'])}</p>"
    )


def header_line(report: dict[str, Any]) -> str:
    compile_mode = (report.get("compile") or {}).get("mode", "none")
    caps = (
        f"memory cap: native {report.get('memory_cap') or 'none'}, "
        f"offloaded {report.get('offload_memory_cap') or 'none'}"
        if report.get("device", "cpu").startswith("cuda")
        else "no memory cap (CPU run)"
    )
    parts = [
        report["device_name"],
        f"torch {report['versions']['torch']}",
        f"diffusers {report['versions']['diffusers']}",
        f"budget {report['budget']}",
        f"compile {compile_mode}",
        caps,
    ]
    return "<p>" + " · ".join(html.escape(str(p)) for p in parts) + "</p>"


def render_html(report: dict[str, Any], images: dict[str, bytes]) -> str:
    """A self-contained page: summary, offload table, fidelity, plots (inline PNGs), links, the raw JSON."""
    runs = report["runs"]
    completed = [n for n, r in runs.items() if r["status"] == "completed"]
    links = " · ".join(
        f'<a href="{html.escape(path)}">{html.escape(path)}</a>' for path in report.get("videos", {}).values()
    )
    strip = (
        "<p>Evenly spaced frames; one row per completed run ("
        + html.escape(", ".join(completed))
        + ").</p>"
        + _img(images["strip"], "frame strip")
        if "strip" in images
        else "<p>no frames</p>"
    )
    memory = (
        _img(images["memory"], "memory timeline")
        if "memory" in images
        else "<p>Not measured: this was a CPU run, and the CPU has no allocator counters.</p>"
    )
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>flextensor-diffusers report</title>",
        "<style>body{font-family:system-ui,sans-serif;max-width:960px;margin:2em auto;padding:0 1em;color:#222}"
        "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 10px;text-align:left}"
        "th{background:#f3f3f3}img{max-width:100%;display:block;margin:0.5em 0}.note{font-size:90%;color:#555}"
        "pre{background:#f7f7f7;padding:1em;overflow:auto;max-height:30em;font-size:12px}</style></head><body>",
        f"<h1>Native vs offloaded: {html.escape(report['recipe'])}</h1>",
        header_line(report),
        f"<p>Videos (beside this page): {links or 'none'}</p>",
        "<h2>Summary</h2>",
        summary_table(runs),
        "<h2>Offload, per component</h2>",
        offload_table(runs.get("offloaded", {}).get("offload_report")),
        "<h2>Fidelity</h2>",
        fidelity_section(report),
        "<h2>Frames</h2>",
        strip,
        "<h2>Per-frame fidelity</h2>",
        _img(images["frames"], "per-frame fidelity"),
        "<h2>Per-step time</h2>",
        _img(images["steps"], "per-step time"),
        "<h2>GPU memory</h2>",
        memory,
        "<h2>report.json</h2>",
        f"<pre>{html.escape(json.dumps(report, indent=1))}</pre>",
        "</body></html>",
    ]
    return "\n".join(parts)
