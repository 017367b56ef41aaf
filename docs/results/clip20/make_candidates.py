"""The two candidates: the shipped file and the gpu18 warm-up-aware retrain
(``policy_c1ec8046.npz``), each with ``latency_outlier_relative`` on and nothing else
changed; saved here as ``policy_<sha256[:8]>.npz``.

    PYTHONPATH=$PWD python docs/results/clip20/make_candidates.py
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from controller.policy_file import ExportedPolicy

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
SOURCES = (ROOT / "controller/data/default_policy.npz",
           ROOT / "docs/results/gpu18/policy_c1ec8046.npz")


def main() -> None:
    for source in SOURCES:
        policy = ExportedPolicy.load(source)
        spec = dataclasses.replace(policy.feature_spec, latency_outlier_relative=True)
        tmp = HERE / "candidate.tmp.npz"
        dataclasses.replace(policy, feature_spec=spec).save(tmp)
        name = HERE / f"policy_{hashlib.sha256(tmp.read_bytes()).hexdigest()[:8]}.npz"
        tmp.rename(name)
        print(f"{source.relative_to(ROOT)} -> {name.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
