"""Fuzz the daemon's frame handling with 100,000+ generated frames. A benchmark, not a test.

    python benchmarks/fuzz_daemon.py [--frames 100000]

Runs the property test ``tests/test_daemon_fuzz.py`` (no frame crashes the daemon or
changes another connection's decisions; in-range values never reset a stream) with
enough Hypothesis examples for ``--frames`` hostile frames, and reports the wall time.
CI runs the same test with 10,000 frames.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.test_daemon_fuzz import FRAMES  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frames", type=int, default=100_000)
    args = parser.parse_args()
    examples = math.ceil(args.frames / FRAMES)
    env = {**os.environ, "SPECCTL_FUZZ_EXAMPLES": str(examples),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/test_daemon_fuzz.py", "--hypothesis-show-statistics"],
        cwd=REPO, env=env, text=True, capture_output=True)
    elapsed = time.perf_counter() - started
    print(result.stdout[-3000:], result.stderr[-2000:], sep="\n")
    frames = examples * FRAMES
    verdict = "passed" if result.returncode == 0 else f"FAILED (exit {result.returncode})"
    print(f"{frames} hostile frames ({examples} examples x {FRAMES}), plus "
          f"{frames // 10} victim steps checked: {verdict} in {elapsed:.0f} s "
          f"({frames / elapsed:.0f} frames/s including generation)")
    sys.exit(result.returncode)


if __name__ == "__main__":
    main()
