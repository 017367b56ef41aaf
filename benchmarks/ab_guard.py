"""The goodput guard's cost per call, this tree's against another tree's, in one process.

A diagnostic, not a test (``tests/test_guard.py`` holds the two to the same decisions).
``apply_guard`` runs once per decision in local mode (one stream's 20 grid rows), once
per poll in ``specctl-serve`` and once per step in the simulator's policy adapter (one
row). Cases: no row losing to off, every row losing with both costs measured, every row
losing with a cost guessed, half, two of 20; each on 20 rows and on one. Best of 5 repeats per case
(the machine is shared: the minimum is the least disturbed).

    python benchmarks/ab_guard.py --before /path/to/other/checkout
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import timeit
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import env.guard as after  # noqa: E402
from env.features import FeatureSpec  # noqa: E402


def load_before(root: Path):
    """The other tree's ``env/guard.py`` as a module of its own."""
    spec = importlib.util.spec_from_file_location("guard_before", root / "env" / "guard.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--number", type=int, default=3000)
    args = parser.parse_args()
    before = load_before(args.before.resolve())
    spec = FeatureSpec()
    guard = after.DEFAULT_GUARD
    actions = np.arange(spec.max_depth + 1)
    rng = np.random.default_rng(0)
    base = rng.uniform(-1, 1, (20, spec.size)).astype(np.float32)
    columns = {"before": before.GuardColumns(spec.names(), spec.max_depth),
               "after": after.GuardColumns(spec.names(), spec.max_depth)}
    modules = {"before": before, "after": after}
    chosen = rng.integers(1, len(actions), (1, 20))
    print(f"load {os.getloadavg()[0]:.1f}; us per apply_guard call (best of 5)")
    for label, low, high, sure in (("none losing", 0.0, 1.0, 0.9),
                                   ("all losing, measured", -1.0, -0.5, 0.9),
                                   ("all losing, guessed", -1.0, -0.5, 0.1),
                                   ("half losing", -0.5, 0.5, 0.9),
                                   ("two losing", 0.0, 1.0, 0.9)):
        obs = base.copy()
        cols = columns["after"]
        obs[:, cols.goodput] = rng.uniform(low, high, (20, len(cols.goodput)))
        if label == "two losing":
            obs[3, cols.goodput] = obs[11, cols.goodput] = -0.9
        obs[:, cols.confidence] = sure
        obs[:, cols.profile_error] = 0.1
        for rows in (20, 1):
            o, i = obs[:rows], chosen[:, :rows]
            spent, results = {}, {}
            for tag, module in modules.items():
                def call(module=module, tag=tag, o=o, i=i):
                    index = i.copy()
                    module.apply_guard(guard, columns[tag], o, index, actions, [None])
                    return index
                results[tag] = call().tolist()
                spent[tag] = min(timeit.repeat(call, number=args.number, repeat=5)) \
                    / args.number * 1e6
            same = "" if results["before"] == results["after"] else "  DIFFERENT DECISIONS"
            print(f"  {label:22s} {rows:2d} rows: before {spent['before']:5.2f}  "
                  f"after {spent['after']:5.2f}{same}")


if __name__ == "__main__":
    main()
