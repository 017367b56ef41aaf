"""The goodput guard's many-row path (:func:`env.guard.guard_rows`) compiled with numba.

One call per poll instead of ~10 numpy calls: at a daemon's poll of one to eight streams
the guard cost ~30-40 us of thread CPU with the caches cold (``benchmarks/daemon_parts.py``,
nineteenth pass), about a sixth of the poll. The same comparisons in the same dtype as
the numpy code: the observations' product by 3 and the thresholds in the observations'
dtype (numpy compares a float32 array with a Python float in float32), NaN failing
every comparison (``tests/test_guard.py`` checks it against the first whole-array code on
values at and beside the thresholds). Self-contained: numba's disk cache checks only
this file for changes.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(error_model="numpy", cache=True)
def guard_kernel(observations: np.ndarray, index: np.ndarray, actions: np.ndarray,
                 off: int, off_allowed: np.ndarray, columns: np.ndarray,
                 limits: np.ndarray) -> None:  # pragma: no cover - compiled
    """In place: ``index`` (streams x grid rows, action indices) set to ``off`` where
    :func:`env.guard.guard_rows` overrules, for the streams whose ``off_allowed`` (empty:
    every stream). ``columns``: :attr:`env.guard.GuardColumns.packed`; ``limits``: 3,
    ``log1p(-margin)``, ``confidence`` and ``max_profile_error`` in the observations'
    dtype (few arguments: numba's dispatch costs ~0.3 us per argument)."""
    streams, rows = index.shape
    depths = (columns.size - 1) // 2
    confidence_0 = columns[depths]
    profile_error = columns[-1]
    three, threshold, sure, max_error = limits[0], limits[1], limits[2], limits[3]
    every = off_allowed.size == 0
    for s in range(streams):
        if not every and not off_allowed[s]:
            continue
        for r in range(rows):
            chosen = index[s, r]
            if chosen < 0 or chosen >= actions.size:
                raise IndexError("an action index beyond the policy's actions")
            depth = actions[chosen]
            if depth <= 0:
                continue
            if depth >= depths:
                raise IndexError("an action beyond the feature spec's depths")
            row = s * rows + r
            if not observations[row, columns[depth]] * three < threshold:
                continue
            if (observations[row, columns[depths + depth]] >= sure
                    and observations[row, confidence_0] >= sure
                    and abs(observations[row, profile_error]) <= max_error):
                index[s, r] = off
