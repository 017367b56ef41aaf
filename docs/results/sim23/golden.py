"""Golden check for task 1: a digest of every record of seeded episodes, run on two trees.

    PYTHONPATH=TREE python docs/results/sim23/golden.py

Prints one sha256 per episode (dense and MoE H200 profiles, booking on; open loop at
finish lag 0 and 1, a closed loop; random depths from a seeded generator) over every
field of every record, the clock and the finish times. Identical lines on two trees mean
the episodes are bit-identical.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys

import numpy as np

from env.sim.acceptance import SGLangSimulatedAcceptance
from env.sim.cost_model import load_profile
from env.sim.simulator import SchedulerConfig, Simulator
from env.traces.workloads import ClosedLoop, shipped_workload


def episode_digest(profile_name: str, workload, lag: int, seed: int, steps: int) -> str:
    """sha256 over every record of one seeded episode at random depths."""
    profile = load_profile(profile_name)
    config = dataclasses.replace(SchedulerConfig.from_profile(profile), finish_lag_steps=lag)
    sim = Simulator(profile, SGLangSimulatedAcceptance(3.0), workload, config, seed=seed)
    rng = np.random.default_rng(seed)
    h = hashlib.sha256()

    def add(records) -> None:
        for r in records:
            for f in dataclasses.fields(r):
                v = getattr(r, f.name)
                h.update(repr((f.name, v.tolist() if isinstance(v, np.ndarray) else v)).encode())

    add(sim.advance())
    for _ in range(steps):
        if sim.done or not sim.batch_size:
            break
        add([sim.decode(int(rng.integers(0, 4)))])
        add(sim.advance())
    h.update(repr((sim.time_s, sim.step_index, sim.output_tokens_total)).encode())
    h.update(np.asarray(sim.requests.finish[:sim.requests.size]).tobytes())
    return h.hexdigest()


def main() -> None:
    azure = shipped_workload("azure_conv").window(0.0, 120.0)
    loads = (("azure_conv_x1", azure), ("azure_conv_x3", azure.scaled(3.0)),
             ("closed48", ClosedLoop(48, 1024, 256)))
    for profile in ("h200_llama31_8b", "h200_qwen3_30b_a3b", "h100_llama31_8b"):
        for name, wl in loads:
            for lag in (0, 1):
                for seed in (0, 1):
                    d = episode_digest(profile, wl, lag, seed, 20_000)
                    print(profile, name, f"lag{lag}", f"seed{seed}", d)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
