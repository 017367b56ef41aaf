"""Depth switches on the CPU: how many, how fast, and what they leave behind.

Not a test: run it, read the table, keep the JSON.

    python benchmarks/bench_switching.py --steps 20000 --out runs/bench_switching.json

A controller decision whose depth alternates with the batch size (3 at batch 1,
6 at batch 2) while the batch size alternates every step: the harshest case.
The stand-in scheduler of :mod:`sglang_hooks.testing` runs it with SGLang's real
``AdaptiveController`` and, with SGLang 0.5.23, its real process
``RuntimeContext``, whose overrides log the stand-in worker appends to on every
switch as ``EAGLEWorkerV2.apply_runtime_state`` does. For each dwell
(``SPECCTL_MIN_SWITCH_STEPS``) it reports switches per step and per second of
loop time, the overrides log's length with and without the plugin's trimming,
and the Python heap growth (tracemalloc) over the run (the stand-in's own
records are cleared every 1,000 steps).

What only the GPU can show: the time of a real switch (attention backends and
CUDA graph runners swapped, ``_rebuild_topk1_chain_buffers`` allocating two
``max_bs x steps`` tensors and launching their kernels) and GPU memory churn.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def run(steps: int, min_switch_steps: int, trim: bool) -> dict:
    from sglang.srt.runtime_context import get_context
    from sglang.srt.speculative import adaptive_runtime_state as ars
    from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams

    from sglang_hooks import adaptive_config_path
    from sglang_hooks.compat import Ranks, installed_version
    from sglang_hooks.config import PluginConfig
    from sglang_hooks.marker import DecisionMarker
    from sglang_hooks.policy import make_policy_class
    from sglang_hooks.runtime import Runtime
    from sglang_hooks.testing import (
        DECODE,
        BatchStandIn,
        RankLoop,
        ReqStandIn,
        WorkerStandIn,
        hooked_classes,
    )

    context = get_context()
    log = getattr(context, "_overrides_log", None)
    if log is not None:
        log.clear()
    rt = Runtime(PluginConfig(server="bench", min_switch_steps=min_switch_steps),
                 installed_version(), ranks=Ranks(1, 2, 0, 1, 0, False))
    worker = WorkerStandIn(7, ars.SpecRuntimeState, log)
    params = make_policy_class(AdaptiveSpeculativeParams, rt)(7, str(adaptive_config_path()))
    if "policy" in inspect.signature(ars.AdaptiveController.__init__).parameters:
        adaptive = ars.AdaptiveController(worker, params)
    else:  # 0.5.15.post1 builds its own params: use ours instead
        adaptive = ars.AdaptiveController(worker, str(adaptive_config_path()))
        adaptive.params = params
    adaptive.init_states(None)
    scheduler, receiver = hooked_classes(rt)
    loop = RankLoop(scheduler(adaptive, worker, lambda s, d, b: [min(d, 2)] * b),
                    receiver(False))
    rt.attach(loop.scheduler)
    if not trim:
        rt.trimmer = None
    reqs = [ReqStandIn("a"), ReqStandIn("b")]
    marker = DecisionMarker(1, "controller", 1, (1, 2), (3, 6))
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    started = time.perf_counter()
    for i in range(steps):
        loop.iterate([marker] if i == 0 else [], BatchStandIn(reqs[: 1 + i % 2], DECODE))
        if i % 1000 == 999:  # the stand-in's own records: not what is measured
            loop.scheduler.launched.clear()
            for req in reqs:
                req.output_ids.clear()
    loop.drain()
    elapsed = time.perf_counter() - started
    growth = sum(stat.size_diff for stat in
                 tracemalloc.take_snapshot().compare_to(before, "filename"))
    tracemalloc.stop()
    return {
        "min_switch_steps": min_switch_steps, "trim": trim, "steps": steps,
        "switches": worker.switches, "switches_per_step": worker.switches / steps,
        "switches_per_s": worker.switches / elapsed, "loop_us_per_step": 1e6 * elapsed / steps,
        "overrides_log_entries": None if log is None else len(log),
        "heap_growth_kib": growth / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sglang", default=str(REPO / ".sglang" / "0.5.23"))
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from sglang_hooks.testing import write_import_stand_ins

    stand_ins = Path(tempfile.mkdtemp(prefix="specctl-bench-"))
    write_import_stand_ins(stand_ins)
    sys.path[1:1] = [args.sglang, str(stand_ins)]
    results = [run(args.steps, dwell, trim)
               for dwell, trim in ((1, False), (1, True), (4, True), (8, True))]
    print(f"{'dwell':>5} {'trim':>5} {'switches/step':>13} {'switches/s':>10} "
          f"{'us/step':>8} {'log entries':>11} {'heap KiB':>9}")
    for r in results:
        print(f"{r['min_switch_steps']:>5} {r['trim']!s:>5} {r['switches_per_step']:>13.3f} "
              f"{r['switches_per_s']:>10.0f} {r['loop_us_per_step']:>8.1f} "
              f"{r['overrides_log_entries']!s:>11} {r['heap_growth_kib']:>9.1f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
