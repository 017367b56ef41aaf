"""The twenty-fifth session's candidate: the shipped file (``3f47437c``: its weights, guard,
probe and every other feature field) with ``FeatureSpec.acceptance_fresh_only`` on (the
acceptance estimate leaves out the requests whose draft KV went stale while speculation
was off). Writes ``policy_<sha8>.npz`` here and prints its sha.

    PYTHONPATH=$PWD:$PWD/docs/results/feat23 python docs/results/fresh25/make_policy.py
"""

from __future__ import annotations

from pathlib import Path

from candidates import write_candidate

HERE = Path(__file__).resolve().parent

if __name__ == "__main__":
    write_candidate("fresh25", HERE.parent / "offceil24/policy_3f47437c.npz", HERE,
                    acceptance_fresh_only=True)
