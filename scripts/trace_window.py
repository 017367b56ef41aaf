#!/usr/bin/env python
"""One ``specctl-eval`` window, step by step: ``python scripts/trace_window.py SEED LABEL``.

Reruns the evaluation's scenario whose label starts with ``LABEL`` (e.g. ``"fixed C=64
random-0 prior=swapped"``) at evaluation seed ``SEED`` with the ``ppo`` adapter (its
guard and probes, as ``specctl-eval`` runs it), and prints per decision: the batch size,
the depth run, the observation's predicted latency of off and of that depth (depth 1 for
an off step) against the simulator's true cost (ms), off's and that depth's cost
confidence, the stream's profile error (unclipped), the depth's relative goodput (log,
over off) and ``P1`` / ``P2`` while the acceptance / off probe is due; then the window's
throughput and steps per depth. The fourteenth session's traces (``docs/POLICY.md``) were
made with it.

    PYTHONPATH=$PWD python scripts/trace_window.py 3 "fixed C=64 random-0 prior=swapped" \\
        --policy docs/results/off_probe/policy_3dd256a8.npz --every 10
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from hydra import compose, initialize_config_dir

from agents.evaluate import _eval_env, _scenarios
from agents.policies import make_policy
from env.features import FeatureSpec
from env.rollout import DecisionLoop
from env.sim.simulator import Simulator

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@dataclass
class Window:
    """One evaluation window, ready to run: its scenario, simulator, the ``ppo`` adapter and
    the decision loop over them (``spec``: the adapter's feature spec)."""

    scenario: object
    sim: Simulator
    policy: object
    spec: FeatureSpec
    loop: DecisionLoop
    max_depth: int


def window_parser(description: str) -> argparse.ArgumentParser:
    """The arguments every window trace takes: seed, label, --policy, --every, overrides."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("seed", type=int, help="the evaluation seed (specctl-eval seed=N)")
    parser.add_argument("label", help="the start of the scenario's label")
    parser.add_argument("--policy", default="controller/data/default_policy.npz")
    parser.add_argument("--every", type=int, default=1, help="print every N-th decision")
    parser.add_argument("overrides", nargs="*", help="specctl-eval config overrides")
    return parser


def open_window(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Window:
    """The first evaluation scenario at ``args.seed`` whose label starts with
    ``args.label`` (its name printed), with ``args.policy`` as ``ppo``, as specctl-eval
    runs it (guard and probes)."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        cfg = compose(config_name="eval", overrides=[f"seed={args.seed}", *args.overrides])
    env = _eval_env(cfg)
    ev = cfg.eval
    scenarios = _scenarios(json.dumps(env, sort_keys=True), int(ev.windows), args.seed,
                           tuple(ev.get("prior_modes") or ("exact",)),
                           int(ev.get("random_servers") or 0))
    matches = [s for s in scenarios if s.label.startswith(args.label)]
    if not matches:
        parser.error(f"no scenario at seed {args.seed} starts with {args.label!r}")
    scenario = matches[0]
    print(f"{scenario.label} ({len(matches)} matching)")
    sim = Simulator(scenario.profile, scenario.acceptance, scenario.workload, scenario.config,
                    seed=scenario.seed)
    max_depth = int(env["max_depth"])
    policy = make_policy("ppo", profile=scenario.prior, max_depth=max_depth,
                         policy_path=args.policy, sim_config=scenario.config)
    spec = policy.feature_spec(FeatureSpec(max_depth=max_depth))
    loop = DecisionLoop(sim, spec, feedback_lag=int(env["feedback_lag"]),
                        horizon_s=scenario.horizon_s, cost_prior=scenario.prior)
    loop.features.set_probe(policy.probe)
    return Window(scenario, sim, policy, spec, loop, max_depth)


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments and print the window's trace."""
    parser = window_parser(__doc__.splitlines()[0])
    args = parser.parse_args(argv)
    window = open_window(parser, args)
    scenario, sim, policy, spec, loop = (window.scenario, window.sim, window.policy,
                                         window.spec, window.loop)
    max_depth = window.max_depth
    names = spec.names()
    confidence = [names.index(f"cost_confidence_{d}") for d in range(max_depth + 1)]
    goodput = [0] + [names.index(f"relative_goodput_{d}") for d in range(1, max_depth + 1)]
    obs = loop.reset(scenario.seed)
    policy.reset(loop.sim)
    step = 0
    while obs is not None:
        depth = policy.act(obs)
        shown = max(depth, 1)
        if step % args.every == 0:
            flags = scenario.config.latency_flags
            true = [1e3 * scenario.profile.step_latency_s(sim.batch_size, d, sim.kv_used, 0,
                                                          **flags(d)) for d in (0, shown)]
            v = obs.vector
            print(f"{step:5d} b={sim.batch_size:4d} d={depth} "
                  f"off {1e3 * obs.latency_pred_s[0]:7.1f}/{true[0]:7.1f} "
                  f"d{shown} {1e3 * obs.latency_pred_s[shown]:7.1f}/{true[1]:7.1f} "
                  f"conf0 {v[confidence[0]]:.2f} conf{shown} {v[confidence[shown]]:.2f} "
                  f"perr {obs.cost_profile_error:+.2f} goodput {3 * v[goodput[shown]]:+.2f}"
                  + (f" P{obs.probing}" if obs.probing else ""))
        obs, _ = loop.step(depth)
        step += 1
    print(f"throughput {loop.throughput_tok_s:.1f} tok/s, steps per depth "
          f"{loop.steps_chosen.tolist()}")


if __name__ == "__main__":
    main()
