"""The simulator's prediction for runs 91-95: the shipped file (``c66f698d``: latency
model 2 and the cost probe for streams without a profile) served with **no profile** on
the fitted MoE at acceptance 2.5 and 1.1 and on the fitted dense server at 3.0, against
static 0 (the plugin's off, the simulator's "no speculation") and static 3, on the H200
headline replay (``replay_policies.replay``, the plugin's warm-up and hold on).

    PYTHONPATH=$PWD:$PWD/scripts/h200:$PWD/docs/results/offceil24 \\
        python docs/results/gpu26/predict.py [seeds] [after]
"""

from __future__ import annotations

import sys

from offcheap import MODELS
from replay_policies import replayed_cells

from env.sim.cost_model import load_profile

SHIPPED = "controller/data/default_policy.npz"
#: (model, acceptance, requests/s, policies): the cells served on the GPU
CELLS = (("moe", 2.5, 6.0, ("static_0", "static_3", "ppo")),
         ("moe", 1.1, 6.0, ("static_0", "ppo")),
         ("dense", 3.0, 8.0, ("static_0", "static_3", "ppo")))
#: Run 97 (dense at 12 requests/s) was added during the lease, without a prediction:
#: ``predict.py 2 after`` simulates it afterwards (``predict_after.txt``).
AFTER = (("dense", 3.0, 12.0, ("static_0", "static_3", "ppo")),)


def main(cells: tuple | None = None) -> None:
    """Print the table for ``cells`` (default: :data:`CELLS`, or :data:`AFTER` when the
    second argument is ``after``); the first argument is the number of seeds."""
    seeds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    if cells is None:
        cells = AFTER if sys.argv[2:] == ["after"] else CELLS
    print(f"no profile handed to ppo; seeds 0-{seeds - 1}\n")
    print("| model | acceptance | req/s | policy | tok/s | mean TPOT ms | decisions per depth "
          "(seed 0) |")
    print("|---|---|---|---|---|---|---|")
    for model, acceptance, rate, policies in cells:
        server = load_profile(MODELS[model][1])
        for policy in policies:
            path = SHIPPED if policy == "ppo" else None
            row = replayed_cells(server, None, acceptance, policy, path, seeds, rate)
            print(f"| {model} | {acceptance} | {rate:g} | {policy} | {row} |", flush=True)


if __name__ == "__main__":
    main()
