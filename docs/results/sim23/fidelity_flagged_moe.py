"""The MoE's servings of runs 70-79 (6 requests/s) in the simulator with the booking fitted
on the plugin's flag (``refit_flagged.py``: L 6.5 ms, h 0.32) against the shipped fit (runs
46-69: 4.8 ms, 0.24): ``gpu22/heldout_70_74.py``'s table 2 on the MoE runs (70 without
speculation; 71, 73, 74, 77, 79 flagged, the simulator's flags on), "before" the shipped
fit's copy of the GPU server profile (``gpu22/moe_real_spec_launch.yaml``), "after" the
flagged fit's (``moe_real_spec_launch_flagged.yaml`` here, written by this script).

    R=docs/results; P=$R/swap16:$R/drop_warmup:$R/gpu18:$R/gpu20:$R/gpu21:$R/adm21_moe:$R/gpu22
    PYTHONPATH=$PWD:$PWD/scripts/h200:$P python docs/results/sim23/fidelity_flagged_moe.py \\
        > docs/results/sim23/fidelity_flagged_moe.txt
"""

from __future__ import annotations

from pathlib import Path

import heldout_70_74
import servings_70_74

from env.sim.calibration.prefill_launch import with_prefill_launch
from env.sim.cost_model import load_profile, save_profile

HERE = Path(__file__).resolve().parent
#: The MoE fit on the flagged steps of runs 71, 73, 74, 77, 79 (``refit_flagged.txt``).
FLAGGED_MOE = (0.0065, 0.32)
MOE_RUNS = (71, 73, 74, 77, 79)


def main() -> None:
    flagged = HERE / "moe_real_spec_launch_flagged.yaml"
    server = load_profile(str(heldout_70_74.FIDELITY / "moe_real_spec.yaml"))
    save_profile(with_prefill_launch(server, FLAGGED_MOE), flagged)
    before = dict(heldout_70_74.SERVERS["after"])
    heldout_70_74.SERVERS = {"before": before, "after": {**before, "moe.real": flagged}}
    servings_70_74.RUNS = dict.fromkeys(MOE_RUNS)  # (only its keys are read: the runs)
    heldout_70_74.table_fidelity()


if __name__ == "__main__":
    main()
