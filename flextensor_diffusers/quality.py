"""Fidelity metrics (PSNR, SSIM, max-abs, LPIPS where its weights are local), plots and the HTML page."""

from __future__ import annotations

import base64
import html
import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

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


def lpips_status() -> tuple[Any | None, str]:
    """An LPIPS model when the package and its backbone weights are local, else why not."""
    try:
        import lpips
    except ImportError as exc:
        return None, f"LPIPS not computed: the lpips package is not importable ({exc}); pip install lpips torchvision"
    checkpoint = Path(torch.hub.get_dir()) / "checkpoints" / "alexnet-owt-7be5be79.pth"
    if not checkpoint.exists():
        return None, (
            f"LPIPS not computed: its AlexNet backbone weights are not in the local torch cache ({checkpoint}). "
            "Copy alexnet-owt-7be5be79.pth there (nothing is downloaded); PSNR, SSIM and max-abs are reported"
        )
    import lpips

    return lpips.LPIPS(net="alex", verbose=False).eval(), "LPIPS (AlexNet) computed"


def frame_metrics(reference: np.ndarray, test: np.ndarray) -> dict[str, Any]:
    """Per-frame PSNR, SSIM, max-abs (and LPIPS when available) of two (F, H, W, 3) uint8 videos."""
    if reference.shape != test.shape:
        raise ValueError(f"videos differ in shape: {reference.shape} vs {test.shape}")
    model, lpips_note = lpips_status()
    rows = []
    for ref, out in zip(reference, test, strict=True):
        value = psnr(ref, out)
        row = {
            "psnr_db": INF if math.isinf(value) else round(value, 4),
            "ssim": round(ssim(ref, out), 6),
            "max_abs": int(np.max(np.abs(ref.astype(np.int16) - out.astype(np.int16)))),
        }
        if model is not None:
            to = lambda f: torch.from_numpy(f).permute(2, 0, 1)[None].float() / 127.5 - 1  # noqa: E731
            with torch.no_grad():
                row["lpips"] = round(float(model(to(ref), to(out))), 6)
        rows.append(row)
    return {"frames": rows, "lpips_note": lpips_note, "identical": bool(np.array_equal(reference, test))}


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
    fig, ax = _axes()
    for name, run in runs.items():
        samples = [s for s in run.get("memory_timeline") or [] if s["allocated_bytes"] is not None]
        if samples:
            ax.plot([s["t_s"] for s in samples], [s["allocated_bytes"] / 2**30 for s in samples], label=name, lw=1.5)
    return _finish(
        fig,
        ax,
        "time since generation start (s)",
        "GPU allocated (GiB)",
        "GPU memory over time",
        empty="GPU memory not available (CPU run)",
    )


def plot_steps(runs: dict[str, dict[str, Any]]) -> bytes:
    fig, ax = _axes()
    for name, run in runs.items():
        steps = run.get("step_s") or []
        if steps:
            ax.plot(range(1, len(steps) + 1), steps, marker="o", label=name)
    return _finish(fig, ax, "denoising step", "time (s)", "Per-step time")


