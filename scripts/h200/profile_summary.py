"""Summarise a torch-profiler trace of an SGLang server: where the GPU time of a step goes.

SGLang's ``/start_profile`` writes one Chrome trace per rank (``*.trace.json.gz``). This
reads one and reports, for the profiled window:

* the window's wall time, the GPU's busy time (the union of kernel and copy intervals)
  and its idle gaps longer than 50 us (a GPU waiting on the CPU shows up there);
* the number of CUDA graph launches (one per target forward; the draft adds its own);
* kernel time per category (attention, GEMM, MoE, norm, rotary, sampling, copies, other)
  and the 20 kernels with the most time.

Usage: ``python scripts/h200/profile_summary.py TRACE.json.gz [TRACE ...]`` prints JSON.
"""

from __future__ import annotations

import gzip
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

#: Kernel-name fragments per category, first match wins (names lower-cased).
CATEGORIES = (
    ("moe", ("moe", "expert", "align_block_size", "topk_softmax", "grouped_topk", "router")),
    ("norm", ("norm",)),  # before attention: flashinfer's norm kernels say "flash"
    # triton backend: _fwd_kernel (extend/verify), _fwd_grouped_kernel_stage1 and
    # _fwd_kernel_stage2 (decode)
    ("attention", ("attn", "attention", "_fwd_kernel", "_fwd_grouped_kernel", "flash",
                   "extend")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "matmul", "splitk")),
    ("rotary", ("rotary", "rope")),
    ("sampling", ("sample", "argmax", "softmax", "topk", "top_k", "verify", "accept")),
    ("activation", ("silu", "gelu", "act_and_mul")),
)
IDLE_GAP_US = 50.0


def category(name: str) -> str:
    lowered = name.lower()
    for label, fragments in CATEGORIES:
        if any(fragment in lowered for fragment in fragments):
            return label
    return "other"


def summarise(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        events = json.load(handle)["traceEvents"]
    gpu = [e for e in events if e.get("ph") == "X"
           and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    launches = sum(1 for e in events if e.get("ph") == "X"
                   and e.get("name") in ("cudaGraphLaunch", "cuGraphLaunch"))
    if not gpu:
        return {"trace": path.name, "error": "no GPU events"}
    gpu.sort(key=lambda e: e["ts"])
    start = gpu[0]["ts"]
    end = max(e["ts"] + e["dur"] for e in gpu)
    busy, idle, gaps = 0.0, 0.0, 0
    cursor = start
    for event in gpu:
        if event["ts"] > cursor:
            gap = event["ts"] - cursor
            if gap > IDLE_GAP_US:
                idle += gap
                gaps += 1
        busy += max(0.0, event["ts"] + event["dur"] - max(cursor, event["ts"]))
        cursor = max(cursor, event["ts"] + event["dur"])
    per_category: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, float] = defaultdict(float)
    counts: Counter[str] = Counter()
    for event in gpu:
        label = "copy" if event["cat"] != "kernel" else category(event["name"])
        per_category[label] += event["dur"]
        per_kernel[event["name"][:90]] += event["dur"]
        counts[event["name"][:90]] += 1
    wall = end - start
    return {
        "trace": path.name,
        "window_ms": round(wall / 1e3, 3),
        "gpu_busy_ms": round(busy / 1e3, 3),
        "gpu_busy_fraction": round(busy / wall, 4) if wall else None,
        "idle_gaps_over_50us": gaps,
        "idle_in_gaps_ms": round(idle / 1e3, 3),
        "graph_launches": launches,
        "kernels": sum(1 for e in gpu if e["cat"] == "kernel"),
        "category_ms": {k: round(v / 1e3, 3) for k, v in
                        sorted(per_category.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": name, "ms": round(ms / 1e3, 3), "count": counts[name]}
                        for name, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:20]],
    }


if __name__ == "__main__":
    print(json.dumps([summarise(Path(p)) for p in sys.argv[1:]], indent=2))
