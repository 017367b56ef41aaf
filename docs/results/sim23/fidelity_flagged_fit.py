"""Runs 61-68 in the simulator with the booking fitted on the plugin's flag (runs 71-79,
``refit_flagged.py``: dense L 8.7 ms, h 0.36) against the shipped fit (runs 46-69: 8.0 ms,
0.36): ``gpu22/fidelity_61_68.py`` with its "before" the shipped fit's copy of the GPU
server profile (``gpu22/dense_spec_launch.yaml``) and its "after" the same server with the
flagged fit (``dense_spec_launch_flagged.yaml`` here, written by this script).

    R=docs/results; P=$R/swap16:$R/drop_warmup:$R/gpu18:$R/gpu20:$R/gpu21:$R/gpu22
    PYTHONPATH=$PWD:$PWD/scripts/h200:$P python docs/results/sim23/fidelity_flagged_fit.py \\
        > docs/results/sim23/fidelity_flagged_fit.txt
"""

from __future__ import annotations

from pathlib import Path

import fidelity_61_68

from env.sim.calibration.prefill_launch import with_prefill_launch
from env.sim.cost_model import load_profile, save_profile

HERE = Path(__file__).resolve().parent
#: The dense fit on the flagged steps of runs 72 and 76 (``refit_flagged.txt``).
FLAGGED_DENSE = (0.0087, 0.36)


def main() -> None:
    flagged = HERE / "dense_spec_launch_flagged.yaml"
    server = load_profile(str(fidelity_61_68.FIDELITY / "dense_spec.yaml"))
    save_profile(with_prefill_launch(server, FLAGGED_DENSE), flagged)
    fidelity_61_68.PROFILES = {"before": fidelity_61_68.HERE / "dense_spec_launch.yaml",
                               "after": flagged}
    fidelity_61_68.main()


if __name__ == "__main__":
    main()
