#!/usr/bin/env python
"""One ``specctl-eval`` cell re-run with ``ppo`` for each policy file given, tracing per
decision the batch size, the depth chosen and the features' predicted step latency of off
and depths 1-3 against the server's true one (the scenario's profile at that batch and
KV), summarised per stretch of decisions. As ``docs/results/cells19/cell.py``.

    PYTHONPATH=$PWD python docs/results/local26/cell_trace.py SEED FAMILY WORKLOAD MODE \
        LABEL_SUBSTRING POLICY.npz [POLICY.npz ...]
"""

from __future__ import annotations

import json
import sys

import numpy as np
from hydra import compose, initialize_config_module

from agents.evaluate import _eval_env, _scenarios
from agents.policies import make_policy
from env.features import FeatureSpec
from env.rollout import DecisionLoop, rollout
from env.sim.simulator import Simulator

DEPTHS = (0, 1, 2, 3)


def run(env: dict, scenario, path: str):
    sim = Simulator(scenario.profile, scenario.acceptance, scenario.workload, scenario.config,
                    seed=scenario.seed)
    policy = make_policy("ppo", profile=scenario.prior, max_depth=int(env["max_depth"]),
                         policy_path=path, sim_config=scenario.config)
    loop = DecisionLoop(sim, policy.feature_spec(FeatureSpec(max_depth=int(env["max_depth"]))),
                        feedback_lag=int(env["feedback_lag"]), horizon_s=scenario.horizon_s,
                        slo_tpot_s=None, cost_prior=scenario.prior)
    trace = []
    act = policy.act

    def traced(obs):
        depth = act(obs)
        batch = max(sim.batch_size, 1)
        pred = loop.features.latency_predictions_s(batch)[list(DEPTHS)]
        kv = loop.features._kv_used_tokens
        true = [scenario.profile.step_latency_s(batch, d, kv, 0, draft_extend=d > 0,
                                                speculative_path=d > 0) for d in DEPTHS]
        trace.append((batch, depth, sim.time_s, *pred, *true))
        return depth

    policy.act = traced
    result = rollout(loop, policy, seed=scenario.seed).as_dict()
    return result, np.array(trace)


def main() -> None:
    seed, family, workload, mode, label = sys.argv[1:6]
    with initialize_config_module(config_module="configs", version_base=None):
        cfg = compose("eval", overrides=[f"seed={seed}"])
    env = _eval_env(cfg)
    ev = cfg.eval
    scenarios = _scenarios(json.dumps(env, sort_keys=True), int(ev.windows), int(seed),
                           tuple(ev.prior_modes), int(ev.random_servers))
    for scenario in scenarios:
        if (scenario.family, scenario.workload_name, scenario.prior_mode) != (
                family, workload, mode) or label not in scenario.label:
            continue
        print(f"## {scenario.label}")
        for path in sys.argv[6:]:
            result, t = run(env, scenario, path)
            print(f"  {path.rsplit('/', 1)[-1]}: {result['throughput_tok_s']:.1f} tok/s, "
                  f"steps {result['steps_chosen']}")
            n = len(t)
            for lo in range(0, n, max(n // 12, 1)):
                s = t[lo:lo + max(n // 12, 1)]
                pred = np.median(s[:, 3:3 + len(DEPTHS)], axis=0) * 1e3
                true = np.median(s[:, 3 + len(DEPTHS):], axis=0) * 1e3
                share = [float(np.mean(s[:, 1] == d)) for d in DEPTHS]
                print(f"    t {s[0, 2]:6.1f}s batch {np.median(s[:, 0]):5.0f} "
                      f"depth shares {np.round(share, 2).tolist()} "
                      f"pred {np.round(pred, 1).tolist()} true {np.round(true, 1).tolist()}")


if __name__ == "__main__":
    main()
