"""The compiled float32 ``tanh`` against numpy's, over every float32 value.

A check, not a test (a few minutes of one core): prints the largest
``|tanh_inplace(x) - np.tanh(x)|`` over all 2^32 bit patterns (NaNs must stay NaNs) and
numpy's own largest error against float64 ``tanh`` (over the non-negative half; both are
odd functions), next to :data:`controller.fast_tanh.TANH_ERROR`, which must exceed their
sum (the first plus twice the second: docs/ONLINE.md, nineteenth pass).

    python benchmarks/tanh_error.py [--chunk-bits 24] [--skip-true]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from controller.fast_tanh import TANH_ERROR, available, tanh_inplace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunk-bits", type=int, default=24)
    parser.add_argument("--skip-true", action="store_true",
                        help="leave out numpy against float64 (the slow part)")
    args = parser.parse_args()
    if not available():
        sys.exit("numba is not installed: nothing to check")
    chunk = 1 << args.chunk_bits
    worst = worst_np = 0.0
    at = at_np = 0.0
    nan_kept = True
    started = time.perf_counter()
    for start in range(0, 1 << 32, chunk):
        x = np.arange(start, start + chunk, dtype=np.uint64).astype(np.uint32).view(np.float32)
        exact = np.tanh(x)
        fast = tanh_inplace(x.copy())
        nan = np.isnan(x)
        nan_kept &= bool(np.isnan(fast[nan]).all())
        diff = np.abs(fast[~nan].astype(np.float64) - exact[~nan])
        i = int(diff.argmax())
        if diff[i] > worst:
            worst, at = float(diff[i]), float(x[~nan][i])
        if not args.skip_true and start < 1 << 31:  # sign bit clear: x >= 0 or NaN
            true = np.tanh(x[~nan].astype(np.float64))
            diff = np.abs(exact[~nan] - true)
            i = int(diff.argmax())
            if diff[i] > worst_np:
                worst_np, at_np = float(diff[i]), float(x[~nan][i])
    print(f"all 2^32 float32 values, {time.perf_counter() - started:.0f} s")
    print(f"max |tanh_inplace - np.tanh|: {worst:.3g} (at x = {at!r})")
    print(f"NaN in, NaN out: {nan_kept}")
    if not args.skip_true:
        print(f"max |np.tanh (float32) - tanh (float64)|, x >= 0: {worst_np:.3g} "
              f"(at x = {at_np!r})")
    bound = worst + 2 * worst_np
    print(f"TANH_ERROR {TANH_ERROR:g} against {bound:.3g}: "
          f"{'holds' if bound < TANH_ERROR else 'DOES NOT HOLD'}")


if __name__ == "__main__":
    main()
