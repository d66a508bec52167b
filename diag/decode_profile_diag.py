"""Diagnostic (GPU): why the unplanned and all-resident profiling decodes of the tiny VAE measure 108 KiB apart.
Replicates tests/test_profile_inline.py's decode test; after every handle it lists device blocks that appeared
since the start, with the Python frames that allocated them."""
import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
import flextensor_diffusers as ft  # noqa: E402
from flextensor_diffusers.engine import phases  # noqa: E402
from flextensor_diffusers.engine.planner import allocated  # noqa: E402
from flextensor_diffusers.engine.phases import PROFILE_RESIDENT_SHARE  # noqa: E402
from flextensor_diffusers.pipelines.patterns import autoencoder_patterns  # noqa: E402
from flextensor_diffusers.recipes.models import build_pipeline  # noqa: E402

torch.cuda.memory._record_memory_history(max_entries=200000)


def live_blocks():
    snap = torch.cuda.memory._snapshot()
    blocks = {}
    for seg in snap["segments"]:
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                frames = [f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}" for f in b.get("frames", [])
                          if "torch/" not in f["filename"]][:8]
                blocks[b["address"]] = (b["size"], frames)
    return blocks


def peak_composition(at_start, events):
    """Replay the allocator's events of one decode: the blocks alive at its peak that were not alive at its start."""
    alive = {a: s for a, (s, _) in at_start.items()}
    frames_of = {}
    total, best, best_set = sum(alive.values()), 0, {}
    base_total = total
    for e in events:
        if e["action"] == "alloc":
            alive[e["addr"]] = e["size"]
            frames_of[e["addr"]] = [f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}" for f in e.get("frames", [])
                                    if "torch/" not in f["filename"]][:6]
            total += e["size"]
            if total > best:
                best, best_set = total, {a: (alive[a], frames_of.get(a)) for a in alive if a not in at_start}
        elif e["action"] == "free_requested" and e["addr"] in alive:
            total -= alive.pop(e["addr"])
    return dict(start_total=base_total, peak_total=best, peak_minus_start=best - base_total,
                blocks=sorted(best_set.values(), key=lambda x: -x[0])[:40])


report = []
for keep in (True, False):
    vae = build_pipeline("wan22_t2v", "tiny").vae.to("cuda")
    latents = torch.randn(1, vae.config.z_dim, 3, 4, 4, generator=torch.Generator().manual_seed(0)).to("cuda")
    with torch.inference_mode():
        reference = vae.decode(latents).sample
    vae.to("cpu")
    torch.cuda.synchronize()
    start = live_blocks()
    orig_keeps = phases.Unplanned.keeps
    for layout in ("warm-up", "unplanned", "all resident", "unplanned again", "all resident again"):
        h = ft.offload(vae, include_patterns=autoencoder_patterns(vae), entry_methods=["decode"], gpu_budget=2**30,
                       device="cuda", active_after_setup=False)
        dec = [u.index for u in h.units if u.name.startswith("decoder.")]
        slot = max(u.nbytes for u in h.units)
        held = h.resident_weight_bytes + slot + sum(allocated(h.units[i].nbytes, 512) for i in dec)
        h.set_budget(int(held / PROFILE_RESIDENT_SHARE) + 512)
        if not keep:
            phases.Unplanned.keeps = lambda self, index, in_workload: False
        if layout.startswith("all resident"):
            h.set_budget(2**30)
        before = torch.cuda.memory_allocated()
        with torch.inference_mode():
            out = vae.decode(latents).sample
            ok1 = torch.equal(out, reference)
            del out
            h.release()
            mid = torch.cuda.memory_allocated()
            torch.cuda.synchronize()
            at_start = live_blocks()
            n0 = len(torch.cuda.memory._snapshot()["device_traces"][0])
            out = vae.decode(latents).sample
            torch.cuda.synchronize()
            peak_new = peak_composition(at_start, torch.cuda.memory._snapshot()["device_traces"][0][n0:])
            ok2 = torch.equal(out, reference)
            del out
        after_decode = torch.cuda.memory_allocated()
        prof = h.profile.activation_peak_bytes
        h.remove()
        phases.Unplanned.keeps = orig_keeps
        del h
        torch.cuda.synchronize()
        after_remove = torch.cuda.memory_allocated()
        now = live_blocks()
        new = [(size, frames) for addr, (size, frames) in now.items() if addr not in start]
        row = dict(keep=keep, layout=layout, activation=prof, before=before, mid=mid, after_decode=after_decode,
                   after_remove=after_remove, peak=peak_new, bitwise=ok1 and ok2, new_blocks=new[:20], n_new=len(new),
                   new_bytes=sum(s for s, _ in new))
        print(json.dumps({k: v for k, v in row.items() if k not in ("new_blocks", "peak")}), flush=True)
        print("  peak", peak_new["start_total"], peak_new["peak_total"], peak_new["peak_minus_start"], flush=True)
        for size, frames in peak_new["blocks"][:25]:
            print("     @peak", size, frames, flush=True)
        for size, frames in new[:12]:
            print("   ", size, frames, flush=True)
        report.append(row)
    del vae, latents, reference
json.dump(report, open(os.path.join(os.environ.get("OUT", "."), "decode_profile_diag.json"), "w"), indent=1)
