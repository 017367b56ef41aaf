#!/usr/bin/env python
"""Issue 14's planted bugs, replayed: ``python scripts/planted_bugs.py [NAME...]``.

Issue 14 planted one-line bugs in a clone, one at a time, and ran the suite; 9 of 14
survived it then. Each bug below is planted in a scratch copy of the work tree (tracked
and untracked, not ignored files; the work tree itself is never touched), the tests
that guard its module are run (``pytest -x``), and the first failing test is reported.
A bug no test catches is a missing test. Exit status 1 if any survives.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COST_TESTS = ("tests/test_cost_model.py", "--deselect",
              "tests/test_cost_model.py::test_calibration_regenerates_the_shipped_files")


@dataclass(frozen=True)
class Plant:
    """One bug: in ``path``, each ``(old, new)`` replacement (``old`` must occur once)."""

    name: str
    behaviour: str
    path: str
    edits: tuple[tuple[str, str], ...]
    tests: tuple[str, ...]


PLANTS = (
    Plant("lag", "feedback lag: features for step M fed from M - lag + 1", "env/rollout.py",
          (("visible_up_to = self.sim.step_index - self.feedback_lag",
            "visible_up_to = self.sim.step_index - self.feedback_lag + 1"),),
          ("tests/test_rollout.py", "tests/test_env.py")),
    Plant("actions", "policy file: actions above max_depth accepted",
          "controller/policy_file.py",
          (("if any(a < 0 or a > self.feature_spec.max_depth for a in self.actions):",
            "if any(a < 0 for a in self.actions):"),), ("tests/test_policy_file.py",)),
    Plant("step_index", "trace: equal step_index within one file accepted",
          "env/traces/trace_format.py",
          (("not_increasing = same & (index[order[1:]] <= index[order[:-1]])",
            "not_increasing = same & (index[order[1:]] < index[order[:-1]])"),),
          ("tests/test_trace_format.py",)),
    Plant("slo_penalty", "SLO reward: slo_penalty ignored (taken as 1)", "env/spec_env.py",
          (("tokens = outcome.tokens - self.slo_penalty * outcome.slo_violating_tokens",
            "tokens = outcome.tokens - 1.0 * outcome.slo_violating_tokens"),),
          ("tests/test_env.py",)),
    Plant("eager", "cost model: eager-batch threshold > to >= (scalar and design matrix)",
          "env/sim/cost_model.py",
          (("if batch_size > self._cg_max:", "if batch_size >= self._cg_max:"),
           ("(b > cuda_graph_max_bs).astype(float)", "(b >= cuda_graph_max_bs).astype(float)")),
          COST_TESTS),
    Plant("negative", "wire: negative time or latency accepted (both decoders)",
          "controller/wire.py",
          (("if not 0 <= value <= hi:  # False", "if not -1e300 <= value <= hi:  # False"),
           ("msgspec.Meta(ge=0.0, le=MAX_TIME_S)", "msgspec.Meta(le=MAX_TIME_S)"),
           ("msgspec.Meta(ge=0.0, le=MAX_STEP_LATENCY_S)", "msgspec.Meta(le=MAX_STEP_LATENCY_S)")),
          ("tests/test_wire.py",)),
    Plant("format_version", "policy file: format_version not checked",
          "controller/policy_file.py",
          (('if meta.get("format_version") != FORMAT_VERSION:', "if False:"),),
          ("tests/test_policy_file.py",)),
    Plant("accepted", "trace: negative accepted_drafts accepted", "env/traces/trace_format.py",
          (("out_of_range = (acc_val < 0) | (acc_val > steps_used[owner])",
            "out_of_range = acc_val > steps_used[owner]"),), ("tests/test_trace_format.py",)),
    Plant("maxmsgsize", "transport: the 1 MiB ZMQ_MAXMSGSIZE cap removed", "controller/wire.py",
          (("sock.setsockopt(zmq.MAXMSGSIZE, TRANSPORT_MAX_MSG_BYTES)", "pass"),),
          ("tests/test_wire.py",)),
)


def scratch_copy(target: Path) -> None:
    """The work tree's tracked and untracked (not ignored) files, into ``target``."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                           check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, names):
        if (REPO / name).is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, target / name)


def run_tests(root: Path, tests: tuple[str, ...], what: str) -> str:
    """``pytest -x`` of ``tests`` in ``root``: the first failing test, or ''."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p",
                           "no:cacheprovider", *tests], cwd=root, env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode not in (0, 1):
        raise SystemExit(f"planted_bugs: {what}: pytest exited {done.returncode}\n"
                         f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
    failed = [line[len("FAILED "):] for line in done.stdout.splitlines()
              if line.startswith("FAILED ")]
    return failed[0] if failed else ""


def plant(root: Path, bug: Plant) -> str:
    """Plant ``bug`` in ``root``, run its tests, restore; the first failure or ''."""
    path = root / bug.path
    original = path.read_text()
    planted = original
    for old, new in bug.edits:
        if planted.count(old) != 1:
            raise SystemExit(f"planted_bugs: {bug.name}: {bug.path} holds {old!r} "
                             f"{planted.count(old)} times, not once (the code moved: update "
                             "PLANTS)")
        planted = planted.replace(old, new)
    path.write_text(planted)
    try:
        return run_tests(root, bug.tests, bug.name)
    finally:
        path.write_text(original)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="plant only these: " +
                        ", ".join(p.name for p in PLANTS))
    args = parser.parse_args(argv)
    unknown = set(args.names) - {p.name for p in PLANTS}
    if unknown:
        raise SystemExit(f"planted_bugs: unknown bug(s) {sorted(unknown)}")
    survived = 0
    with tempfile.TemporaryDirectory(prefix="specctl-planted-") as scratch:
        root = Path(scratch) / "repo"
        scratch_copy(root)
        # The measurements some tests read live in ``shared/`` above the checkout.
        shared = next((d / "shared" for d in REPO.parents if (d / "shared").is_dir()), None)
        if shared is not None:
            (Path(scratch) / "shared").symlink_to(shared.resolve())
        chosen = [bug for bug in PLANTS if not args.names or bug.name in args.names]
        # Unplanted, the same tests must pass: a failure below is then the bug's.
        for tests in dict.fromkeys(bug.tests for bug in chosen):
            if failed := run_tests(root, tests, "unplanted"):
                raise SystemExit(f"planted_bugs: {failed} fails with no bug planted")
        for bug in chosen:
            caught = plant(root, bug)
            survived += not caught
            print(f"{bug.name:15} {bug.behaviour}: "
                  f"{'caught by ' + caught if caught else 'SURVIVED'}", flush=True)
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
