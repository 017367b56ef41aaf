"""The H200 MoE @ 2.5's measured step costs per batch size, pooled over runs 46-50's
plugin servings (every policy, both rates), the re-entry warm-ups left out: median
latency of off, depth 1 and depth 3 steps at each batch size, and depth 3's goodput
against off's, ``(1 + mean accepted drafts at depth 3) * off / depth 3``.

    PYTHONPATH=$PWD:docs/results/drop_warmup python docs/results/drop_warmup/per_batch_costs.py \
        > docs/results/drop_warmup/per_batch_costs.txt

Per step only: what a choice does to the queue is not in it.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
from servings import OFFSWITCH

from env.traces.trace_format import read_packed_trace

RUNS = (46, 48, 49, 50)
BATCHES = (1, 2, 3, 4, 6, 8, 10, 12, 14, 16, 18, 20, 24, 28, 32, 40, 48)


def cell(values: list[float]) -> str:
    """A table cell: the median and the count, or "-"."""
    return f"{np.median(values):.1f} ({len(values)})" if values else "-"


def main() -> None:
    latency: dict[tuple[int, int], list[float]] = defaultdict(list)
    accepted: list[int] = []
    for run in RUNS:
        trace = read_packed_trace(OFFSWITCH / f"moe_acc2.5_trace_r8r6_run{run}.tar.gz")
        decode = [r for r in trace.steps if r.is_decode and r.step_latency_s > 0]
        for k, record in enumerate(decode):
            following = decode[k + 1] if k + 1 < len(decode) else None
            if record.steps_used == 0 and following is not None and following.steps_used > 0:
                continue  # the re-entry warm-up
            latency[(record.steps_used, record.batch_size)].append(1e3 * record.step_latency_s)
            if record.steps_used == 3:
                accepted.extend(record.accepted_drafts.tolist())
    mean = float(np.mean(accepted))
    print(f"mean accepted drafts at depth 3: {mean:.3f} ({len(accepted)} request-steps)")
    print("| batch | off ms (steps) | depth 1 ms (steps) | depth 3 ms (steps) "
          "| depth 3 / off goodput |")
    print("|---|---|---|---|---|")
    for batch in BATCHES:
        off, one, three = (latency[(d, batch)] for d in (0, 1, 3))
        if len(off) < 5 or len(three) < 5:
            continue
        ratio = (1 + mean) * np.median(off) / np.median(three)
        print(f"| {batch} | {cell(off)} | {cell(one)} | {cell(three)} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
