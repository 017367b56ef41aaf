"""The twenty-fourth session's candidate as a servable file: the file shipped before
(``65d4fb99`` = ``5c3d9060`` + ``latency_off_ceiling`` 0.1: its weights, guard and probe)
with ``FeatureSpec.latency_off_ceiling_samples`` 2 (the ceiling rises to what off's own
steps, warm-ups left out, measured near the batch). Writes ``policy_<sha8>.npz`` here and
prints its sha.

    PYTHONPATH=$PWD:$PWD/docs/results/feat23 python docs/results/offceil24/make_policy.py
"""

from __future__ import annotations

from pathlib import Path

from candidates import write_candidate

HERE = Path(__file__).resolve().parent
#: Off's own measured steps near a batch size at which the ceiling has risen 1 - 1/e of
#: the way to what they measured (the cost confidence's 2 samples).
SAMPLES = 2.0

if __name__ == "__main__":
    write_candidate("offceil24", HERE.parent / "gpu22/policy_65d4fb99.npz", HERE,
                    latency_off_ceiling_samples=SAMPLES)
