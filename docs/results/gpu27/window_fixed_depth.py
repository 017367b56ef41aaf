#!/usr/bin/env python
"""One ``specctl-eval`` window run at a fixed depth (0 and 3 by default): throughput, where
the time went (prefill, off and speculative decode records), the decode batch size and
step latency, and the true accepted drafts at depth 3 of the running requests every 100
decisions (``Simulator.true_accepted``, what the hindsight oracle reads; after a due
warm-up, the drafting step after it).

    PYTHONPATH=$PWD:$PWD/scripts python docs/results/gpu27/window_fixed_depth.py 9 \\
        "fixed C=64 h200_llama31_8b prior=exact" [--depths 0 3]
"""

from __future__ import annotations

import numpy as np
from trace_window import open_window, window_parser


def run_at(parser, args, depth: int) -> str:
    """The window's summary line with every decision ``depth``."""
    window = open_window(parser, args)
    sim, loop = window.sim, window.loop
    obs = loop.reset(window.scenario.seed)
    time_by = {"prefill": 0.0, "off": 0.0, "spec": 0.0}
    batches, latencies, accepted = [], [], []
    step = 0
    while obs is not None:
        for r in obs.new_records:
            kind = "prefill" if r.prefill_tokens else ("spec" if r.steps_used else "off")
            time_by[kind] += r.step_latency_s
            if kind != "prefill":
                batches.append(r.batch_size)
                latencies.append(r.step_latency_s)
        if step % 100 == 50 and sim.batch_size:
            accepted.append(float(np.mean(sim.true_accepted(3, after_warmup=sim.warmup_due))))
        obs, _ = loop.step(depth)
        step += 1
    spent = ", ".join(f"{k} {v:.2f} s" for k, v in time_by.items())
    return (f"depth {depth}: {loop.throughput_tok_s:.1f} tok/s; {spent}; decode batch mean "
            f"{np.mean(batches):.1f}, step p50 {1e3 * np.median(latencies):.2f} ms; true "
            f"accepted drafts at depth 3 {np.mean(accepted):.2f}")


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments and print one line per depth."""
    parser = window_parser(__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[0, 3])
    args = parser.parse_args(argv)
    for depth in args.depths:
        print(run_at(parser, args, depth), flush=True)


if __name__ == "__main__":
    main()
