"""Fit a cost profile to every step of a recorded trace, KV use and prefill included.

:func:`env.cost_model.fit_profile_from_trace` reduces decode steps to one median per
(batch size, depth) cell, which keeps the per-request term but throws away how latency
grows with the KV cache at a fixed batch size, and uses prefill steps only for one
per-token number. Under a replayed workload both matter: requests with long prompts make
the KV cache four to twenty times larger than in a 256-token explore run at the same batch
size, and prefill steps of tens to thousands of tokens take a large share of the time.

Here decode steps are grouped by (batch size, depth, KV bin) and prefill steps by the
log2 bin of their token count, each group contributes its median latency (weighted by
the square root of its size), and the free coefficients (``c_kv`` among them) are fitted
jointly by :func:`env.cost_model.fit_profile`. With depth-0 steps only, leave
``c_prefill_token`` out of the free set: its column (prompt tokens) is ``c_token``'s
(batch + prompt) less ``c_request``'s (batch), so ``c_token`` carries the prompt's cost.

Steps are taken as the simulator runs them: a prefill step is ``batch_size = 0`` with
the prompt tokens it computed, and depth-0 steps are the plain decode of the plugin's
off path (``draft_extend=False``) unless told otherwise. Depth-0 steps within
``switch_guard`` steps of a speculative step are left out: a warm-up (SGLang's own
steps=0, run once when speculation comes back) is recorded as depth 0 as well, and
costs about a verify step, not a plain decode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from env.cost_model import CostProfile, FitReport, LatencyPoints, fit_profile

#: Decode steps are binned by KV use in bins of this many tokens.
KV_BIN_TOKENS = 4096


@dataclass(frozen=True)
class StepArrays:
    """One server's steps, in step order (the lowest rank of a recorded trace)."""

    batch_size: np.ndarray
    depth: np.ndarray
    kv_tokens: np.ndarray
    prefill_tokens: np.ndarray
    latency_s: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.latency_s)
        for name in ("batch_size", "depth", "kv_tokens", "prefill_tokens"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"StepArrays.{name} has {len(getattr(self, name))} entries, "
                                 f"expected {n} (one per step)")

    @classmethod
    def from_trace(cls, trace) -> StepArrays:
        """The steps of a :class:`~env.trace_format.Trace`, lowest rank, in step order."""
        cols = trace.step_columns()
        if not len(cols):
            raise ValueError("the trace holds no step records")
        servers = cols.server.astype(str)
        if len(np.unique(servers)) != 1:
            raise ValueError(f"the trace holds several servers {sorted(set(servers))}; "
                             "fit one server at a time")
        keep = cols.rank == cols.rank.min()
        order = np.lexsort((cols.step_index[keep], cols.time_s[keep]))
        return cls(cols.batch_size[keep][order].astype(np.int64),
                   cols.steps_used[keep][order].astype(np.int64),
                   cols.kv_used_tokens[keep][order].astype(np.float64),
                   cols.prefill_tokens[keep][order].astype(np.int64),
                   cols.step_latency_s[keep][order].astype(np.float64))


def load_points(steps: StepArrays | Sequence[StepArrays], *, draft_extend: bool = False,
                switch_guard: int = 5, min_steps: int = 3,
                kv_bin_tokens: int = KV_BIN_TOKENS) -> LatencyPoints:
    """Group medians of decode and prefill steps as fit points (see the module docstring).

    Args:
        steps: One or more servers' steps (each in step order).
        draft_extend: Whether depth-0 decode steps ran the draft extend (SGLang's own
            steps=0) rather than a plain decode.
        switch_guard: Depth-0 steps this close to a speculative step are left out.
        min_steps: Groups with fewer steps are left out (a lone step says little).
        kv_bin_tokens: Width of the KV bins of decode steps.
    """
    runs = [steps] if isinstance(steps, StepArrays) else list(steps)
    keys, values = [], []
    for run in runs:
        spec = (run.depth > 0).astype(np.int64)
        window = np.convolve(spec, np.ones(2 * switch_guard + 1, dtype=np.int64), "same")
        ok = run.latency_s > 0
        decode = ok & (run.prefill_tokens == 0) & (run.batch_size > 0)
        decode &= (run.depth > 0) | (window == 0)
        prefill = ok & (run.prefill_tokens > 0)
        kv_bin = np.floor(run.kv_tokens / kv_bin_tokens).astype(np.int64)
        pf_bin = np.floor(np.log2(np.maximum(run.prefill_tokens, 1))).astype(np.int64)
        for i in np.flatnonzero(decode | prefill):
            if prefill[i]:
                keys.append((0, 0, -1, int(pf_bin[i])))
            else:
                keys.append((int(run.batch_size[i]), int(run.depth[i]), int(kv_bin[i]), -1))
            values.append((run.kv_tokens[i], run.prefill_tokens[i], run.latency_s[i]))
    if not keys:
        raise ValueError("no decode or prefill step with a positive latency")
    key_arr = np.array(keys)
    val_arr = np.array(values)
    groups, inverse, counts = np.unique(key_arr, axis=0, return_inverse=True, return_counts=True)
    inverse = inverse.ravel()
    rows = []
    for g in np.flatnonzero(counts >= min_steps):
        member = val_arr[inverse == g]
        rows.append((groups[g][0], groups[g][1], *np.median(member, axis=0),
                     np.sqrt(counts[g])))
    if not rows:
        raise ValueError(f"no group of steps has {min_steps} members")
    b, d, kv, pf, lat, w = (np.array(col, dtype=np.float64) for col in zip(*rows, strict=True))
    return LatencyPoints(batch_size=b, depth=d, kv_tokens=kv, prefill_tokens=pf, latency_s=lat,
                         weight=w, draft_extend=np.where(pf > 0, True, draft_extend))


def fit_load_profile(steps: StepArrays | Sequence[StepArrays], template: CostProfile,
                     free: Sequence[str], *, draft_extend: bool = False,
                     ties: dict[str, tuple[str, float]] | None = None,
                     ) -> tuple[CostProfile, FitReport]:
    """Fit ``free`` coefficients to :func:`load_points` of ``steps`` (others from ``template``)."""
    points = load_points(steps, draft_extend=draft_extend)
    return fit_profile(points, template=template, free=free, ties=ties)
