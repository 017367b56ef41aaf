"""Runs 57, 58 and 60: each ``ppo`` serving's telemetry replayed open loop through
``c1ec`` (``gpu18/policy_c1ec8046.npz``) and ``c1ec_w1`` (``gpu20/policy_e1ff08ab.npz``,
the same file with the outlier clip armed from a stream's second step), in
``gpu19/cross_files.py``'s format: per band (replayed off share, predicted off / depth-3
ms, measured off / depth-3 ms, priced depth-3 / off goodput). Open loop.

    R=docs/results; PYTHONPATH=$PWD:$R/swap16:$R/drop_warmup:$R/gpu18:$R/gpu19 \\
        python docs/results/gpu20/cross_w1.py > docs/results/gpu20/cross_w1.txt
"""

from __future__ import annotations

from pathlib import Path

import cross_files

RESULTS = Path(__file__).resolve().parents[1]

if __name__ == "__main__":
    cross_files.FILES = {"c1ec": RESULTS / "gpu18/policy_c1ec8046.npz",
                         "c1ec_w1": RESULTS / "gpu20/policy_e1ff08ab.npz"}
    cross_files.main()
