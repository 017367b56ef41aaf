"""Runs 61-74 open loop (``feat23_replay``'s servings and table) through ``5c3d9060``, the
shipped ceiling (``65d4fb99``) and this session's candidate (``latency_off_ceiling_samples``
2 on top: the ceiling rises to what off's own steps measured near the batch). On the exact
profile the candidate should price off as the shipped file wherever off's real steps measure
within the ceiling (run 73 "ppo r6" above all: its lock-in must stay bounded).

    R=docs/results; PYTHONPATH=$PWD:$R/swap16:$R/drop_warmup:$R/gpu18:$R/gpu22:$R/feat23 \\
        python $R/offceil24/offceil24_replay.py > $R/offceil24/offceil24_replay.txt
"""

from __future__ import annotations

from pathlib import Path

import feat23_replay

HERE = Path(__file__).resolve().parent
FILES = {"5c3d9060": feat23_replay.SHIPPED, "ceil": feat23_replay.FILES["ceil"],
         "rising": HERE / "policy_3f47437c.npz"}

if __name__ == "__main__":
    feat23_replay.main(FILES)
