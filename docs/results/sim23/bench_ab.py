"""Task 1's speed check, paired: ``benchmarks/bench_simulator.py``'s decode loops on two
simulator modules in one process, in alternating short blocks.

    PYTHONPATH=$PWD:$PWD/benchmarks python docs/results/sim23/bench_ab.py BEFORE.py [BLOCKS]

BEFORE.py: the ``env/sim/simulator.py`` of the revision to compare with (e.g. ``git show
main:env/sim/simulator.py > /tmp/simulator_main.py``); the rest of the package is this
tree's. Under a shared, loaded machine separate runs of the bench differ by 2x from one
minute to the next; paired blocks a few seconds apart share the load, so the median of the
per-pair ratios is what this reports (with the medians of each, the best block of each:
the least disturbed, and the load average).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import bench_simulator as bench
import numpy as np

from env.sim import simulator as current


def load_module(path: str):
    """``path`` as a module of its own (its imports resolve to this tree's package)."""
    spec = importlib.util.spec_from_file_location("simulator_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    before = load_module(sys.argv[1])
    blocks = int(sys.argv[2]) if len(sys.argv) > 2 else 15
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    cases = {"decode steps/s, long outputs": lambda: bench.decode_steps_per_s(100_000, 10_000),
             "decode steps/s, outputs 256": lambda: bench.decode_steps_per_s(256, 10_000)}
    loads = []
    for label, case in cases.items():
        rates = {"before": [], "after": []}
        for k in range(blocks):
            order = (("before", before), ("after", current))
            for name, module in (order if k % 2 == 0 else order[::-1]):
                bench.Simulator = module.Simulator
                rates[name].append(case())
            loads.append(os.getloadavg()[0])
        b, a = np.array(rates["before"]), np.array(rates["after"])
        print(f"{label}: before median {np.median(b):,.0f}, after {np.median(a):,.0f}; "
              f"after/before per pair: median {np.median(a / b):.3f} "
              f"(p25 {np.percentile(a / b, 25):.3f}, p75 {np.percentile(a / b, 75):.3f}; "
              f"{blocks} pairs); best block: before {b.max():,.0f}, after {a.max():,.0f} "
              f"({a.max() / b.max():.3f})")
    print(f"load average during the runs: {min(loads):.1f}-{max(loads):.1f} "
          f"(median {np.median(loads):.1f}) on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
