"""The twenty-third session's feature candidate as a servable file: the shipped file
(``65d4fb99`` = ``5c3d9060`` + ``latency_off_ceiling`` 0.1, its weights, guard and probe)
with ``FeatureSpec.latency_off_ceiling_batch`` 24 (the ceiling bounds off's price only at
batch >= 24). Writes ``policy_<sha8>.npz`` here and prints its sha. Run since the
twenty-fourth session it writes the same policy under another sha (``ca814f91``): the spec
it stores has one more field, ``latency_off_ceiling_samples``, at 0.

    PYTHONPATH=$PWD:$PWD/docs/results/feat23 python docs/results/feat23/make_policy.py
"""

from __future__ import annotations

from pathlib import Path

from candidates import write_candidate

HERE = Path(__file__).resolve().parent
#: The batch size from which the ceiling applies (the grid value 24: README.md here).
CEILING_BATCH = 24.0

if __name__ == "__main__":
    write_candidate("feat23", HERE.parent / "gpu22/policy_65d4fb99.npz", HERE,
                    latency_off_ceiling_batch=CEILING_BATCH)
