#!/usr/bin/env python
"""One ``specctl-eval`` window: per decision the batch size, the depth run (the network's
arg-max), the predicted/true ms of off and depths 1, 3, 7, P(off), probing flag; then every
record the step returned (prefill ones too) with its latency and the window's running time.
Shows where a window's time goes.

    PYTHONPATH=$PWD:$PWD/scripts python docs/results/rand26/trace_all.py 8 \\
        "azure_conv load=1.5 mod=0 random-1 prior=none" [--policy FILE] [--quiet]
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
    parser.add_argument("--quiet", action="store_true", help="only the summary lines")
    parser.add_argument("--measure-first", type=int, default=0, metavar="N",
                        help="prototype (not shipped): in a stream without a cost profile, "
                        "while no speculative step's cost is measured (cost samples of "
                        "depths 1..7 all 0), once N speculative steps have run, every decision off")
    parser.add_argument("--release-hold", action="store_true",
                        help="prototype: with --measure-first, neither the speculative step before "
                        "a decision it turns off nor that off step is held by the plugin's "
                        "min_switch_steps (the simulator's hold reset around it)")
    parser.add_argument("--first-cap", type=int, default=0, metavar="D",
                        help="prototype: in a stream without a cost profile, while no "
                        "speculative step's cost is measured, depth at most D (0: no cap)")
    parser.add_argument("--count-measurable", action="store_true",
                        help="prototype: --measure-first counts only speculative steps whose "
                        "latency the features keep (not one a prefill follows)")
    parser.add_argument("--start-only", action="store_true",
                        help="prototype: the two rules above only until the stream's first "
                        "speculative cost sample (else: whenever none is held)")
    args = parser.parse_args(argv)
    window = open_window(parser, args)
    scenario, sim, policy, loop = window.scenario, window.sim, window.policy, window.loop
    actions = np.asarray(policy.exported.actions)
    obs = loop.reset(scenario.seed)
    policy.reset(loop.sim)
    step, clock, unmeasured, seen_spec = 0, 0.0, 0, False
    time_by = {"prefill": 0.0, "off": 0.0, "spec": 0.0}
    extra = 0.0  # speculative decode records' time over off's true price at that batch
    flags = scenario.config.latency_flags
    while obs is not None:
        probs = _softmax(policy.exported.logits(obs.vector.reshape(1, -1))[0])
        depth = policy.act(obs)
        measured = obs.cost_samples[1:].sum() > 0
        if measured and not args.start_only:
            unmeasured = 0  # a speculative cost is measured: the next unmeasured run may go
        seen_spec = seen_spec or measured
        unprofiled_start = (scenario.prior is None and depth > 0 and not measured
                            and not (args.start_only and seen_spec))
        if args.first_cap and unprofiled_start:
            depth = min(depth, args.first_cap)
        if args.measure_first and unprofiled_start and unmeasured >= args.measure_first:
            depth = 0
            if args.release_hold:
                sim._held_depth = -1
        for r in obs.new_records:
            clock += r.step_latency_s
            kind = "prefill" if r.prefill_tokens else ("spec" if r.steps_used else "off")
            time_by[kind] += r.step_latency_s
            if kind == "spec":
                off = scenario.profile.step_latency_s(r.batch_size, 0, r.kv_used_tokens, 0,
                                                      **flags(0))
                extra += r.step_latency_s - off
            if not args.quiet:
                acc = float(np.mean(r.accepted_drafts)) if len(r.accepted_drafts) else 0.0
                print(f"      rec {r.step_index:4d} t={clock:7.3f}s b={r.batch_size:3d} "
                      f"pre={r.prefill_tokens:5d} d={r.steps_used} acc={acc:.2f} "
                      f"{1e3 * r.step_latency_s:7.1f} ms")
        if not args.quiet:
            true = [1e3 * scenario.profile.step_latency_s(sim.batch_size, d, sim.kv_used, 0,
                                                          **flags(d)) for d in (0, 1, 3, 7)]
            pred = [1e3 * obs.latency_pred_s[d] for d in (0, 1, 3, 7)]
            print(f"{step:4d} b={sim.batch_size:3d} d={depth}({actions[probs.argmax()]}) "
                  f"P(off)={probs[0]:.2f} pred/true off,1,3,7 "
                  + " ".join(f"{p:.0f}/{t:.0f}" for p, t in zip(pred, true, strict=True))
                  + f" samples {obs.cost_samples.astype(int).tolist()}"
                  + (f" P{obs.probing}" if obs.probing else ""))
        forced_off = bool(args.release_hold and args.measure_first and unprofiled_start
                          and unmeasured >= args.measure_first)
        obs, outcome = loop.step(depth)
        if forced_off:
            sim._held_depth = -1  # nor does the off step it forced hold the next decision
        dropped = bool(outcome.record.before_prefill
                       or sim.step_index > outcome.record.step_index + 1)  # a prefill next
        if scenario.prior is None and outcome.record.steps_used > 0 and not measured \
                and not (args.count_measurable and dropped):
            unmeasured += 1  # a speculative step ran whose cost no sample yet shows
        if not args.quiet:
            r = outcome.record
            print(f"     ran step {r.step_index} depth {r.steps_used}"
                  f"{' warm-up' if r.warmup else ''} {1e3 * r.step_latency_s:.1f} ms")
        step += 1
    print(f"throughput {loop.throughput_tok_s:.1f} tok/s, decisions per depth "
          f"{loop.steps_chosen.tolist()}, record time prefill {time_by['prefill']:.2f} s, "
          f"off {time_by['off']:.2f} s, spec {time_by['spec']:.2f} s "
          f"(of it over off's true price {extra:.2f} s)")


if __name__ == "__main__":
    main()
