"""The H200 headline replay in the simulator, per policy: a fitted server, a handed prior.

    python scripts/h200/replay_policies.py --server docs/results/h200/fidelity/moe_spec.yaml \
        --prior h200_qwen3_30b_a3b --acceptance 2.5 [--policies static_3,static_0,ppo,...]

Replays ``session.headline_workload`` (818 requests over 40 s, load rising and falling
twice) on a server whose costs are ``--server`` (e.g. the profile fitted to the real
replays, ``docs/FIDELITY.md``), with ``--prior`` as the cost profile the controller is
handed (what ``specctl-serve profile=...`` got on the GPU), and prints each policy's
throughput, mean TPOT and the share of its decisions at each depth.

Why: on the H200 (``docs/OFFSWITCH.md``, run 3) the shipped policy ran depth 3 on every
step of the MoE replay at acceptance 2.5 while speculation off served the arrivals; this
reproduces that cell within about 1% in seconds, so a policy can be checked against it
without a GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare import simulate
from measured_runs import OFFSWITCH_CANDIDATES, Cell

from env.sim.cost_model import load_profile


def replay(server, prior, acceptance: float, policy_name: str, seed: int = 0,
           policy_path: str | None = None, reentry_warmup: bool = False,
           candidates: tuple[int, ...] | None = OFFSWITCH_CANDIDATES,
           switch_hold: bool = True, rate: float | None = None) -> dict:
    """One headline replay; throughput, mean TPOT and the share of decisions per depth.

    ``seed`` draws the acceptance and the simulator's randomness (the arrivals are the
    GPU run's); ``policy_path`` is the exported policy ``ppo`` runs (default: shipped);
    ``reentry_warmup`` simulates the plugin's warm-up step on coming back on;
    ``candidates``: the steps the server offers ``ppo`` (default: ``offswitch.py``'s;
    None: every depth of the policy); ``switch_hold``: the plugin's hold between depth
    switches (``compare.PLUGIN_MIN_SWITCH_STEPS``; False: every decision at once);
    ``rate``: the replay's mean arrival rate, requests/s (None: ``session.headline_rate()``,
    as ``offswitch.py`` without ``HEADLINE_RATES``).
    """
    # The GPU servers' set-up: 48 running requests, depth 0 a plain decode (off path).
    cell = Cell(model="", server="spec_off", acceptance=acceptance, workload="headline",
                concurrency=None, seconds=40.0, policy=policy_name, radix_cache=False,
                max_running=48, source="", throughput_tok_s=0.0, mean_tpot_ms=0.0,
                candidates=candidates, rate=rate)
    overrides = {"reentry_warmup": reentry_warmup}
    if not switch_hold:
        overrides["min_switch_steps"] = 0
    result = simulate(cell, server, prior, client=None, seed=seed, policy_path=policy_path,
                      sim_overrides=overrides)
    chosen = result.pop("steps_chosen")
    total = sum(chosen) or 1
    return {**result, "depth_share": {d: n / total for d, n in enumerate(chosen) if n}}


def replayed_cells(server, prior, acceptance: float, policy: str, path: str | None,
                   seeds: int, rate: float) -> str:
    """The headline replay at seeds 0..seeds-1 as table cells: mean tok/s, mean TPOT ms, and
    seed 0's share of decisions per depth (the plugin's warm-up on)."""
    results = [replay(server, prior, acceptance, policy, seed, path, True, rate=rate)
               for seed in range(seeds)]
    tok = sum(r["throughput_tok_s"] for r in results) / seeds
    tpot = sum(r["mean_tpot_ms"] for r in results) / seeds
    share = ", ".join(f"{d}: {s:.0%}" for d, s in results[0]["depth_share"].items())
    return f"{tok:,.0f} | {tpot:.2f} | {share}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", required=True, help="the server's cost profile (path or name)")
    parser.add_argument("--prior", default=None,
                        help="the profile handed to the controller (default: none)")
    parser.add_argument("--acceptance", type=float, default=2.5)
    parser.add_argument("--policies", default="static_3,static_0,ppo,goodput_online")
    parser.add_argument("--policy-file", default=None,
                        help="the exported policy 'ppo' runs (default: the shipped one)")
    parser.add_argument("--seeds", type=int, default=1,
                        help="replay seeds 0..N-1: mean, min and max throughput (one seed "
                             "can be a lucky draw where a policy sits near a switch)")
    parser.add_argument("--reentry-warmup", action="store_true",
                        help="simulate the plugin's re-entry warm-up step "
                             "(SchedulerConfig.reentry_warmup), as the GPU runs it")
    parser.add_argument("--candidates", default=",".join(map(str, OFFSWITCH_CANDIDATES)),
                        help="the steps the server offers ppo, comma-separated (default: "
                             "offswitch.py's servers'), or 'all' (every depth of the policy)")
    parser.add_argument("--no-switch-hold", action="store_true",
                        help="without the plugin's hold between depth switches")
    args = parser.parse_args()
    if args.seeds < 1:
        parser.error(f"--seeds must be >= 1, got {args.seeds}")
    try:
        candidates = (None if args.candidates == "all"
                      else tuple(int(c) for c in args.candidates.split(",")))
    except ValueError:
        parser.error(f"--candidates {args.candidates!r}: expected e.g. 0,1,3,5 or all")
    server = load_profile(args.server)
    prior = load_profile(args.prior) if args.prior else None
    print("| policy | tok/s (mean) | min / max over seeds | mean TPOT ms | decisions per depth "
          "(seed 0) |\n|---|---|---|---|---|")
    for name in args.policies.split(","):
        runs = [replay(server, prior, args.acceptance, name, seed, args.policy_file,
                       args.reentry_warmup, candidates if name == "ppo" else None,
                       not args.no_switch_hold)
                for seed in range(args.seeds)]
        tok_s = [r["throughput_tok_s"] for r in runs]
        share = ", ".join(f"{d}: {s:.0%}" for d, s in runs[0]["depth_share"].items())
        print(f"| {name} | {sum(tok_s) / len(tok_s):,.0f} | {min(tok_s):,.0f} / "
              f"{max(tok_s):,.0f} | {sum(r['mean_tpot_ms'] for r in runs) / len(runs):.1f} | "
              f"{share} |")


if __name__ == "__main__":
    main()
