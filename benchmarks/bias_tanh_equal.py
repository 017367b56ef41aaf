"""The fused bias + ``tanh`` kernel against the unfused pair, bit for bit, over every float32.

A check, not a test (about a minute of one core): :func:`controller.fast_tanh.bias_tanh_inplace`
with a zero bias against :func:`controller.fast_tanh.tanh_inplace` over all 2^32 bit
patterns (NaNs compared as NaNs), then with random float32 biases against numpy's sum
followed by ``tanh_inplace`` over ``--random`` drawn matrices. Prints the patterns that
differ (0 expected): the fused kernel makes the approximate forward's activations the
same bits as before (docs/ONLINE.md, twentieth pass).

    python benchmarks/bias_tanh_equal.py [--chunk-bits 24] [--random 200]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from controller.fast_tanh import available, bias_tanh_inplace, tanh_inplace


def differing(a: np.ndarray, b: np.ndarray) -> int:
    """Elements whose bits differ, NaNs counted equal to NaNs."""
    nan = np.isnan(a)
    if not np.array_equal(nan, np.isnan(b)):
        return int((nan != np.isnan(b)).sum())
    return int((a.view(np.uint32)[~nan] != b.view(np.uint32)[~nan]).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunk-bits", type=int, default=24)
    parser.add_argument("--random", type=int, default=200,
                        help="random (1280 x 64) matrices with random biases")
    args = parser.parse_args()
    if not available():
        raise SystemExit("numba is missing: no kernel to check")
    started = time.perf_counter()
    chunk = 1 << args.chunk_bits
    width = 64
    zero = np.zeros(width, dtype=np.float32)
    bad = 0
    for start in range(0, 1 << 32, chunk):
        x = np.arange(start, start + chunk, dtype=np.uint64).astype(np.uint32).view(np.float32)
        want = tanh_inplace(x.copy())
        got = bias_tanh_inplace(x.copy().reshape(-1, width), zero).reshape(-1)
        bad += differing(want, got)
    print(f"all 2^32 float32, zero bias: {bad} differ ({time.perf_counter() - started:.0f} s)")
    rng = np.random.default_rng(0)
    bad = 0
    for _ in range(args.random):
        x = (rng.standard_normal((1280, width)) * rng.uniform(0.1, 10)).astype(np.float32)
        bias = (rng.standard_normal(width) * rng.uniform(0.1, 3)).astype(np.float32)
        want = x + bias
        tanh_inplace(want)
        bad += differing(want, bias_tanh_inplace(x, bias))
    print(f"{args.random} random 1280 x {width} matrices and biases: {bad} differ")


if __name__ == "__main__":
    main()
