"""Step-latency model of a speculative-decoding server (EAGLE, chain drafting).

A :class:`CostProfile` predicts the wall time of one scheduler step from what
the step does: ``batch`` decoding requests verifying ``depth`` drafts each,
``prefill_tokens`` prompt tokens, and ``kv_tokens`` KV-cache entries read.
With ``T = batch * (depth + 1) + prefill_tokens`` target tokens::

    latency = c_fixed                                   # weights read, launches, fixed CPU work
            + c_request * batch                         # per-request scheduler/sampling work
            + c_token * T                               # target compute per token
            + c_prefill_token * prefill_tokens          # prompt compute beyond that
            + c_prefill_pair * prefill_pairs            # prompt attention (token pairs)
            + c_prefill_cached_token * cached_tokens    # cached prefixes the prompts read
            + c_moe * (1 - (1 - f)**T_moe)              # MoE expert weights read (f = k/E)
            + c_kv * kv_tokens                          # attention reads the KV cache
            + [depth > 0] * (c_verify + c_verify_token * batch)   # verify-path overhead
            + max(depth - 1, 0) * (c_draft + c_draft_token * batch)  # draft forwards
            + [extend] * (c_extend + c_extend_token * T)          # draft extend after verify
            + [batch > cuda_graph_max_bs] * (c_eager + c_eager_token * batch)  # no CUDA graph
            + [spec path] * (c_steps0 + c_steps0_request * batch   # speculative decode path
                             + c_steps0_kv * kv_tokens)                # verify-mode attention

Every coefficient is in seconds (per unit of its term) and non-negative:

* ``c_fixed``: per step, independent of the batch: reading the dense weights
  once (model bytes / memory bandwidth is a floor for it), kernel launches,
  the scheduler's fixed CPU work.
* ``c_request``: per decoding request: scheduler bookkeeping, sampling and
  per-sequence kernels; with overlap scheduling it is mostly CPU time.
* ``c_token``: per target token computed (verified or prefilled): GEMM compute
  and, for tensor parallelism, all-reduce volume.
* ``c_prefill_token``: per prompt token, on top of ``c_token``. Decode and verify
  steps compute a few hundred tokens at most and are memory-bound, so fits to
  them give a small ``c_token``; a prefill chunk of thousands of tokens is
  compute-bound (about 2 x parameters FLOPs per token at the GPU's achievable
  rate). Fitted to prefill steps where a trace has them.
* ``c_prefill_pair``: per *token pair* of a prompt's attention: each prompt token
  computed attends to every earlier token of its own prompt (cached prefix and earlier
  chunks included), so a prompt of ``n`` new tokens after ``p`` already in the cache
  has ``n * (p + n / 2)`` pairs (:func:`prefill_pairs`). Quadratic in the prompt: on
  the H200's Triton attention backend a lone 3,968-token prefill took 120 ms where
  the per-token terms fitted on prompts of at most 1,024 tokens gave 66 ms
  (``docs/FIDELITY.md`` run 12). Zero in a profile fitted without long prompts.
* ``c_prefill_cached_token``: per token already in the cache (a cached prefix, earlier
  chunks) of each prompt computed in the step, on top of its pairs. The extend-attention
  kernel walks a prompt's cached part block by block for each block of new tokens, so
  a few new tokens after a long prefix cost far more than their pairs: on the H200 MoE a
  64-token prompt's time to first token rose 7.4 ms per 1,000 cached tokens (0.12 us
  per pair; ``docs/FIDELITY.md`` run 14). Zero in a profile fitted without cached
  prefixes.
* ``c_moe``: time to read *all* routed experts' weights once; a step touching
  ``T_moe`` tokens, each routed to ``k`` of ``E`` experts, reads the expected
  fraction ``1 - (1 - k/E)**T_moe`` of them (uniform, independent routing). Zero for
  a dense model. This term makes an MoE step's cost grow steeply with tokens
  until every expert is read. ``T_moe = batch * (1 + s * depth) + prefill_tokens``
  with ``s = moe_draft_token_share`` (default 1: ``T_moe = T``): the draft tokens a
  request verifies continue its own text and share its experts, so on real text
  each adds only a share ``s`` of a fresh token's experts (the H200 MoE's real-token
  traces: ``s`` = 0.25, ``docs/FIDELITY.md`` run 9).
* ``c_kv``: per KV-cache token read by attention (bytes per token / bandwidth);
  verify attention reads a request's cache once for all its query tokens.
* ``c_verify``, ``c_verify_token``: work a speculative (verify) step does on
  top of a plain decode step: tree/mask setup, acceptance bookkeeping.
* ``c_draft``, ``c_draft_token``: one autoregressive draft-model forward.
  SGLang runs ``depth - 1`` of them: the first draft token comes from the
  draft extend of the previous step.
* ``c_extend``, ``c_extend_token``: the draft model's extend over the tokens
  the target just computed (accepted tokens after a verify, the prompt after a
  prefill). It runs when ``depth > 0``, and at ``depth == 0`` too unless
  ``draft_extend=False`` (SGLang's default keeps the draft warm at steps=0;
  ``SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND=1`` skips it). A server without
  speculation is ``depth=0, draft_extend=False``.
* ``c_eager``, ``c_eager_token``: extra cost of a decode batch larger than the
  largest captured CUDA graph (``server.cuda_graph_max_bs``).
* ``c_steps0``, ``c_steps0_request``: what every decode step on SGLang's
  speculative path pays over a server without speculation, whatever its depth:
  the target forward in verify mode and the speculative bookkeeping. SGLang's
  own ``steps=0`` pays it (measured on an H200 with SGLang 0.5.15: a steps=0
  step costs 1.3-2.9x a no-speculation server's, and skipping the draft extend
  changed nothing measurable); a real off switch (the plugin runs the target's
  plain decode graph, ``speculative_path=False``) does not. It is *part of*
  every speculative step's cost, so fitting it moves cost out of ``c_fixed`` /
  ``c_request`` without changing any speculative or steps=0 latency.
* ``c_steps0_kv``: per cached token, on the speculative path only: the verify-mode
  target forward attends over each request's whole prefix with SGLang's
  extend-attention kernel and a custom mask, far slower per token than the decode
  kernel (H200 traces, ``docs/FIDELITY.md``: about 450 ns per cached token on a
  Llama-3.1-8B shape against 0-4 ns for a plain decode step, which ``c_kv`` holds).

The prefill's launch, booked on the decode step before it (``prefill_launch_s``,
``prefill_launch_hidden``; not a coefficient of the formula above, no column of
:func:`design_matrix`). Under SGLang's overlap scheduler the next batch is launched before a
step's result is processed, and the plugin times a step from the previous result to its
own, so the CPU work of launching a prefill lands on the decode step before it, less what
that step's own GPU work hides::

    booked = max(0, prefill_launch_s - prefill_launch_hidden * own decode step latency)

(:meth:`CostProfile.prefill_launch_booked_s`). Measured on the H200 traces of runs 46-69
(``docs/results/gpu22``): a fixed cost, independent of the prefill's tokens, its requests
and the queue; dense 8.0 ms less 0.36 of the step's own latency, MoE 4.8 ms less 0.24. The
simulator moves it: the decode step before a prefill is that much longer and the prefill
that much shorter, so the sum of step latencies, the wall clock, is what it was without it
(profiles fitted by ``env.sim.load_fit`` have it in their prefill cost already,
``prefill_attributed``; the shipped dense H200 profiles' prefill cost lies between a
prefill record of runs 61-68 and that record plus the booking: ``docs/results/gpu22``,
table 4). 0 (the default) books nothing.

Three kinds of depth-0 decode step:

* **off** (``depth=0, draft_extend=False, speculative_path=False``): a server
  without speculation, or the plugin's off path; the simulator's action 0.
* **SGLang steps=0** (``depth=0``, the defaults): the speculative path with
  the draft extend (``sim.zero_step=sglang_steps0``).
* **steps=0 without the extend** (``draft_extend=False``):
  ``SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND=1``.

``batch`` counts decoding requests only; a prefill-only step is ``batch=0,
prefill_tokens>0``.

Profiles are YAML files (shipped ones under ``env/sim/profiles``) that also hold the
server's limits, model and hardware descriptors, the acceptance model the
benchmarks should use by default, and provenance (what the coefficients were
calibrated to). :func:`fit_profile` fits coefficients to measured step
latencies by non-negative least squares on relative errors.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import yaml

log = logging.getLogger(__name__)

#: Coefficients a profile file may leave out when they are 0 (read as 0).
_OPTIONAL_COEFFICIENTS = frozenset({"c_prefill_pair", "c_prefill_cached_token"})

#: Coefficient names, in the order of :func:`design_matrix` columns.
COEFFICIENTS: tuple[str, ...] = (
    "c_fixed",
    "c_request",
    "c_token",
    "c_moe",
    "c_kv",
    "c_verify",
    "c_verify_token",
    "c_draft",
    "c_draft_token",
    "c_extend",
    "c_extend_token",
    "c_eager",
    "c_eager_token",
    "c_prefill_token",
    "c_prefill_pair",
    "c_steps0",
    "c_steps0_request",
    "c_steps0_kv",
    # Last, so the columns before it keep their places.
    "c_prefill_cached_token",
)

#: Coefficients :func:`fit_profile` fits by default (the rest keep the template's values).
DEFAULT_FREE: tuple[str, ...] = (
    "c_fixed",
    "c_request",
    "c_token",
    "c_verify",
    "c_draft",
    "c_draft_token",
)

#: Default ties ``name -> (other, factor)``. The draft extend is one more forward of
#: the draft model: its fixed cost is a draft forward's, and its per-token compute
#: over the same ``T`` tokens is a small fraction of the target's (one draft layer
#: plus head against a full target model; 5% for an 8B target). Measurements with
#: the extend always on cannot separate these from ``c_fixed`` / ``c_token``.
DEFAULT_TIES: dict[str, tuple[str, float]] = {
    "c_extend": ("c_draft", 1.0),
    "c_extend_token": ("c_token", 0.05),
}


class ProfileError(ValueError):
    """A profile file is invalid; the message names the file and the key."""


class UnidentifiableFitError(ValueError):
    """The points cannot determine some free coefficients (named in ``coefficients``)."""

    def __init__(self, message: str, coefficients: Sequence[str]) -> None:
        super().__init__(message)
        self.coefficients = tuple(coefficients)


@dataclass(frozen=True)
class ServerLimits:
    """Scheduler limits of the server a profile describes.

    Attributes:
        max_running_requests: Requests decoding at once (``--max-running-requests``).
        kv_capacity_tokens: KV-cache slots in all.
        chunked_prefill_tokens: Prompt tokens per prefill step (``--chunked-prefill-size``).
        cuda_graph_max_bs: Largest decode batch run as a CUDA graph; None = no limit.
    """

    max_running_requests: int
    kv_capacity_tokens: int
    chunked_prefill_tokens: int
    cuda_graph_max_bs: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_running_requests", "kv_capacity_tokens", "chunked_prefill_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"server.{name} must be an integer >= 1, got {value!r}")
        cg = self.cuda_graph_max_bs
        if cg is not None and (isinstance(cg, bool) or not isinstance(cg, int) or cg < 0):
            raise ValueError(f"server.cuda_graph_max_bs must be an integer >= 0, got {cg!r}")


@dataclass(frozen=True)
class CostProfile:
    """Step-latency coefficients (seconds) plus server limits and descriptors.

    See the module docstring for the latency formula and each term's meaning.
    """

    name: str
    server: ServerLimits
    c_fixed: float = 0.0
    c_request: float = 0.0
    c_token: float = 0.0
    c_moe: float = 0.0
    c_kv: float = 0.0
    c_verify: float = 0.0
    c_verify_token: float = 0.0
    c_draft: float = 0.0
    c_draft_token: float = 0.0
    c_extend: float = 0.0
    c_extend_token: float = 0.0
    c_eager: float = 0.0
    c_eager_token: float = 0.0
    c_prefill_token: float = 0.0
    c_prefill_pair: float = 0.0
    c_steps0: float = 0.0
    c_steps0_request: float = 0.0
    c_steps0_kv: float = 0.0
    c_prefill_cached_token: float = 0.0
    #: Experts per token over experts (k/E) of an MoE model; 0 for a dense one.
    moe_active_fraction: float = 0.0
    #: The experts a verified draft token adds, as a share of a fresh token's (``T_moe``).
    moe_draft_token_share: float = 1.0
    #: Seconds of a prefill's launch booked on the decode step before it, before hiding
    #: (:meth:`prefill_launch_booked_s`; the module docstring). 0: none booked (profiles
    #: not measured with the plugin under overlap scheduling).
    prefill_launch_s: float = 0.0
    #: Share of that decode step's own latency behind which the launch hides (0: none).
    prefill_launch_hidden: float = 0.0
    description: str = ""
    model: dict = field(default_factory=dict, compare=False)
    hardware: dict = field(default_factory=dict, compare=False)
    acceptance: dict | None = field(default=None, compare=False)
    provenance: dict = field(default_factory=dict, compare=False)
    # Precomputed for the scalar hot path.
    _log_moe: float = field(default=0.0, init=False, repr=False, compare=False)
    _cg_max: float = field(default=math.inf, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in COEFFICIENTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
            object.__setattr__(self, name, float(value))
        f = self.moe_active_fraction
        if not 0.0 <= f <= 1.0:
            raise ValueError(f"moe_active_fraction must be in [0, 1], got {f}")
        object.__setattr__(self, "_log_moe", math.log1p(-f) if 0.0 < f < 1.0 else 0.0)
        share = self.moe_draft_token_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not (
                0.0 <= share <= 1.0):
            raise ValueError(f"moe_draft_token_share must be in [0, 1], got {share!r}")
        object.__setattr__(self, "moe_draft_token_share", float(share))
        for name in ("prefill_launch_s", "prefill_launch_hidden"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
            object.__setattr__(self, name, float(value))
        cg = self.server.cuda_graph_max_bs
        object.__setattr__(self, "_cg_max", math.inf if cg is None else float(cg))

    @property
    def coefficients(self) -> dict[str, float]:
        """The coefficients by name, in :data:`COEFFICIENTS` order."""
        return {name: getattr(self, name) for name in COEFFICIENTS}

    def replace(self, **changes: Any) -> CostProfile:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def step_latency_s(
        self,
        batch_size: int,
        depth: int,
        kv_tokens: int = 0,
        prefill_tokens: int = 0,
        draft_extend: bool = True,
        speculative_path: bool = True,
        prefill_pairs: float = 0.0,
        prefill_cached_tokens: float = 0.0,
    ) -> float:
        """Latency (s) of one step; plain ``math`` so a Python loop can call it per step.

        Args:
            batch_size: Decoding requests in the step (0 for a prefill-only step).
            depth: Draft depth (speculative steps) of the step; 0 = no speculation.
            kv_tokens: KV-cache tokens the step's attention reads.
            prefill_tokens: Prompt tokens computed in the step.
            draft_extend: Whether the draft extend runs at ``depth == 0``.
            speculative_path: Whether a ``depth == 0`` decode step still runs on the
                speculative path (SGLang's steps=0: ``c_steps0`` terms); False is a
                server without speculation. Always True at ``depth > 0``.
            prefill_pairs: Attention token pairs of the prompts computed in the step
                (:func:`prefill_pairs`, summed over them).
            prefill_cached_tokens: Tokens already in the cache of the prompts computed
                in the step, summed over them.
        """
        tokens = batch_size * (depth + 1) + prefill_tokens
        latency = (
            self.c_fixed
            + self.c_request * batch_size
            + self.c_token * tokens
            + self.c_kv * kv_tokens
        )
        if self._log_moe:
            moe_tokens = tokens if self.moe_draft_token_share == 1.0 else (
                batch_size * (1.0 + self.moe_draft_token_share * depth) + prefill_tokens)
            latency += self.c_moe * -math.expm1(moe_tokens * self._log_moe)
        elif self.moe_active_fraction == 1.0 and tokens > 0:
            latency += self.c_moe
        if depth > 0:
            latency += self.c_verify + self.c_verify_token * batch_size
            if depth > 1:
                latency += (depth - 1) * (self.c_draft + self.c_draft_token * batch_size)
            latency += self.c_extend + self.c_extend_token * tokens
        elif draft_extend:
            latency += self.c_extend + self.c_extend_token * tokens
        if batch_size > self._cg_max:
            latency += self.c_eager + self.c_eager_token * batch_size
        if batch_size and (depth > 0 or speculative_path):
            latency += (self.c_steps0 + self.c_steps0_request * batch_size
                        + self.c_steps0_kv * kv_tokens)
        if prefill_tokens:
            latency += (self.c_prefill_token * prefill_tokens + self.c_prefill_pair * prefill_pairs
                        + self.c_prefill_cached_token * prefill_cached_tokens)
        return latency

    def prefill_launch_booked_s(self, own_latency_s: float) -> float:
        """Seconds of the next prefill's launch booked on a decode step whose own latency
        is ``own_latency_s``: ``max(0, prefill_launch_s - prefill_launch_hidden * own)``."""
        return max(0.0, self.prefill_launch_s - self.prefill_launch_hidden * own_latency_s)

    def step_latency_array(
        self,
        batch_size: np.ndarray | int,
        depth: np.ndarray | int,
        kv_tokens: np.ndarray | int = 0,
        prefill_tokens: np.ndarray | int = 0,
        draft_extend: np.ndarray | bool = True,
        speculative_path: np.ndarray | bool = True,
        prefill_pairs: np.ndarray | float = 0.0,
        prefill_cached_tokens: np.ndarray | float = 0.0,
    ) -> np.ndarray:
        """Vectorised :meth:`step_latency_s` (arguments broadcast)."""
        design = design_matrix(
            batch_size,
            depth,
            kv_tokens,
            prefill_tokens,
            draft_extend,
            speculative_path,
            prefill_pairs,
            prefill_cached_tokens,
            moe_active_fraction=self.moe_active_fraction,
            cuda_graph_max_bs=self.server.cuda_graph_max_bs,
            moe_draft_token_share=self.moe_draft_token_share,
        )
        return design @ np.array([getattr(self, n) for n in COEFFICIENTS])

    def to_dict(self) -> dict:
        """The YAML layout (see :func:`save_profile`)."""
        data: dict[str, Any] = {"name": self.name}
        if self.description:
            data["description"] = self.description
        data["model"] = dict(self.model)
        data["hardware"] = dict(self.hardware)
        data["server"] = dataclasses.asdict(self.server)
        cost: dict[str, Any] = {"moe_active_fraction": self.moe_active_fraction}
        if self.moe_draft_token_share != 1.0:
            cost["moe_draft_token_share"] = self.moe_draft_token_share
        if self.prefill_launch_s:  # (profiles without it: files unchanged)
            cost["prefill_launch_s"] = self.prefill_launch_s
            cost["prefill_launch_hidden"] = self.prefill_launch_hidden
        # A term most profiles do not fit stays out of their files (shipped files unchanged).
        cost.update({k: v for k, v in self.coefficients.items()
                     if v or k not in _OPTIONAL_COEFFICIENTS})
        data["cost"] = cost
        if self.acceptance is not None:
            data["acceptance"] = dict(self.acceptance)
        data["provenance"] = dict(self.provenance)
        return data


def prefill_pairs(new_tokens: np.ndarray | int, done_tokens: np.ndarray | int = 0
                  ) -> np.ndarray | float:
    """Attention token pairs of computing ``new_tokens`` of a prompt whose first
    ``done_tokens`` are already in the KV cache (a cached prefix, earlier chunks): each new
    token attends to every earlier token of its prompt and to itself,
    ``new * done + new * (new + 1) / 2``. Sum it over a step's prompts for
    :meth:`CostProfile.step_latency_s`'s ``prefill_pairs``."""
    # Plain arithmetic: numbers in, a number out (the simulator's per-step path).
    return new_tokens * done_tokens + new_tokens * (new_tokens + 1.0) / 2.0


def design_matrix(
    batch_size: np.ndarray | int,
    depth: np.ndarray | int,
    kv_tokens: np.ndarray | int = 0,
    prefill_tokens: np.ndarray | int = 0,
    draft_extend: np.ndarray | bool = True,
    speculative_path: np.ndarray | bool = True,
    prefill_pairs: np.ndarray | float = 0.0,
    prefill_cached_tokens: np.ndarray | float = 0.0,
    *,
    moe_active_fraction: float = 0.0,
    cuda_graph_max_bs: int | None = None,
    moe_draft_token_share: float = 1.0,
) -> np.ndarray:
    """The latency formula's terms, one column per coefficient (:data:`COEFFICIENTS`).

    ``latency = design_matrix(...) @ coefficients``; shape ``(n, len(COEFFICIENTS))``.
    """
    b, d, kv, pf, ext, sp, pairs, cached = np.broadcast_arrays(
        np.asarray(batch_size, dtype=np.float64),
        np.asarray(depth, dtype=np.float64),
        np.asarray(kv_tokens, dtype=np.float64),
        np.asarray(prefill_tokens, dtype=np.float64),
        np.asarray(draft_extend, dtype=bool),
        np.asarray(speculative_path, dtype=bool),
        np.asarray(prefill_pairs, dtype=np.float64),
        np.asarray(prefill_cached_tokens, dtype=np.float64),
    )
    b, d, kv, pf, ext, sp, pairs, cached = (np.atleast_1d(x).ravel()
                                            for x in (b, d, kv, pf, ext, sp, pairs, cached))
    tokens = b * (d + 1.0) + pf
    spec = (d > 0).astype(np.float64)
    n_draft = np.maximum(d - 1.0, 0.0)
    extend = ((d > 0) | ext).astype(np.float64)
    f = moe_active_fraction
    if 0.0 < f < 1.0:
        moe_tokens = tokens if moe_draft_token_share == 1.0 else (
            b * (1.0 + moe_draft_token_share * d) + pf)
        moe = -np.expm1(moe_tokens * math.log1p(-f))
    else:
        moe = np.where(tokens > 0, 1.0, 0.0) if f == 1.0 else np.zeros_like(tokens)
    eager = np.zeros_like(b) if cuda_graph_max_bs is None else (b > cuda_graph_max_bs).astype(float)
    spec_path = ((b > 0) & ((d > 0) | sp)).astype(np.float64)
    columns = {
        "c_fixed": np.ones_like(b),
        "c_request": b,
        "c_token": tokens,
        "c_moe": moe,
        "c_kv": kv,
        "c_verify": spec,
        "c_verify_token": spec * b,
        "c_draft": n_draft,
        "c_draft_token": n_draft * b,
        "c_extend": extend,
        "c_extend_token": extend * tokens,
        "c_eager": eager,
        "c_eager_token": eager * b,
        "c_prefill_token": pf,
        "c_prefill_pair": np.where(pf > 0, pairs, 0.0),
        "c_prefill_cached_token": np.where(pf > 0, cached, 0.0),
        "c_steps0": spec_path,
        "c_steps0_request": spec_path * b,
        "c_steps0_kv": spec_path * kv,
    }
    return np.stack([columns[name] for name in COEFFICIENTS], axis=1)


# ---------------------------------------------------------------------------
# Loading and saving
# ---------------------------------------------------------------------------

_TOP_KEYS = {
    "name",
    "description",
    "model",
    "hardware",
    "server",
    "cost",
    "acceptance",
    "provenance",
}
_REQUIRED_TOP = ("name", "server", "cost")
_COST_KEYS = {"moe_active_fraction", "moe_draft_token_share", "prefill_launch_s",
              "prefill_launch_hidden", *COEFFICIENTS}


def shipped_profiles() -> list[str]:
    """Names of the profiles that ship with the package."""
    folder = resources.files("env.sim").joinpath("profiles")
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def profile_from_dict(data: Mapping, source: str = "<dict>") -> CostProfile:
    """Build a profile from the YAML layout; errors name ``source`` and the key."""
    if not isinstance(data, Mapping):
        raise ProfileError(f"{source}: expected a mapping at the top level")
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise ProfileError(f"{source}: unknown key {unknown[0]!r}")
    for key in _REQUIRED_TOP:
        if key not in data:
            raise ProfileError(f"{source}: missing key {key!r}")
    for key in ("model", "hardware", "provenance", "server", "cost"):
        if key in data and not isinstance(data[key], Mapping):
            raise ProfileError(f"{source}: {key!r} must be a mapping")
    acceptance = data.get("acceptance")
    if acceptance is not None and not isinstance(acceptance, Mapping):
        raise ProfileError(f"{source}: 'acceptance' must be a mapping")
    server_fields = {f.name for f in dataclasses.fields(ServerLimits)}
    server = data["server"]
    unknown = sorted(set(server) - server_fields)
    if unknown:
        raise ProfileError(f"{source}: unknown key 'server.{unknown[0]}'")
    try:
        limits = ServerLimits(**server)
    except TypeError as exc:
        raise ProfileError(f"{source}: server: {exc}") from None
    except ValueError as exc:
        raise ProfileError(f"{source}: {exc}") from None
    cost = data["cost"]
    unknown = sorted(set(cost) - _COST_KEYS)
    if unknown:
        raise ProfileError(f"{source}: unknown key 'cost.{unknown[0]}'")
    try:
        profile = CostProfile(
            name=str(data["name"]),
            server=limits,
            description=str(data.get("description", "")),
            model=dict(data.get("model") or {}),
            hardware=dict(data.get("hardware") or {}),
            acceptance=None if acceptance is None else dict(acceptance),
            provenance=dict(data.get("provenance") or {}),
            **{k: cost[k] for k in cost},
        )
    except ValueError as exc:
        raise ProfileError(f"{source}: cost.{exc}") from None
    _check_steps_take_time(profile, source)
    return profile


def _check_steps_take_time(profile: CostProfile, source: str) -> None:
    """A decode step and a prefill step must take time, or a simulated server is infinitely fast.

    (Capacities and throughputs would divide by zero; a profile built in code may
    leave terms at 0 for a test, a profile file describes a server.)
    """
    chunk = profile.server.chunked_prefill_tokens
    for what, latency in (("a decode step of one request", profile.step_latency_s(1, 0)),
                          (f"a prefill step of {chunk} tokens",
                           profile.step_latency_s(0, 0, 0, chunk))):
        if not latency > 0:
            raise ProfileError(
                f"{source}: cost: {what} takes {latency} s under these coefficients; set "
                "c_fixed (or c_request / c_token and c_prefill_token) to the server's "
                "measured costs (see specctl-fit-profile)"
            )


def load_profile(name_or_path: str | os.PathLike) -> CostProfile:
    """Load a shipped profile by name (e.g. ``"h200_llama31_8b"``) or a YAML file by path."""
    text_name = str(name_or_path)
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists() or os.sep in text_name:
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such profile file")
        return _load_yaml(path.read_text(encoding="utf-8"), str(path))
    ref = resources.files("env.sim").joinpath("profiles", f"{text_name}.yaml")
    if not ref.is_file():
        raise ProfileError(
            f"unknown profile {text_name!r}: not a file, and not one of the shipped "
            f"profiles {shipped_profiles()}"
        )
    return _load_yaml(ref.read_text(encoding="utf-8"), f"profile {text_name!r}")


def _load_yaml(text: str, source: str) -> CostProfile:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ProfileError(f"{source}: invalid YAML: {exc}") from None
    return profile_from_dict(data, source)


def save_profile(profile: CostProfile, path: str | os.PathLike) -> Path:
    """Write ``profile`` as YAML (atomically); return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(_plain(profile.to_dict()), sort_keys=False, width=100)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


def _plain(value: Any) -> Any:
    """numpy scalars/arrays and tuples -> plain YAML-safe Python values."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


# ---------------------------------------------------------------------------
# Fitting
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LatencyPoints:
    """Measured steps to fit: one entry per point (arrays of equal length).

    Attributes:
        batch_size, depth, kv_tokens, prefill_tokens: What each step did.
        latency_s: Its measured latency (e.g. a median), > 0.
        weight: Optional per-point weight (e.g. sample count); default 1.
        draft_extend: Whether the draft extend ran at depth 0; default True.
        speculative_path: Whether a depth-0 decode step ran on the speculative path
            (SGLang's steps=0) rather than a plain decode; default True.
        prefill_pairs: Attention token pairs of each step's prompts; default 0.
        prefill_cached_tokens: Cached tokens of each step's prompts; default 0.
    """

    batch_size: np.ndarray
    depth: np.ndarray
    kv_tokens: np.ndarray
    prefill_tokens: np.ndarray
    latency_s: np.ndarray
    weight: np.ndarray | None = None
    draft_extend: np.ndarray | None = None
    speculative_path: np.ndarray | None = None
    prefill_pairs: np.ndarray | None = None
    prefill_cached_tokens: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = np.asarray(self.latency_s).size
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            dtype = bool if f.name in ("draft_extend", "speculative_path") else np.float64
            arr = np.asarray(value, dtype=dtype).ravel()
            if arr.size == 1 and n > 1:
                arr = np.full(n, arr[0], dtype=dtype)
            if arr.size != n:
                raise ValueError(f"points.{f.name} has {arr.size} entries, expected {n}")
            if dtype is np.float64 and not np.isfinite(arr).all():
                raise ValueError(f"points.{f.name} must be finite")
            object.__setattr__(self, f.name, arr)
        if n == 0:
            raise ValueError("no points to fit")
        if (self.latency_s <= 0).any():
            raise ValueError("points.latency_s must be > 0")
        for name in ("batch_size", "depth", "kv_tokens", "prefill_tokens", "prefill_pairs",
                     "prefill_cached_tokens"):
            if getattr(self, name) is not None and (getattr(self, name) < 0).any():
                raise ValueError(f"points.{name} must be >= 0")
        if self.weight is not None and (self.weight < 0).any():
            raise ValueError("points.weight must be >= 0")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> LatencyPoints:
        """From a mapping with keys ``batch_size`` (or ``batch``), ``depth``,
        ``kv_tokens``, ``prefill_tokens`` (default 0), ``latency_s`` and optional
        ``weight``, ``draft_extend``."""
        data = dict(data)
        if "batch" in data and "batch_size" not in data:
            data["batch_size"] = data.pop("batch")
        data.setdefault("prefill_tokens", 0)
        data.setdefault("kv_tokens", 0)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown point fields: {unknown}")
        return cls(**data)

    def __len__(self) -> int:
        return int(self.latency_s.size)


@dataclass(frozen=True)
class FitReport:
    """How well a profile reproduces the points it was fitted to.

    Attributes:
        relative_errors: ``(predicted - measured) / measured`` per point.
        median_abs_error: Median of ``|relative_errors|``.
        worst_abs_error: Largest ``|relative_errors|``.
        worst_index: Index of that point.
        free: The coefficients that were fitted.
        points: The points.
        predicted_s: Predicted latency per point.
    """

    relative_errors: np.ndarray
    median_abs_error: float
    worst_abs_error: float
    worst_index: int
    free: tuple[str, ...]
    points: LatencyPoints
    predicted_s: np.ndarray
    #: What was left out of the data and why (printed under the table).
    notes: tuple[str, ...] = ()

    @classmethod
    def evaluate(
        cls, profile: CostProfile, points: LatencyPoints, free: Sequence[str] = ()
    ) -> FitReport:
        """Errors of ``profile`` on ``points``."""
        ext = points.draft_extend if points.draft_extend is not None else True
        sp = points.speculative_path if points.speculative_path is not None else True
        pairs = points.prefill_pairs if points.prefill_pairs is not None else 0.0
        cached = points.prefill_cached_tokens if points.prefill_cached_tokens is not None else 0.0
        predicted = profile.step_latency_array(
            points.batch_size, points.depth, points.kv_tokens, points.prefill_tokens, ext, sp,
            pairs, cached,
        )
        rel = (predicted - points.latency_s) / points.latency_s
        abs_rel = np.abs(rel)
        worst = int(np.argmax(abs_rel))
        return cls(
            relative_errors=rel,
            median_abs_error=float(np.median(abs_rel)),
            worst_abs_error=float(abs_rel[worst]),
            worst_index=worst,
            free=tuple(free),
            points=points,
            predicted_s=predicted,
        )

    def summary(self) -> dict:
        """Headline numbers, JSON-friendly."""
        p = self.points
        i = self.worst_index
        return {
            "points": len(p),
            "median_abs_rel_error": round(self.median_abs_error, 5),
            "worst_abs_rel_error": round(self.worst_abs_error, 5),
            "worst_point": {
                "batch_size": int(p.batch_size[i]),
                "depth": int(p.depth[i]),
                "kv_tokens": int(p.kv_tokens[i]),
                "prefill_tokens": int(p.prefill_tokens[i]),
                "measured_ms": round(float(p.latency_s[i]) * 1e3, 4),
                "predicted_ms": round(float(self.predicted_s[i]) * 1e3, 4),
            },
        }

    def __str__(self) -> str:
        p = self.points
        lines = [
            f"{'batch':>6} {'depth':>5} {'kv':>8} {'prefill':>7} "
            f"{'measured ms':>11} {'model ms':>9} {'error':>7}"
        ]
        for i in range(len(p)):
            lines.append(
                f"{p.batch_size[i]:6.0f} {p.depth[i]:5.0f} {p.kv_tokens[i]:8.0f} "
                f"{p.prefill_tokens[i]:7.0f} {p.latency_s[i] * 1e3:11.3f} "
                f"{self.predicted_s[i] * 1e3:9.3f} {self.relative_errors[i] * 100:+6.2f}%"
            )
        lines.append(
            f"{len(p)} points: median |error| {self.median_abs_error * 100:.2f}%, "
            f"worst {self.worst_abs_error * 100:.2f}% (point {self.worst_index})"
        )
        lines.extend(self.notes)
        return "\n".join(lines)


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """Non-negative least squares, ``argmin ||a x - b||`` s.t. ``x >= 0`` (Lawson-Hanson).

    A small dense implementation for a handful of unknowns (scipy is not a
    dependency).
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(float).eps * np.abs(a).sum(axis=0).max(initial=0.0) * max(m, n)
    w = a.T @ (b - a @ x)
    for _ in range(max_iter or 10 * n + 10):
        if passive.all() or not (w[~passive] > tol).any():
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > tol).all():
                x = z
                break
            # Step from x toward z until the first passive variable hits zero.
            shrink = passive & (z <= tol)
            alpha = np.min(x[shrink] / (x[shrink] - z[shrink]))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
            if not passive.any():
                break
        w = a.T @ (b - a @ x)
    return x


def fit_coefficients(
    design: np.ndarray,
    target: np.ndarray,
    *,
    template: CostProfile,
    free: Sequence[str],
    ties: Mapping[str, tuple[str, float]],
    weight: np.ndarray | None = None,
) -> dict[str, float]:
    """Coefficients minimising the weighted squared relative error of ``design @ c``
    against ``target``, with ``c >= 0``.

    ``design`` has one column per :data:`COEFFICIENTS` entry; anything linear in
    the coefficients can be fitted this way (step latencies, or the seconds per
    output token of a steady-state benchmark). Free, tied and fixed coefficients
    as in :func:`fit_profile`; returns all coefficients by name.
    """
    a, rhs, values = _free_system(design, target, template, tuple(free), ties, weight)
    free = tuple(free)
    # Column scaling keeps NNLS well conditioned (terms range over 1 .. 1e5 tokens).
    norms = np.linalg.norm(a, axis=0)
    usable = norms > 0
    coef = np.zeros(len(free))
    if usable.any():
        coef[usable] = nnls(a[:, usable] / norms[usable], rhs) / norms[usable]
    for name, c in zip(free, coef, strict=True):
        values[name] = float(c)
    for name, (other, factor) in ties.items():
        values[name] = factor * values[other]
    return values


def _free_system(
    design: np.ndarray,
    target: np.ndarray,
    template: CostProfile,
    free: tuple[str, ...],
    ties: Mapping[str, tuple[str, float]],
    weight: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
    """The relative-error least-squares system of the free coefficients.

    Returns ``(a, rhs, values)``: ``a @ c_free ~ rhs`` row-scaled to relative
    errors (tied coefficients folded into their free partner's column, fixed ones
    moved to the right-hand side), and the template's values with fixed ties applied.
    """
    target = np.asarray(target, dtype=np.float64)
    if design.shape != (target.size, len(COEFFICIENTS)):
        raise ValueError(f"design must have shape ({target.size}, {len(COEFFICIENTS)})")
    if (target <= 0).any():
        raise ValueError("targets must be > 0")
    col = {name: design[:, j] for j, name in enumerate(COEFFICIENTS)}
    values = template.coefficients
    x_free = np.zeros((target.size, len(free)))
    for j, name in enumerate(free):
        x_free[:, j] = col[name]
    fixed_part = np.zeros(target.size)
    for name in COEFFICIENTS:
        if name in free:
            continue
        if name in ties:
            other, factor = ties[name]
            if other in free:
                x_free[:, free.index(other)] += factor * col[name]
                continue
            values[name] = factor * values[other]
        fixed_part += values[name] * col[name]
    w = np.ones(target.size) if weight is None else np.asarray(weight, dtype=np.float64)
    row_scale = np.sqrt(w) / target  # relative errors
    return x_free * row_scale[:, None], (target - fixed_part) * row_scale, values


#: What varies each coefficient's term, i.e. the data that pins it down.
_IDENTIFIED_BY = {
    "c_fixed": "several batch sizes (the intercept)",
    "c_request": "several batch sizes at one depth",
    "c_token": "several depths at one batch size",
    "c_moe": "several token counts per step",
    "c_kv": "KV use that varies apart from the batch size",
    "c_verify": "steps at depth 0 and at depth >= 1",
    "c_verify_token": "steps at depth 0 and at depth >= 1 at several batch sizes",
    "c_draft": "steps at depth 1 and at depth >= 2",
    "c_draft_token": "steps at depth >= 2 at several batch sizes",
    "c_extend": "steps at depth 0 with and without the draft extend",
    "c_extend_token": "steps at depth 0 with and without the draft extend",
    "c_eager": "batch sizes above and below cuda_graph_max_bs",
    "c_eager_token": "several batch sizes above cuda_graph_max_bs",
    "c_prefill_token": "prefill steps of several lengths",
    "c_prefill_pair": "prefill steps of prompts from hundreds to thousands of tokens",
    "c_prefill_cached_token": "prefill steps after cached prefixes of several lengths",
    "c_steps0_kv": "KV use that varies apart from the batch size on speculative-path steps",
}


def unidentifiable(
    design: np.ndarray,
    target: np.ndarray,
    *,
    template: CostProfile,
    free: Sequence[str],
    ties: Mapping[str, tuple[str, float]],
    weight: np.ndarray | None = None,
) -> list[str]:
    """The free coefficients the points cannot tell apart from the others.

    A coefficient is unidentifiable when its (scaled) column is zero or lies in
    the span of the free columns before it: any value of it fits the points as
    well as any other, so a fit would report whatever the solver happened to pick.
    """
    a, _, _ = _free_system(design, target, template, tuple(free), ties, weight)
    norms = np.linalg.norm(a, axis=0)
    scaled = a / np.where(norms > 0, norms, 1.0)
    basis: list[int] = []
    lost = []
    for j, name in enumerate(free):
        trial = scaled[:, [*basis, j]]
        if norms[j] > 0 and np.linalg.matrix_rank(trial, tol=1e-9) == len(basis) + 1:
            basis.append(j)
        else:
            lost.append(name)
    return lost


def check_fit_spec(free: Sequence[str], ties: Mapping[str, tuple[str, float]]) -> None:
    """Raise ValueError for unknown names, repeats, or inconsistent ties."""
    for name in (*free, *ties, *(o for o, _ in ties.values())):
        if name not in COEFFICIENTS:
            raise ValueError(f"unknown coefficient {name!r}; choose from {COEFFICIENTS}")
    if len(set(free)) != len(free):
        raise ValueError(f"free coefficients repeat: {tuple(free)}")
    for name, (other, factor) in ties.items():
        if name in free:
            raise ValueError(f"{name} is both free and tied")
        if other in ties:
            raise ValueError(f"{name} is tied to {other}, which is tied itself")
        if factor < 0:
            raise ValueError(f"tie factor of {name} must be >= 0, got {factor}")


def fit_profile(
    points: LatencyPoints | Mapping[str, Any],
    *,
    template: CostProfile,
    free: Sequence[str] = DEFAULT_FREE,
    ties: Mapping[str, tuple[str, float]] | None = None,
) -> tuple[CostProfile, FitReport]:
    """Fit the ``free`` coefficients to measured latencies; the others stay as in ``template``.

    Minimises the weighted sum of squared *relative* errors subject to every
    coefficient being >= 0. A coefficient in ``ties`` (``name -> (other,
    factor)``) is set to ``factor * other`` (default :data:`DEFAULT_TIES`; pass
    ``{}`` for none); coefficients neither free nor tied keep the template's
    values (use them for physical priors the data cannot identify, e.g.
    ``c_kv`` when the KV tokens grow in step with the batch).

    Returns the fitted profile (template with new coefficients and a ``fit``
    entry in its provenance) and a :class:`FitReport`.
    """
    pts = points if isinstance(points, LatencyPoints) else LatencyPoints.from_mapping(points)
    ties = dict(DEFAULT_TIES if ties is None else ties)
    free = tuple(free)
    check_fit_spec(free, ties)

    ext = pts.draft_extend if pts.draft_extend is not None else True
    sp = pts.speculative_path if pts.speculative_path is not None else True
    design = design_matrix(
        pts.batch_size,
        pts.depth,
        pts.kv_tokens,
        pts.prefill_tokens,
        ext,
        sp,
        pts.prefill_pairs if pts.prefill_pairs is not None else 0.0,
        pts.prefill_cached_tokens if pts.prefill_cached_tokens is not None else 0.0,
        moe_active_fraction=template.moe_active_fraction,
        cuda_graph_max_bs=template.server.cuda_graph_max_bs,
        moe_draft_token_share=template.moe_draft_token_share,
    )
    lost = unidentifiable(design, pts.latency_s, template=template, free=free, ties=ties,
                          weight=pts.weight)
    if lost:
        cells = sorted({(int(b), int(d)) for b, d in zip(pts.batch_size, pts.depth, strict=True)})
        shown = ", ".join(f"({b}, {d})" for b, d in cells[:8]) + (" ..." if len(cells) > 8 else "")
        needs = "; ".join(f"{name}: {_IDENTIFIED_BY.get(name, 'points that vary its term')}"
                          for name in lost)
        raise UnidentifiableFitError(
            f"cannot fit {', '.join(lost)} from {len(pts)} point(s) in {len(cells)} "
            f"(batch size, depth) cell(s) [{shown}]: the data does not tell them apart from "
            f"the other free coefficients. Needed: {needs}. Record with "
            "SPECCTL_RECORD_EXPLORE=1 under a varying load, or fit fewer coefficients "
            f"(free=...; the rest keep the template's values).",
            lost,
        )
    values = fit_coefficients(
        design, pts.latency_s, template=template, free=free, ties=ties, weight=pts.weight
    )
    fitted = template.replace(**values)
    report = FitReport.evaluate(fitted, pts, free)
    provenance = dict(template.provenance)
    provenance["fit"] = {
        **report.summary(),
        "free": list(free),
        "ties": {k: [o, f] for k, (o, f) in ties.items()},
    }
    return fitted.replace(provenance=provenance), report


def points_from_trace(trace: Any, *, draft_extend: bool = True,
                      per_cell: bool = True, min_steps: int = 5) -> LatencyPoints:
    """Decode steps of a :class:`~env.traces.trace_format.Trace` as fit points.

    Uses steps with ``prefill_tokens == 0``, ``batch_size > 0`` and a positive
    latency, of the lowest rank of each server (ranks report the same steps):
    (batch_size, steps_used, kv_used_tokens, 0, step_latency_s). A depth-0 step is
    SGLang's steps=0 (on the speculative path, its draft extend as ``draft_extend``
    says) unless its record says what it was (``StepRecord.warmup``, a trace the plugin
    recorded with its off path since the eighteenth session): flagged False, the off
    path's plain decode (no speculative path, no extend); flagged True, the re-entry
    warm-up (SGLang's steps=0 with the extend). With
    ``per_cell`` (the default) the steps are first reduced to one point per
    (batch size, depth, and for depth 0 which of the three): the median latency and KV
    use, for cells with at least ``min_steps`` steps. Single steps' latencies on a real
    server jitter (one result processed late makes the next look short) and a batch size seen a
    couple of times in a transient says little; the medians are what the model
    should match. Decode steps more than :data:`NON_PHYSICAL_RATIO` times slower
    than the median decode step are left out (logged with their count).
    """
    points, dropped = _decode_points(trace, draft_extend, per_cell, min_steps)
    if dropped:
        log.warning("%s", _dropped_note(dropped))
    return points


#: A decode step this many times slower than the trace's median decode step is no
#: measurement of a step (a stalled process, a clock jump, a corrupt value).
NON_PHYSICAL_RATIO = 100.0


def _dropped_note(dropped: int) -> str:
    return (f"left out {dropped} decode step(s) more than {NON_PHYSICAL_RATIO:g}x slower than "
            "the median decode step (not physical)")


def _decode_points(trace: Any, draft_extend: bool, per_cell: bool,
                   min_steps: int) -> tuple[LatencyPoints, int]:
    """:func:`points_from_trace`'s points and the number of non-physical steps left out."""
    cols = trace.step_columns()
    if not len(cols):
        raise ValueError("the trace holds no step records")
    servers = cols.server.astype(str)
    min_rank = {s: cols.rank[servers == s].min() for s in np.unique(servers)}
    lowest = np.array([cols.rank[i] == min_rank[s] for i, s in enumerate(servers)], dtype=bool)
    use = lowest & (cols.prefill_tokens == 0) & (cols.batch_size > 0) & (cols.step_latency_s > 0)
    if not use.any():
        raise ValueError("the trace holds no decode step with a positive latency")
    wild = use & (cols.step_latency_s > NON_PHYSICAL_RATIO * np.median(cols.step_latency_s[use]))
    use &= ~wild
    batch, depth = cols.batch_size[use], cols.steps_used[use]
    kv, latency = cols.kv_used_tokens[use], cols.step_latency_s[use]
    # What a depth-0 step ran (StepColumns.warmup: -1 unknown, 0 off, 1 the warm-up); a
    # speculative step is one kind whatever its record says.
    kind = np.where(depth > 0, -1, cols.warmup[use]).astype(np.int64)
    if per_cell:
        cells, counts = np.unique(np.stack([batch, depth, kind], axis=1), axis=0,
                                  return_counts=True)
        cells = cells[counts >= min_steps]
        if not len(cells):
            raise ValueError(f"no (batch size, depth) cell has {min_steps} decode steps")
        members = [(batch == b) & (depth == d) & (kind == k) for b, d, k in cells]
        batch, depth, kind = cells[:, 0], cells[:, 1], cells[:, 2]
        kv = np.array([np.median(kv[m]) for m in members])
        latency = np.array([np.median(latency[m]) for m in members])
    off = kind == 0  # the plugin's off path: a plain decode
    points = LatencyPoints(
        batch_size=batch,
        depth=depth,
        kv_tokens=kv,
        prefill_tokens=np.zeros(len(batch)),
        latency_s=latency,
        draft_extend=np.where(kind == 1, True, np.where(off, False, draft_extend)),
        speculative_path=~off,
    )
    return points, int(wild.sum())


def fit_profile_from_trace(
    trace: Any,
    template: CostProfile,
    *,
    draft_extend: bool = True,
    free: Sequence[str] = DEFAULT_FREE,
    ties: Mapping[str, tuple[str, float]] | None = None,
    per_cell: bool = True,
) -> tuple[CostProfile, FitReport]:
    """Fit a profile to a recorded trace's decode steps (see :func:`points_from_trace`).

    If the trace has prefill steps of at least 1000 tokens, ``c_prefill_token`` is
    then set to their median latency left over by the other terms, per prompt token.
    """
    points, dropped = _decode_points(trace, draft_extend, per_cell, min_steps=5)
    profile, report = fit_profile(points, template=template, free=free, ties=ties)
    if dropped:
        report = dataclasses.replace(report, notes=(_dropped_note(dropped),))
    cols = trace.step_columns()
    big = (cols.prefill_tokens >= 1000) & (cols.step_latency_s > 0)
    if big.any():
        prompt = cols.prefill_tokens[big].astype(np.float64)
        rest = profile.replace(c_prefill_token=0.0).step_latency_array(
            0, 0, cols.kv_used_tokens[big], prompt, draft_extend)
        per_token = float(np.median((cols.step_latency_s[big] - rest) / prompt))
        profile = profile.replace(c_prefill_token=max(per_token, 0.0))
    return profile, report
