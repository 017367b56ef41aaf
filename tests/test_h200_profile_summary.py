"""scripts/h200/profile_summary.py on a hand-made Chrome trace: busy time, gaps, categories."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts/h200"))

import profile_summary


def kernel(ts: float, dur: float, name: str, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "ts": ts, "dur": dur, "name": name}


def test_busy_time_counts_overlaps_once_and_idle_gaps_over_50_us(tmp_path):
    events = [
        kernel(0, 100, "nvjet_tst_128x64_gemm"),
        kernel(50, 100, "_fwd_kernel_stage1"),          # overlaps the GEMM by 50 us
        kernel(180, 20, "Memcpy DtoD", cat="gpu_memcpy"),  # 30 us gap: not idle
        kernel(300, 50, "fused_moe_kernel"),             # 100 us gap: idle
        {"ph": "X", "cat": "cuda_runtime", "ts": 0, "dur": 5, "name": "cudaGraphLaunch"},
        {"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 500, "name": "aten::mm"},
    ]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as handle:
        json.dump({"traceEvents": events}, handle)

    summary = profile_summary.summarise(path)

    assert summary["window_ms"] == 0.35
    assert summary["gpu_busy_ms"] == 0.22  # 150 + 20 + 50 us
    assert summary["idle_gaps_over_50us"] == 1 and summary["idle_in_gaps_ms"] == 0.1
    assert summary["graph_launches"] == 1 and summary["kernels"] == 3
    assert summary["category_ms"] == {"gemm": 0.1, "attention": 0.1, "moe": 0.05, "copy": 0.02}


def test_a_trace_without_gpu_events_says_so(tmp_path):
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"traceEvents": [kernel(0, 5, "aten::add", cat="cpu_op")]}))
    assert profile_summary.summarise(path)["error"] == "no GPU events"
