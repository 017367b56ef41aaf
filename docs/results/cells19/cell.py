#!/usr/bin/env python
"""One ``specctl-eval`` cell's windows, re-run with a per-step trace of chosen depths.

    PYTHONPATH=$PWD python docs/results/cells19/cell.py SEED FAMILY WORKLOAD MODE \
        [POLICY ...] [--ppo PATH] [--guard KEY=VALUE ...] [--probe KEY=VALUE ...]

Builds the scenarios exactly as ``specctl-eval seed=SEED`` does (the eval config's
families, random servers, workloads, handed-profile modes), runs the named policies (the
evaluation's by default) on the cell's windows and prints, per window, each policy's
throughput over the hindsight reference (best of oracle, no_spec, static_* among those
run; none run: the best run) and its
depths, then for ``ppo`` (and the guard / probe variant) the run of decisions as
``depth x steps`` segments with the batch size and time where each segment began.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from hydra import compose, initialize_config_module

from agents.evaluate import _eval_env, _scenarios
from agents.policies import make_policy
from controller.default_policy import default_policy_path
from controller.policy_file import ExportedPolicy
from env.features import FeatureSpec
from env.rollout import DecisionLoop, rollout
from env.sim.simulator import Simulator


def _parse(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        out[key] = json.loads(value)
    return out


def run(env: dict, scenario, name: str, policy_path: str | None, guard=None,
        probe=None) -> tuple[dict, list[tuple[int, int, float, float]]]:
    """One policy on one scenario: its result and, per decision, the batch size, the
    depth, the simulated time and the tokens served so far."""
    sim = Simulator(scenario.profile, scenario.acceptance, scenario.workload, scenario.config,
                    seed=scenario.seed)
    profile = scenario.profile if name == "oracle" else scenario.prior
    policy = make_policy(name, profile=profile, max_depth=int(env["max_depth"]),
                         policy_path=policy_path, sim_config=scenario.config,
                         guard=guard, probe=probe)
    trace: list[tuple[int, int, float, float]] = []
    act = policy.act
    box: list[DecisionLoop] = []

    def traced(obs):
        depth = act(obs)
        trace.append((sim.batch_size, depth, sim.time_s, box[0].tokens))
        return depth

    policy.act = traced
    loop = DecisionLoop(sim, policy.feature_spec(FeatureSpec(max_depth=int(env["max_depth"]))),
                        feedback_lag=int(env["feedback_lag"]), horizon_s=scenario.horizon_s,
                        slo_tpot_s=None, cost_prior=scenario.prior)
    box.append(loop)
    return rollout(loop, policy, seed=scenario.seed).as_dict(), trace


def segments(trace: list[tuple[int, int, float, float]]) -> str:
    """``depth x steps @batch/time/tokens`` runs of a trace (simulated seconds, tokens
    served before the run began)."""
    out, start = [], 0
    for i in range(1, len(trace) + 1):
        if i == len(trace) or trace[i][1] != trace[start][1]:
            batch, depth, time_s, tokens = trace[start]
            out.append(f"{depth}x{i - start}@{batch}/{time_s:.1f}/{tokens:.0f}")
            start = i
    return " ".join(out)


def main() -> None:
    """Parse the command line and print the cell."""
    parser = argparse.ArgumentParser()
    parser.add_argument("seed", type=int)
    parser.add_argument("family")
    parser.add_argument("workload")
    parser.add_argument("mode")
    parser.add_argument("policies", nargs="*")
    parser.add_argument("--ppo", default=None)
    parser.add_argument("--guard", nargs="*", default=[])
    parser.add_argument("--probe", nargs="*", default=[])
    args = parser.parse_args()
    with initialize_config_module(config_module="configs", version_base=None):
        cfg = compose("eval", overrides=[f"seed={args.seed}"])
    env = _eval_env(cfg)
    ev = cfg.eval
    names = args.policies or list(ev.policies)
    scenarios = _scenarios(json.dumps(env, sort_keys=True), int(ev.windows), args.seed,
                           tuple(ev.prior_modes), int(ev.random_servers))
    path = args.ppo or str(default_policy_path())
    exported = ExportedPolicy.load(path)
    variant = None
    if args.guard or args.probe:
        variant = (dataclasses.replace(exported.guard, **_parse(args.guard)),
                   dataclasses.replace(exported.probe, **_parse(args.probe)))
    for scenario in scenarios:
        if (scenario.family, scenario.workload_name, scenario.prior_mode) != (
                args.family, args.workload, args.mode):
            continue
        results, traces = {}, {}
        for name in names:
            results[name], traces[name] = run(env, scenario, name, path)
        if variant is not None:
            results["ppo*"], traces["ppo*"] = run(env, scenario, "ppo", path, *variant)
        ref = max((r["throughput_tok_s"] for n, r in results.items()
                   if n == "oracle" or n.startswith(("no_spec", "static_"))), default=0.0) \
            or max(r["throughput_tok_s"] for r in results.values()) or 1.0
        print(f"## {scenario.label}: reference {ref:.1f} tok/s, "
              f"{results[names[0]]['decisions']} decisions")
        for name, r in results.items():
            print(f"  {name:16s} {r['throughput_tok_s'] / ref:.3f} steps {r['steps_chosen']} "
                  f"warmups {r.get('warmups', 0)}")
        for name in traces:
            if name in traces:
                print(f"  {name} trace: {segments(traces[name])}")


if __name__ == "__main__":
    main()
