#!/usr/bin/env python
"""One ``specctl-eval`` window step by step, every depth at once: per decision the batch
size, the depth run (and the network's own arg-max before the guard and the probes), the
observation's predicted latency of every depth against the simulator's true cost (ms),
each depth's relative goodput feature (log, over off), the cost-sample counts and the
network's action probabilities. ``scripts/trace_window.py`` shows one depth per step;
this shows why a depth was not chosen.

    PYTHONPATH=$PWD:$PWD/scripts python docs/results/nopro24/trace_depths.py 2 \\
        "fixed C=64 h100_llama31_8b prior=none" --every 5 --steps 200
"""

from __future__ import annotations

import numpy as np
from trace_window import open_window, window_parser


def _softmax(logits: np.ndarray) -> np.ndarray:
    z = np.exp(logits - logits.max())
    return z / z.sum()


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments and print the window's trace."""
    parser = window_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=0, help="stop after N decisions (0: all)")
    parser.add_argument("--records", action="store_true",
                        help="also print each decode record folded (depth, mean accepted)")
    args = parser.parse_args(argv)
    window = open_window(parser, args)
    scenario, sim, policy, spec, loop = (window.scenario, window.sim, window.policy,
                                         window.spec, window.loop)
    max_depth = window.max_depth
    names = spec.names()
    goodput = [names.index(f"relative_goodput_{d}") for d in range(1, max_depth + 1)]
    actions = np.asarray(policy.exported.actions)
    from env.sim.acceptance import expected_accepted

    true_accepted = [expected_accepted(scenario.acceptance, d) for d in range(max_depth + 1)]
    print("simulator's expected accepted drafts per depth 1..7 (warm): "
          + " ".join(f"{a:.2f}" for a in true_accepted[1:]))
    print("step batch run(net) | pred/true ms per depth 0..7 | relative goodput 1..7 "
          "| expected accepted 1..7 | cost samples 0..7 | P(action) per action "
          + str(actions.tolist()))
    obs = loop.reset(scenario.seed)
    policy.reset(loop.sim)
    step = 0
    while obs is not None and (not args.steps or step < args.steps):
        probs = _softmax(policy.exported.logits(obs.vector.reshape(1, -1))[0])
        depth = policy.act(obs)
        if step % args.every == 0:
            flags = scenario.config.latency_flags
            true = [1e3 * scenario.profile.step_latency_s(sim.batch_size, d, sim.kv_used, 0,
                                                          **flags(d))
                    for d in range(max_depth + 1)]
            pred = 1e3 * obs.latency_pred_s
            print(f"{step:5d} b={sim.batch_size:3d} d={depth}({actions[probs.argmax()]}) | "
                  + " ".join(f"{p:.1f}/{t:.1f}" for p, t in zip(pred, true, strict=True))
                  + " | " + " ".join(f"{3 * obs.vector[g]:+.2f}" for g in goodput)
                  + " | " + " ".join(f"{a:.2f}" for a in obs.expected_accepted[1:])
                  + " | " + " ".join(f"{c:.0f}" for c in obs.cost_samples)
                  + " | " + " ".join(f"{p:.2f}" for p in probs)
                  + (f" P{obs.probing}" if obs.probing else ""))
            if args.records:
                for r in obs.new_records:
                    if r.prefill_tokens == 0:
                        mean = float(np.mean(r.accepted_drafts)) if len(r.accepted_drafts) else 0.0
                        print(f"      record step {r.step_index} depth {r.steps_used} "
                              f"accepted {mean:.2f} {1e3 * r.step_latency_s:.1f} ms"
                              + (" warm-up" if r.warmup else ""))
        obs, _ = loop.step(depth)
        step += 1
    print(f"throughput {loop.throughput_tok_s:.1f} tok/s, steps per depth "
          f"{loop.steps_chosen.tolist()}")


if __name__ == "__main__":
    main()
