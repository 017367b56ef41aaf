"""The simulator's prediction for runs 85-88 (the MoE served the shipped file with no profile,
with its own and with one that prices off too low, at acceptance 2.5, and with no profile at
1.1, where speculation never pays): the H200 headline replay (``replay_policies.replay``, the
fitted MoE server) per handed profile.

    PYTHONPATH=$PWD:$PWD/scripts/h200:$PWD/docs/results/offceil24 \\
        python docs/results/gpu25/predict.py [rate] [seeds]
"""

from __future__ import annotations

import sys

from offcheap import MODELS, write_offcheap
from replay_policies import replayed_cells

from env.sim.cost_model import load_profile

SHIPPED = "controller/data/default_policy.npz"


def main() -> None:
    rate = float(sys.argv[1]) if len(sys.argv) > 1 else 6.0
    seeds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    name, server_path, _ = MODELS["moe"]
    server = load_profile(server_path)
    priors = {"exact": load_profile(name), "none": None,
              "offcheap": load_profile(write_offcheap(name))}
    print(f"moe, {rate} requests/s, seeds 0-{seeds - 1}\n")
    print("| acceptance | prior | policy | tok/s | mean TPOT ms | decisions per depth (seed 0) |")
    print("|---|---|---|---|---|---|")
    for acceptance, prior_names in ((2.5, ("exact", "none", "offcheap")), (1.1, ("none",))):
        for prior_name in prior_names:
            runs = [("static_0", None), ("static_3", None)] if prior_name == "exact" else []
            runs += [("ppo", SHIPPED)]
            for policy, path in runs:
                cells = replayed_cells(server, priors[prior_name], acceptance, policy, path,
                                       seeds, rate)
                print(f"| {acceptance} | {prior_name} | {policy} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
