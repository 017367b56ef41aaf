"""Fit a cost profile to every step of a recorded trace, KV use and prefill included.

:func:`env.sim.cost_model.fit_profile_from_trace` reduces decode steps to one median per
(batch size, depth) cell, which keeps the per-request term but throws away how latency
grows with the KV cache at a fixed batch size, and uses prefill steps only for one
per-token number. Under a replayed workload both matter: long prompts make the KV cache
several times larger than in a 256-token explore run at the same batch size, and prefill
steps of tens to thousands of tokens take a large share of the time.

**Points.** Decode steps are grouped by (batch size, depth, KV bin), prefill steps by the
log2 bin of their token count; each group gives its *mean* latency (the simulator adds
latencies up; steps over ``OUTLIER_RATIO`` x the group median are idle time and left
out), weighted by the square root of its size. Before that, what a prefill costs its
neighbours is moved onto it (:func:`prefill_attributed`). The free coefficients are
fitted jointly by :func:`env.sim.cost_model.fit_profile` (NNLS on relative errors).

**KV is paid far more on the speculative path** (``c_steps0_kv`` of
:mod:`env.sim.cost_model`): about 500 ns per cached token on the dense model's verify steps
and ~1 µs on the MoE's (fitted to its replay traces; 0.6 µs within one batch size), against
~40 ns for a plain decode step (``c_kv``; dense: 37-47 ns within one batch size, with or
without requests waiting; reading 128 KiB per token at 4.8 TB/s takes 27 ns). A verify
step, like SGLang's own steps=0, runs the target in ``TARGET_VERIFY`` mode through the
extend-attention kernel over the whole prefix with a custom mask. Each point says whether
it ran on the speculative path. (A prefill step's latency does not grow with the cache the
other requests hold, dense off trace; the simulator charges ``c_kv`` on it all the same,
and so does this fit, so the two agree.)

Steps are taken as the simulator runs them: a prefill step is ``batch_size = 0`` with the
prompt tokens it computed; depth-0 steps are the plain decode of the plugin's off path
(``draft_extend=False``) unless told otherwise. Depth-0 steps within ``switch_guard``
steps of a speculative step are left out: a warm-up (SGLang's own steps=0, run once when
speculation comes back) is recorded as depth 0 too and costs about a verify step.
With depth-0 steps only, ``c_request`` (batch), ``c_token`` (batch + prompt) and
``c_prefill_token`` (prompt) are dependent: free two of them, not three.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from env.sim.cost_model import CostProfile, FitReport, LatencyPoints, fit_profile
from env.traces.trace_format import read_packed_trace

#: A step this many times slower than its group's median is idle time, not work.
OUTLIER_RATIO = 5.0
#: Decode steps are binned by KV use in bins of this many tokens.
KV_BIN_TOKENS = 4096
#: Coefficients a plain decode + prefill trace identifies. At depth 0 the columns of
#: c_request (batch), c_token (batch + prompt) and c_prefill_token (prompt) are dependent:
#: c_token stays at 0 there (a decode step's per-token cost is in c_request) so that the
#: prompt's per-token cost, several times a decode token's, goes to c_prefill_token and
#: not into every decode step. An MoE adds ``c_moe``.
BASE_TERMS = ("c_fixed", "c_request", "c_prefill_token")
#: Speculative terms, the verify-mode KV cost c_steps0_kv among them. c_token is identified
#: by the depths; c_verify_token is left at 0 (with c_request, c_token, c_draft_token and
#: c_prefill_token free its column is a combination of theirs).
SPEC_TERMS = ("c_token", "c_steps0_kv", "c_verify", "c_draft", "c_draft_token")
@dataclass(frozen=True)
class StepArrays:
    """One server's steps, in step order (the lowest rank of a recorded trace).

    ``prefills_measured=False`` keeps the run's prefill steps out of the fit: on a server
    with the radix (prefix) cache on, a prefill step counts only the tokens the cache did
    not hold, so its latency says nothing about a prefill of that many tokens. ``time_s``
    (when each step was recorded) lets :meth:`phases` split a trace that holds several
    runs one after another.
    """

    batch_size: np.ndarray
    depth: np.ndarray
    kv_tokens: np.ndarray
    prefill_tokens: np.ndarray
    latency_s: np.ndarray
    prefills_measured: bool = True
    time_s: np.ndarray | None = None
    decodes_measured: bool = True
    #: Each prefill step's recorded attention token pairs (NaN where not recorded).
    prefill_pairs: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.latency_s)
        for name in ("batch_size", "depth", "kv_tokens", "prefill_tokens", "time_s",
                     "prefill_pairs"):
            if getattr(self, name) is not None and len(getattr(self, name)) != n:
                raise ValueError(f"StepArrays.{name} has {len(getattr(self, name))} entries, "
                                 f"expected {n} (one per step)")

    @classmethod
    def load(cls, path: str | os.PathLike, prefills_measured: bool = True) -> StepArrays:
        """The steps of a recorded trace folder, or of a ``.tar.gz`` holding one folder."""
        return cls.from_trace(read_packed_trace(path), prefills_measured)

    @classmethod
    def from_trace(cls, trace, prefills_measured: bool = True) -> StepArrays:
        """The steps of a :class:`~env.traces.trace_format.Trace`, lowest rank, in step order."""
        cols = trace.step_columns()
        if not len(cols):
            raise ValueError("the trace holds no step records")
        servers = cols.server.astype(str)
        if len(np.unique(servers)) != 1:
            raise ValueError(f"the trace holds several servers {sorted(set(servers))}; "
                             "fit one server at a time")
        keep = cols.rank == cols.rank.min()
        # One recording session numbers its steps once. Repeats mean the folder holds
        # several servers' files (a warm GPU machine kept an earlier run's folder): their
        # steps would interleave, each series on its own clock, and no fit may mix them.
        indexes, counts = np.unique(cols.step_index[keep], return_counts=True)
        if (counts > 1).any():
            raise ValueError(
                f"the trace's rank {int(cols.rank.min())} numbers {int((counts > 1).sum())} "
                f"steps more than once (step_index {int(indexes[counts > 1][0])} first): it "
                "holds several recording sessions; keep one session's files per folder "
                "(the file names' start time and id tell them apart)")
        order = np.lexsort((cols.step_index[keep], cols.time_s[keep]))
        return cls(cols.batch_size[keep][order].astype(np.int64),
                   cols.steps_used[keep][order].astype(np.int64),
                   cols.kv_used_tokens[keep][order].astype(np.float64),
                   cols.prefill_tokens[keep][order].astype(np.int64),
                   cols.step_latency_s[keep][order].astype(np.float64), prefills_measured,
                   cols.time_s[keep][order].astype(np.float64),
                   prefill_pairs=cols.prefill_pairs[keep][order].astype(np.float64))

    def phases(self, count: int, edge: float = 0.05) -> list[StepArrays]:
        """The trace cut into ``count`` runs at its ``count - 1`` longest pauses between steps.

        A trace recorded over several runs on one server (``offswitch.py``'s replays: one
        policy, then the next) holds them in time order with a pause between them. Pauses
        within the first and last ``edge`` of the steps (server warm-up, the last drain)
        are not cuts. Lets a fit use one run of a trace and leave the other held out.
        """
        if self.time_s is None:
            raise ValueError("StepArrays.phases needs time_s (use StepArrays.from_trace)")
        n = len(self.latency_s)
        if count < 1 or n < 2 * count:
            raise ValueError(f"cannot cut {n} steps into {count} phases")
        gaps = np.diff(self.time_s)
        lo, hi = int(edge * n), n - 1 - int(edge * n)
        cuts = sorted(lo + np.argsort(gaps[lo:hi])[::-1][: count - 1] + 1)
        bounds = [0, *cuts, n]
        return [dataclasses.replace(
                    self, **{name: getattr(self, name)[a:b] for name in
                             ("batch_size", "depth", "kv_tokens", "prefill_tokens", "latency_s",
                              "time_s", "prefill_pairs") if getattr(self, name) is not None})
                for a, b in itertools.pairwise(bounds)]


def prefill_attributed(run: StepArrays, kv_bin_tokens: int = KV_BIN_TOKENS) -> np.ndarray:
    """``run``'s step latencies with what prefills cost their neighbours moved onto them.

    With overlap scheduling the plugin times a step from the previous result to its own,
    so part of a prefill's cost lands on the decode step before it (twice a clean decode
    step in the dense off trace: 11-15 ms against 5-7 ms) and some on the one after. The
    simulator charges a prefill's cost to the prefill step, so a decode step next to a
    prefill keeps the median of its group's clean steps (same batch, depth and KV bin,
    no prefill next to them) and its excess goes to the adjacent prefill (the next
    step if that is one, else the previous). Sums are kept. (A decode step holds no idle
    time: the server does not idle with requests running; idle time lands on the prefill
    of the next arrival, and :func:`load_points` leaves such steps out.)
    """
    latency = run.latency_s.copy()
    prefill = run.prefill_tokens > 0
    decode = ~prefill & (run.batch_size > 0) & (latency > 0)
    prev_pf = np.r_[False, prefill[:-1]]
    next_pf = np.r_[prefill[1:], False]
    keys = list(zip(run.batch_size.tolist(), run.depth.tolist(),
                    (run.kv_tokens // kv_bin_tokens).astype(np.int64).tolist(), strict=True))
    clean: dict[tuple, list[float]] = {}
    for i in np.flatnonzero(decode & ~prev_pf & ~next_pf):
        clean.setdefault(keys[i], []).append(latency[i])
    medians = {k: float(np.median(v)) for k, v in clean.items()}
    for i in np.flatnonzero(decode & (prev_pf | next_pf)):
        base = medians.get(keys[i])
        if base is None or latency[i] <= base:
            continue
        target = i + 1 if next_pf[i] else i - 1
        latency[target] += latency[i] - base
        latency[i] = base
    return latency


def load_points(steps: StepArrays | Sequence[StepArrays], *, draft_extend: bool = False,
                switch_guard: int = 5, min_steps: int = 3,
                kv_bin_tokens: int = KV_BIN_TOKENS, plain_only: bool = False,
                speculative_only: bool = False) -> LatencyPoints:
    """Group medians of decode and prefill steps as fit points (see the module docstring).

    Args:
        steps: One or more servers' steps (each in step order).
        draft_extend: Whether depth-0 decode steps ran the draft extend (SGLang's own
            steps=0) rather than a plain decode.
        switch_guard: Depth-0 steps this close to a speculative step are left out.
        min_steps: Groups with fewer steps are left out (a lone step says little).
        kv_bin_tokens: Width of the KV bins of decode steps.
        plain_only: Leave out speculative decode steps (to fit a server without
            speculation from the off path's steps).
        speculative_only: Keep speculative decode steps alone (to fit verify terms on top
            of a plain profile, :func:`fit_speculative_on_plain`).
    """
    if plain_only and speculative_only:
        raise ValueError("plain_only and speculative_only exclude each other")
    runs = [steps] if isinstance(steps, StepArrays) else list(steps)
    keys, values = [], []
    for run in runs:
        spec = (run.depth > 0).astype(np.int64)
        window = np.convolve(spec, np.ones(2 * switch_guard + 1, dtype=np.int64), "same")
        latency = prefill_attributed(run, kv_bin_tokens)
        ok = latency > 0
        decode = ok & (run.prefill_tokens == 0) & (run.batch_size > 0)
        decode &= ((run.depth > 0) & (not plain_only)) | ((window == 0) & (not speculative_only))
        decode &= run.decodes_measured
        prefill = ok & (run.prefill_tokens > 0) & run.prefills_measured & (not speculative_only)
        kv_bin = np.floor(run.kv_tokens / kv_bin_tokens).astype(np.int64)
        pf_bin = np.floor(np.log2(np.maximum(run.prefill_tokens, 1))).astype(np.int64)
        for i in np.flatnonzero(decode | prefill):
            if prefill[i]:
                keys.append((0, 0, -1, int(pf_bin[i])))
            else:
                keys.append((int(run.batch_size[i]), int(run.depth[i]), int(kv_bin[i]), -1))
            values.append((run.kv_tokens[i], run.prefill_tokens[i], latency[i]))
    if not keys:
        raise ValueError("no decode or prefill step with a positive latency")
    key_arr = np.array(keys)
    val_arr = np.array(values)
    groups, inverse, counts = np.unique(key_arr, axis=0, return_inverse=True, return_counts=True)
    inverse = inverse.ravel()
    rows = []
    for g in np.flatnonzero(counts >= min_steps):
        member = val_arr[inverse == g]
        latency = member[:, 2]
        # The simulator adds step latencies up, so a group's point is its *mean* latency
        # (steps next to a prefill are slower and count), leaving out steps over
        # OUTLIER_RATIO x the group's median: idle time before a step, not work.
        work = latency <= OUTLIER_RATIO * np.median(latency)
        rows.append((groups[g][0], groups[g][1], *np.median(member[:, :2], axis=0),
                     latency[work].mean(), np.sqrt(counts[g])))
    if not rows:
        raise ValueError(f"no group of steps has {min_steps} members")
    b, d, kv, pf, lat, w = (np.array(col, dtype=np.float64) for col in zip(*rows, strict=True))
    ext = np.where(pf > 0, True, draft_extend)
    return LatencyPoints(batch_size=b, depth=d, kv_tokens=kv, prefill_tokens=pf, latency_s=lat,
                         weight=w, draft_extend=ext, speculative_path=(d > 0) | ext)


def clean_decode_steps(run: StepArrays, depth: int, switch_guard: int = 5) -> np.ndarray:
    """Mask of ``run``'s decode steps at ``depth`` that show that depth's own cost.

    Left out: steps next to a prefill (:func:`prefill_attributed`), and at depth 0 steps
    within ``switch_guard`` steps of a speculative one (a warm-up is recorded as depth 0).
    """
    prefill = run.prefill_tokens > 0
    near = np.r_[False, prefill[:-1]] | np.r_[prefill[1:], False]
    ok = (run.depth == depth) & ~prefill & ~near & (run.batch_size > 0) & (run.latency_s > 0)
    if depth == 0:
        spec = (run.depth > 0).astype(np.int64)
        ok &= np.convolve(spec, np.ones(2 * switch_guard + 1, dtype=np.int64), "same") == 0
    return ok


def step_medians(run: StepArrays, depth: int, min_steps: int = 5) -> dict[int, tuple[float, float]]:
    """Per batch size with ``min_steps`` clean steps at ``depth``: median latency (s) and
    median KV tokens (:func:`clean_decode_steps`)."""
    ok = clean_decode_steps(run, depth)
    out = {}
    for b in np.unique(run.batch_size[ok]):
        member = ok & (run.batch_size == b)
        if member.sum() >= min_steps:
            out[int(b)] = (float(np.median(run.latency_s[member])),
                           float(np.median(run.kv_tokens[member])))
    return out


def within_batch_kv_slope(steps: StepArrays | Sequence[StepArrays], depth: int = 0, *,
                          min_steps: int = 5, min_kv_range: float = 1000.0) -> float:
    """Seconds per cached token of decode steps at ``depth``, within one batch size.

    Latency and KV use are demeaned per batch size (no per-request term can absorb what is
    left) and regressed through the origin. Steps next to a prefill, depth-0 steps next to
    a speculative one (``load_points``' guard) and steps over ``OUTLIER_RATIO`` x their
    batch's median are left out; batch sizes with fewer than ``min_steps`` steps or a KV
    range under ``min_kv_range`` tokens say nothing. Why: where every request holds about
    as many cached tokens (one-batch sweeps) the KV column moves with the batch and a
    joint fit cannot place the cost; the slope within a batch size in another trace can
    (e.g. the MoE's plain decode: 34-36 ns per token in its replays, whose token-100
    routing changes the expert reads but not the attention over the cache).
    """
    xs, ys = [], []
    for run in [steps] if isinstance(steps, StepArrays) else steps:
        ok = clean_decode_steps(run, depth)
        for b in np.unique(run.batch_size[ok]):
            member = ok & (run.batch_size == b)
            kv, latency = run.kv_tokens[member], run.latency_s[member]
            keep = latency <= OUTLIER_RATIO * np.median(latency)
            kv, latency = kv[keep], latency[keep]
            if len(kv) < min_steps or np.ptp(kv) < min_kv_range:
                continue
            xs.append(kv - kv.mean())
            ys.append(latency - latency.mean())
    if not xs:
        raise ValueError(f"no batch size has {min_steps} depth-{depth} decode steps spanning "
                         f"{min_kv_range:.0f} KV tokens")
    x, y = np.concatenate(xs), np.concatenate(ys)
    return float(x @ y / (x @ x))


def fit_load_profile(steps: StepArrays | Sequence[StepArrays], template: CostProfile,
                     free: Sequence[str], *, draft_extend: bool = False,
                     ties: dict[str, tuple[str, float]] | None = None,
                     plain_only: bool = False) -> tuple[CostProfile, FitReport]:
    """Fit ``free`` coefficients to :func:`load_points` of ``steps`` (others from ``template``)."""
    points = load_points(steps, draft_extend=draft_extend, plain_only=plain_only)
    return fit_profile(points, template=template, free=free, ties=ties)


def blank_template(template: CostProfile, moe_active_fraction: float = 0.0) -> CostProfile:
    """``template`` (server limits, descriptors, priors) with every term a fit sets at 0."""
    return template.replace(moe_active_fraction=moe_active_fraction, c_kv=0.0, c_token=0.0,
                            c_prefill_token=0.0, c_steps0=0.0, c_steps0_request=0.0,
                            c_steps0_kv=0.0)


#: Shares of a fresh token's experts a verified draft token may add
#: (``CostProfile.moe_draft_token_share``), tried by :func:`fit_speculative_on_plain`.
MOE_DRAFT_TOKEN_SHARES = (1.0, 0.75, 0.5, 0.25, 0.1, 0.0)
#: Speculative terms fitted on top of a plain profile. With the plain per-request cost
#: fixed, a verify step's own per-request cost (``c_verify_token``) is identified.
STACKED_SPEC_TERMS = ("c_verify", "c_verify_token", "c_draft", "c_draft_token", "c_steps0_kv")


def fit_speculative_on_plain(steps: Sequence[StepArrays], plain: CostProfile,
                             shares: Sequence[float] = MOE_DRAFT_TOKEN_SHARES,
                             ) -> tuple[CostProfile, FitReport, dict[float, float]]:
    """A speculative server as ``plain`` (its server without speculation) plus verify and
    draft terms, fitted to the speculative decode steps of ``steps`` only.

    The plugin's off path runs the plain decode, so its steps cost what ``plain`` says
    (run 9: the MoE's within 0-2% at batch 1, 16 and 48), and a joint fit that also bends
    the plain terms to the speculative steps gets neither right. For an MoE the share of
    a fresh token's experts a draft token adds is chosen from ``shares`` by the fit's
    median error. Returns the profile, its fit report and the median error per share.
    """
    if not any((run.depth > 0).any() for run in steps):
        raise ValueError("no speculative decode step to fit the verify and draft terms to")
    points = load_points(steps, speculative_only=True)
    best: tuple[CostProfile, FitReport] | None = None
    errors: dict[float, float] = {}
    for share in (shares if plain.moe_active_fraction else (1.0,)):
        profile, report = fit_profile(points, template=plain.replace(
            moe_draft_token_share=float(share)), free=STACKED_SPEC_TERMS)
        errors[float(share)] = report.median_abs_error
        if best is None or report.median_abs_error < best[1].median_abs_error:
            best = profile, report
    assert best is not None
    return best[0], best[1], errors


def fit_server_profile(steps: Sequence[StepArrays], template: CostProfile, *,
                       speculative: bool, plain_runs: Sequence[StepArrays] | None = None,
                       ) -> tuple[CostProfile, FitReport]:
    """A server's profile from its steps, the way ``docs/FIDELITY.md`` fits them.

    ``c_kv`` (a plain decode's KV cost) is set to :func:`within_batch_kv_slope` of
    ``plain_runs`` (default ``steps``: the runs whose depth-0 steps are plain decodes), not
    fitted jointly: in a one-batch sweep every request holds about as many cached tokens and
    a joint fit puts that cost on ``c_request``. Free: ``BASE_TERMS`` (+ ``c_moe`` for an MoE
    template), and ``SPEC_TERMS`` when ``speculative``; without, the fit takes plain decode
    and prefill steps only (``plain_only``).
    """
    c_kv = within_batch_kv_slope(plain_runs if plain_runs is not None else steps)
    free = BASE_TERMS + (("c_moe",) if template.moe_active_fraction else ())
    free += SPEC_TERMS if speculative else ()
    return fit_load_profile(steps, template.replace(c_kv=c_kv), free,
                            plain_only=not speculative)
