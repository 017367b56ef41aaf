"""Fit a profile's prefill terms, per token and per attention token pair, to long prompts
(and per cached token, where prompts followed cached prefixes).

A prompt's attention grows with its square (:func:`env.sim.cost_model.prefill_pairs`), so
the per-token prefill term that :mod:`env.sim.load_fit` fits on prompts of at most 1,024
tokens underprices long ones: on the H200 a lone 3,968-token prefill took 120 ms against
66 ms from that term (``docs/FIDELITY.md`` run 12). :func:`fit_prefill_terms` keeps every
other coefficient of a profile and refits ``c_prefill_token`` and ``c_prefill_pair`` on
the prefill steps of a trace that recorded prompts of tens to thousands of tokens
(``scripts/h200/fidelity_explore.py record``).

**Which steps.** A trace recorded by the plugin since the eighth session holds each prefill
step's attention pairs (``prefill_pairs``, from SGLang's ``prefix_lens`` and
``extend_lens``): every such step is used, and its prompts' cached tokens (for
``c_prefill_cached_token``) are read back from its pairs (:func:`cached_tokens`). Older
traces record a step's tokens and requests, not each prompt's length or cached prefix,
so only steps whose pairs can be
reckoned are used: every prompt in the step is whole (the step is not a full chunk and
does not follow one, so it neither ends a chunked prompt nor starts one) and the prompts
in a step are of one length (true of the recording design: every batch is of one prompt
length), so a step of ``T`` tokens over ``b`` prompts has ``b * prefill_pairs(T / b)``
pairs. Radix-cache hits would break the second assumption: the recording runs with
``--disable-radix-cache``. Steps are grouped by (tokens, requests, pairs) after
:func:`env.sim.load_fit.prefill_attributed` (what a prefill costs the decode steps next
to it moved onto it). A group's point is its *median*, not the
mean :func:`env.sim.load_fit.load_points` takes: with overlap scheduling part of one step's
time lands on the next, and a prefill next to another prefill is not corrected (the MoE's
record trace: lone 3,584-token prefills of 81 and 269 ms, the step after the slow one 11
ms), so a group's mean carries its neighbours' time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from env.sim.cost_model import CostProfile, FitReport, LatencyPoints, fit_profile, prefill_pairs
from env.sim.load_fit import StepArrays, prefill_attributed

#: The coefficients :func:`fit_prefill_terms` fits.
PREFILL_TERMS = ("c_prefill_token", "c_prefill_pair")
#: Also fitted where some steps computed prompts after a cached prefix.
CACHED_TERM = "c_prefill_cached_token"
#: Groups whose error in a first fit is over this many times the median are left out of
#: the second.
TRIM_RATIO = 3.0


def whole_prompt_steps(run: StepArrays, chunk_tokens: int) -> np.ndarray:
    """Mask of ``run``'s prefill steps whose prompts are all computed whole in the step.

    A step of ``chunk_tokens`` (the server's ``--chunked-prefill-size``) may end with a
    chunk of a longer prompt, and the next prefill step may start with that prompt's
    rest (whose pairs include the earlier chunk): both are left out.
    """
    prefill = run.prefill_tokens > 0
    full = prefill & (run.prefill_tokens >= chunk_tokens)
    previous_full = np.zeros_like(full)
    last_full = False
    for i in np.flatnonzero(prefill):  # the prefill step before, decode steps between or not
        previous_full[i] = last_full
        last_full = bool(full[i])
    return prefill & ~full & ~previous_full


def prefill_points(steps: StepArrays | Sequence[StepArrays], chunk_tokens: int,
                   min_steps: int = 2) -> LatencyPoints:
    """One point per (tokens, requests, pairs) group of prefill steps whose pairs are known:
    recorded in the trace (any prefill step: chunked, after a cached prefix, prompts of
    mixed lengths), else reckoned for whole prompts of one length per step."""
    runs = [steps] if isinstance(steps, StepArrays) else list(steps)
    groups: dict[tuple[int, int, int], list[tuple[float, float]]] = {}
    for run in runs:
        latency = prefill_attributed(run)
        recorded = (run.prefill_pairs if run.prefill_pairs is not None
                    else np.full(len(latency), np.nan))
        known = np.isfinite(recorded) & (run.prefill_tokens > 0)
        whole = whole_prompt_steps(run, chunk_tokens) & run.prefills_measured
        use = (known | whole) & (latency > 0) & (run.batch_size > 0)
        for i in np.flatnonzero(use):
            tokens, requests = int(run.prefill_tokens[i]), int(run.batch_size[i])
            pairs = recorded[i] if known[i] else requests * prefill_pairs(tokens / requests)
            groups.setdefault((tokens, requests, round(pairs)), []).append(
                (float(run.kv_tokens[i]), float(latency[i])))
    rows = []
    for (tokens, requests, pairs), members in sorted(groups.items()):
        if len(members) < min_steps:
            continue
        kv, latency = (np.array(col) for col in zip(*members, strict=True))
        rows.append((np.median(kv), tokens, pairs, cached_tokens(tokens, requests, pairs),
                     np.median(latency), np.sqrt(len(members))))
    if len(rows) < len(PREFILL_TERMS):
        raise ValueError(f"{len(rows)} group(s) of prefill steps with known attention pairs "
                         f"and at least {min_steps} steps each: the prefill terms need prompts "
                         "of several lengths (scripts/h200/fidelity_explore.py record)")
    kv, tokens, pairs, cached, latency, weight = (np.array(col, dtype=np.float64)
                                                  for col in zip(*rows, strict=True))
    zeros = np.zeros_like(tokens)
    return LatencyPoints(batch_size=zeros, depth=zeros, kv_tokens=kv, prefill_tokens=tokens,
                         latency_s=latency, weight=weight, draft_extend=np.ones_like(tokens, bool),
                         prefill_pairs=pairs, prefill_cached_tokens=cached)


def cached_tokens(tokens: int, requests: int, pairs: float) -> float:
    """The cached tokens (prefixes, earlier chunks) behind a prefill step of ``tokens`` new
    tokens over ``requests`` prompts with ``pairs`` attention pairs, were every prompt's new
    part of one length ``n = tokens / requests``: ``pairs = cached * n + requests * n (n + 1)
    / 2`` (:func:`env.sim.cost_model.prefill_pairs`). Exact for one prompt per step and for
    the recording design; prompts of unequal new lengths read as a little cached prefix
    (two prompts of 100 and 300 new tokens: 50)."""
    if tokens <= 0 or requests <= 0:
        return 0.0
    new = tokens / requests
    return max(0.0, round((pairs - requests * new * (new + 1.0) / 2.0) / new))


def fit_prefill_terms(profile: CostProfile, steps: StepArrays | Sequence[StepArrays],
                      chunk_tokens: int | None = None) -> tuple[CostProfile, FitReport]:
    """``profile`` with ``c_prefill_token`` and ``c_prefill_pair`` fitted to ``steps``'
    prefill steps whose pairs are known, and ``c_prefill_cached_token`` where some of them
    computed prompts after cached prefixes (:func:`cached_tokens`; NNLS on relative
    errors, every other coefficient kept),
    then again without the groups the first fit misses by over ``TRIM_RATIO`` x its median
    error (the report's notes say how many).

    ``chunk_tokens`` defaults to the profile's ``server.chunked_prefill_tokens``.
    """
    chunk = chunk_tokens or profile.server.chunked_prefill_tokens
    points = prefill_points(steps, chunk)
    free = PREFILL_TERMS + ((CACHED_TERM,) if (points.prefill_cached_tokens > 0).any() else ())
    fitted, report = fit_profile(points, template=profile, free=free, ties={})
    # One trimming pass: a group whose steps mostly carry a neighbour's time (the MoE
    # record's lone 3,584-token prompts: 180 ms where the lone-prompt probes' time to first
    # token says about 95) would pull two coefficients fitted on a dozen groups.
    errors = np.abs(report.relative_errors)
    keep = errors <= TRIM_RATIO * np.median(errors)
    if keep.all() or keep.sum() < len(free) + 1:
        return fitted, report
    trimmed = LatencyPoints(**{name: None if value is None else value[keep] for name, value in (
        (f.name, getattr(points, f.name)) for f in dataclasses.fields(points))})
    free = PREFILL_TERMS + ((CACHED_TERM,) if (trimmed.prefill_cached_tokens > 0).any() else ())
    fitted, report = fit_profile(trimmed, template=profile, free=free, ties={})
    note = (f"{int((~keep).sum())} group(s) over {TRIM_RATIO:g}x the first fit's median "
            "|error| left out")
    return fitted, dataclasses.replace(report, notes=(*report.notes, note))
