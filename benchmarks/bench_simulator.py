"""Speed of the simulator (the RL inner loop) and of the feature module.

    python benchmarks/bench_simulator.py [--steps 200000] [--json out.json]

Measures, on one core (run it alone on the machine for stable numbers):

* decode steps/s at batch 64 with static depth 3 and no per-step policy work:
  long outputs (steady batch, no completions) and short ones (prefills and
  completions every few steps, closed loop);
* decisions/s of the full decision loop (simulator + lagged features +
  observation) with a static policy;
* gymnasium ``step`` calls per second with random actions;
* the feature module's update and observation times.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from env.features import FeatureBuilder
from env.rollout import DecisionLoop
from env.sim.acceptance import SGLangSimulatedAcceptance
from env.sim.cost_model import load_profile
from env.sim.simulator import Simulator
from env.spec_env import SpecDecodeEnv
from env.traces.workloads import ClosedLoop


def decode_steps_per_s(output_tokens: int, steps: int) -> float:
    """Decode steps per second at batch 64, depth 3 (prefill steps run but are not counted)."""
    profile = load_profile("h200_llama31_8b")
    sim = Simulator(profile, SGLangSimulatedAcceptance(3.5), ClosedLoop(64, 256, output_tokens))
    sim.advance()
    for _ in range(1000):  # reach steady state
        sim.decode(3)
        sim.advance()
    start = time.perf_counter()
    for _ in range(steps):
        sim.decode(3)
        sim.advance()
    return steps / (time.perf_counter() - start)


def decision_loop_per_s(steps: int) -> float:
    """Decisions per second through DecisionLoop (features + observation every step)."""
    profile = load_profile("h200_llama31_8b")
    sim = Simulator(profile, SGLangSimulatedAcceptance(3.5), ClosedLoop(64, 256, 4096))
    loop = DecisionLoop(sim)
    loop.reset()
    start = time.perf_counter()
    for _ in range(steps):
        loop.step(3)
    return steps / (time.perf_counter() - start)


def env_steps_per_s(steps: int) -> float:
    """``SpecDecodeEnv.step`` calls per second with random actions (resets included)."""
    env = SpecDecodeEnv()
    env.reset(seed=0)
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    for _ in range(steps):
        _, _, terminated, truncated, _ = env.step(int(rng.integers(0, 8)))
        if terminated or truncated:
            env.reset()
    return steps / (time.perf_counter() - start)


def feature_times_us(n: int) -> dict[str, float]:
    """Microseconds per FeatureBuilder.update, .observation and .observation_grid."""
    rng = np.random.default_rng(0)
    builder = FeatureBuilder()
    profile = load_profile("h200_llama31_8b")
    from env.traces.schema import StepRecord

    records = [
        StepRecord("b", 0, i, i * 0.01, 64, 10, 64, 64 * 1000, 700_000, 0, 3,
                   np.minimum(rng.geometric(0.3, 64) - 1, 3).astype(np.int8),
                   profile.step_latency_s(64, 3, 64_000, 0))
        for i in range(n)
    ]
    start = time.perf_counter()
    for r in records:
        builder.update(r)
    update = (time.perf_counter() - start) / n
    start = time.perf_counter()
    for _ in range(n):
        builder.observation(64)
    observe = (time.perf_counter() - start) / n
    start = time.perf_counter()
    for _ in range(n // 4):
        builder.observation_grid()
    grid = (time.perf_counter() - start) / (n // 4)
    return {"update_us": update * 1e6, "observation_us": observe * 1e6,
            "observation_grid_us": grid * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200_000)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core
    results = {
        "decode_steps_per_s_batch64_long_outputs": decode_steps_per_s(100_000, args.steps),
        "decode_steps_per_s_batch64_outputs_256": decode_steps_per_s(256, args.steps // 2),
        "decision_loop_per_s_batch64": decision_loop_per_s(args.steps // 10),
        "env_steps_per_s_random_actions": env_steps_per_s(args.steps // 10),
        **feature_times_us(20_000),
    }
    for key, value in results.items():
        print(f"{key:45s} {value:12,.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