def plot_frames(metrics: dict[str, Any] | None) -> bytes:
    fig, ax = _axes()
    if metrics:
        rows = metrics["frames"]
        finite = [r["psnr_db"] for r in rows if r["psnr_db"] != INF]
        cap = max(finite, default=60.0) + 10
        values = [cap if r["psnr_db"] == INF else r["psnr_db"] for r in rows]
        ax.plot(range(len(rows)), values, marker=".", label="PSNR (dB; identical frames drawn at the top)")
        ax.set_ylabel("PSNR (dB)")
        if "lpips" in rows[0]:
            twin = ax.twinx()
            twin.plot(range(len(rows)), [r["lpips"] for r in rows], color="tab:red", marker=".", label="LPIPS")
            twin.set_ylabel("LPIPS")
        ax.legend(loc="lower left")
    else:
        ax.text(0.5, 0.5, "no native output to compare with", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("frame")
    ax.set_title("Per-frame fidelity, offloaded vs native")
    ax.grid(alpha=0.3)
    return _png(fig)


#: Width of the frame strip; wider strips are scaled down (a full-size strip would be ~10 MB).
STRIP_WIDTH = 1600


def frame_strip(videos: dict[str, np.ndarray], count: int = 5) -> bytes:
    """Rows of evenly spaced frames, one row per video, as a PNG at most `STRIP_WIDTH` wide."""
    from PIL import Image, ImageDraw

    rows = []
    for name, video in videos.items():
        picks = np.linspace(0, len(video) - 1, num=min(count, len(video))).round().astype(int)
        row = np.concatenate([video[i] for i in picks], axis=1)
        image = Image.fromarray(row)
        ImageDraw.Draw(image).text((4, 2), name, fill=(255, 255, 0))
        rows.append(np.asarray(image))
    width = max(r.shape[1] for r in rows)
    rows = [np.pad(r, ((0, 0), (0, width - r.shape[1]), (0, 0))) for r in rows]
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
    if n is None:
        return "n/a"
    return f"{n / 2**30:.2f} GiB"


def _img(data: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(data).decode()}">'


def render_html(report: dict[str, Any], images: dict[str, bytes]) -> str:
    """A self-contained page: summary table, fidelity, plots (inline PNGs), the raw JSON."""
    runs = report["runs"]
    head = ["", *runs]
    rows = [
        ("status", [r["status"] for r in runs.values()]),
        ("generation time", [f"{r['generation_s']:.2f} s" if r.get("generation_s") else "—" for r in runs.values()]),
        ("mean step time", [f"{r['mean_step_s']:.3f} s" if r.get("mean_step_s") else "—" for r in runs.values()]),
        ("profiling generation", [f"{r['profiling_s']:.2f} s" if r.get("profiling_s") else "—" for r in runs.values()]),
        ("peak allocated", [_fmt_bytes(r.get("peak_allocated_bytes")) for r in runs.values()]),
        ("peak reserved", [_fmt_bytes(r.get("peak_reserved_bytes")) for r in runs.values()]),
    ]
    stages = dict.fromkeys(s for r in runs.values() for s in r.get("stage_peak_allocated_bytes") or {})
    for stage in stages:  # the allocator's peak while each component (or the VAE decode) ran
        peaks = [(r.get("stage_peak_allocated_bytes") or {}).get(stage) for r in runs.values()]
        rows.append((f"peak in {html.escape(stage)}", [_fmt_bytes(v) if v is not None else "—" for v in peaks]))
    table = "<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"
    for label, values in rows:
        table += f"<tr><th>{label}</th>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in values) + "</tr>"
    table += "</table>"
    fid = report.get("fidelity")
    if fid:
        frames = fid["frames"]["frames"]
        finite = [f["psnr_db"] for f in frames if f["psnr_db"] != INF]
        fidelity = (
            f"<p><b>Latents bitwise equal:</b> {fid['latents']['bitwise_equal']} "
            f"(max-abs {fid['latents']['max_abs']:.3g}). <b>Frames identical:</b> {fid['frames']['identical']}; "
            f"min PSNR {min(finite) if finite else 'inf'} dB; min SSIM {min(f['ssim'] for f in frames):.6f}; "
            f"max-abs {max(f['max_abs'] for f in frames)}.</p><p>{html.escape(fid['frames']['lpips_note'])}</p>"
        )
    else:
        fidelity = f"<p>{html.escape(report.get('fidelity_note', 'no comparison'))}</p>"
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>flextensor-diffusers report</title>",
        "<style>body{font-family:system-ui,sans-serif;max-width:960px;margin:2em auto;padding:0 1em;color:#222}"
        "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 10px;text-align:left}"
        "th{background:#f3f3f3}img{max-width:100%;display:block;margin:0.5em 0}"
        "pre{background:#f7f7f7;padding:1em;overflow:auto;max-height:30em;font-size:12px}</style></head><body>",
        f"<h1>Native vs offloaded: {html.escape(report['recipe'])}</h1>",
        f"<p>{html.escape(report['device_name'])} · torch {html.escape(report['versions']['torch'])} · "
        f"diffusers {html.escape(report['versions']['diffusers'])} · budget {html.escape(str(report['budget']))}"
        f" · memory cap: native {html.escape(str(report.get('memory_cap') or 'none'))}, offloaded "
        f"{html.escape(str(report.get('offload_memory_cap') or 'none'))}</p>",
        "<h2>Summary</h2>",
        table,
        "<h2>Fidelity</h2>",
        fidelity,
        "<h2>Frames</h2>",
        "<p>Evenly spaced frames; one row per completed run, in the order "
        + html.escape(", ".join(n for n, r in runs.items() if r["status"] == "completed"))
        + ".</p>"
        + _img(images["strip"], "frame strip")
        if "strip" in images
        else "<p>no frames</p>",
        "<h2>GPU memory</h2>",
        _img(images["memory"], "memory timeline"),
        "<h2>Per-step time</h2>",
        _img(images["steps"], "per-step time"),
        "<h2>Per-frame fidelity</h2>",
        _img(images["frames"], "per-frame fidelity"),
        "<h2>report.json</h2>",
        f"<pre>{html.escape(json.dumps(report, indent=1))}</pre>",
        "</body></html>",
    ]
    return "\n".join(parts)
