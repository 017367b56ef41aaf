"""What single calls cost after an idle millisecond, against back to back.

The twenty-fourth pass's ad-hoc instrument (docs/ONLINE.md): each call is made, then the
process sleeps 1 ms and times the call (cold) and at once again (warm), 600 times; the
medians. The shapes are one stream's: a 20-row grid, 64 hidden units.

    python docs/results/bench_online_pass24/cold_calls.py [TREE]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np


def main() -> None:
    sys.path.insert(0, str(Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()))
    from threadpoolctl import threadpool_limits

    threadpool_limits(1, user_api="blas")
    from controller import fast_tanh

    fast_tanh.warm_up()
    rng = np.random.default_rng(0)
    x = rng.random((20, 17), dtype=np.float32)
    w = rng.random((17, 64), dtype=np.float32)
    h = rng.random((20, 64), dtype=np.float32)
    b = rng.random(64, dtype=np.float32)
    tiled = np.ascontiguousarray(np.broadcast_to(b, (20, 64)))
    calls = {
        "np.dot, 20x17 by 17x64": lambda: np.dot(x, w),
        "np.tanh in place": lambda: np.tanh(h, out=h),
        "bias added in place": lambda: h.__iadd__(tiled),
        "np.isfinite(h).all()": lambda: np.isfinite(h).all(),
        "fast_tanh.all_finite(h)": lambda: fast_tanh.all_finite(h),
        "h.argmax(axis=1)": lambda: h.argmax(axis=1),
        "fused bias + tanh (numba)": lambda: fast_tanh.bias_tanh_inplace(h, b),
        "a Python call, sum of 3": lambda: sum([1, 2, 3]),
        "an empty Python call": lambda: None,
    }
    clock = time.perf_counter_ns
    for name, call in calls.items():
        for _ in range(50):
            call()
        cold, warm = [], []
        for _ in range(600):
            time.sleep(0.001)
            started = clock()
            call()
            middle = clock()
            call()
            cold.append(middle - started)
            warm.append(clock() - middle)
        print(f"{name:28s} cold {np.median(cold) / 1e3:6.2f} us  "
              f"warm {np.median(warm) / 1e3:6.2f} us")


if __name__ == "__main__":
    main()
