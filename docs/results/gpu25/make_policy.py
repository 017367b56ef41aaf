"""The twenty-fifth session's candidate: the shipped file (``3f47437c``: weights, guard, probe
and every other feature field) with ``FeatureSpec.latency_model`` 2 instead of 3. With a
cost profile the two run the same regression (model 3 is model 2 with a profile), so only
a stream without a profile changes: it runs model 2 (off's terms apart from speculation's,
whose batch term counts verify tokens) instead of model 1. Writes ``policy_<sha8>.npz``
here and prints its sha.

    PYTHONPATH=$PWD:$PWD/docs/results/feat23 python docs/results/gpu25/make_policy.py
"""

from __future__ import annotations

from pathlib import Path

from candidates import write_candidate

HERE = Path(__file__).resolve().parent

if __name__ == "__main__":
    write_candidate("model2", HERE.parent / "offceil24/policy_3f47437c.npz", HERE,
                    latency_model=2)
