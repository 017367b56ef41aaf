"""Acceptance models: per-request, per-position accepted-draft tables.

Speculation here is chain drafting (EAGLE, topk=1). For each request we hold an
int8 array ``A`` with one entry per output token: ``A[p]`` is the number of
draft tokens a verify step would accept if it started with ``p`` output tokens
committed and drafted the maximum depth ``D``. A verify at depth ``d`` then
commits ``min(A[p], d) + 1`` tokens (capped by what is left of the output):
with a chain, accepting at depth ``d`` is accepting at ``D`` cut at ``d``.

Tables are stored flat (:class:`AcceptanceTable`). Models (:class:`AcceptanceModel`)
draw a table for a batch of requests:

* :class:`SpecBenchAcceptance`: replays real per-step logs (EAGLE on Vicuna-7B,
  Spec-Bench), per category;
* :class:`ParametricAcceptance`: per-position conditional acceptance rates
  ``alpha_k``, with :meth:`ParametricAcceptance.calibrated` to hit a target
  accept length;
* :class:`SGLangSimulatedAcceptance`: SGLang's ``SGLANG_SIMULATE_ACC_LEN``
  (method ``match-expected``), as used in the measured H200 data;
* :class:`TraceAcceptance`: fitted from a recorded specctl trace.

Terms: *accept length* = tokens committed by one verify step = accepted drafts
+ 1 (the bonus or correction token); *accepted drafts* = accept length - 1.
"""

from __future__ import annotations

import json
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Literal

import numpy as np

from env.traces.trace_format import DataFileError, Trace

#: Default maximum draft depth, matching :class:`env.features.FeatureSpec`.
DEFAULT_MAX_DEPTH = 7
_INT8_MAX = 127


class AcceptanceLogError(DataFileError):
    """A per-step acceptance log is malformed (``where`` is a 1-based line number)."""

    unit = "line"


def _index_dtype(total: int) -> type:
    # int32 halves the memory traffic of the big index arrays (tens of millions of tokens).
    return np.int32 if total < 2**31 - 1 else np.int64


def _ramp(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenated ranges ``starts[i], starts[i] + 1, ..., starts[i] + counts[i] - 1``."""
    counts = counts.astype(np.int64, copy=False)
    total = int(counts.sum())
    dtype = _index_dtype(max(total, int(starts.max(initial=0)) + 1))
    out = np.ones(total, dtype=dtype)
    nonempty = counts > 0
    starts, counts = starts[nonempty], counts[nonempty]
    if not counts.size:
        return out
    first = np.zeros(counts.size, dtype=np.int64)
    np.cumsum(counts[:-1], out=first[1:])
    # A cumulative sum of ones, with a jump at the start of each range.
    jumps = starts.astype(np.int64).copy()
    jumps[1:] -= starts[:-1] + counts[:-1] - 1
    out[first] = jumps
    return np.cumsum(out, out=out)


def _sawtooth(accepted: np.ndarray, covered: np.ndarray) -> np.ndarray:
    """Saw-tooth values: step ``i`` covers ``covered[i]`` positions holding
    ``accepted[i], accepted[i] - 1, ...`` (one run per verify step)."""
    # accepted - j over a run = -(ramp starting at -accepted)
    return -_ramp(-accepted.astype(np.int64), covered)


@dataclass
class AcceptanceTable:
    """Accepted-draft arrays of ``n`` requests, stored flat.

    Request ``i``'s array is ``values[offsets[i]:offsets[i + 1]]``; its length
    is the request's output tokens, and entry ``p`` is the drafts accepted at
    the maximum depth by a verify starting with ``p`` tokens committed.

    Attributes:
        offsets: int64, ``n + 1`` entries, ``offsets[0] == 0``, non-decreasing.
        values: int8, ``offsets[-1]`` entries, each >= 0.
    """

    offsets: np.ndarray
    values: np.ndarray

    def __post_init__(self) -> None:
        self.offsets = np.asarray(self.offsets, dtype=np.int64)
        self.values = np.asarray(self.values, dtype=np.int8)
        off = self.offsets
        if off.ndim != 1 or off.size < 1 or off[0] != 0:
            raise ValueError("offsets must be 1-D with offsets[0] == 0")
        if (np.diff(off) < 0).any():
            raise ValueError("offsets must be non-decreasing")
        if off[-1] != self.values.size:
            raise ValueError(f"offsets[-1] = {off[-1]} does not match {self.values.size} values")
        if self.values.size and self.values.min() < 0:
            raise ValueError("accepted-draft values must be >= 0")

    @classmethod
    def from_rows(cls, rows: Sequence[np.ndarray]) -> AcceptanceTable:
        """A table from one array per request."""
        lengths = np.array([len(r) for r in rows], dtype=np.int64)
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = np.concatenate([np.asarray(r, dtype=np.int8) for r in rows]) if rows else []
        return cls(offsets, np.asarray(values, dtype=np.int8))

    def __len__(self) -> int:
        return int(self.offsets.size - 1)

    @property
    def lengths(self) -> np.ndarray:
        """Output tokens per request."""
        return np.diff(self.offsets)

    def row(self, i: int) -> np.ndarray:
        """Request ``i``'s array (a view)."""
        return self.values[self.offsets[i] : self.offsets[i + 1]]

    def capped(self, max_depth: int) -> AcceptanceTable:
        """The same table with every entry capped at ``max_depth``."""
        return AcceptanceTable(self.offsets, np.minimum(self.values, max_depth))

    def replay(self, i: int, depth: int) -> np.ndarray:
        """Accept lengths of request ``i`` decoded at a fixed ``depth`` from ``p = 0``.

        The last step commits only what is left of the output.
        """
        row = self.row(i)
        out = []
        p = 0
        while p < row.size:
            commit = min(int(min(row[p], depth)) + 1, row.size - p)
            out.append(commit)
            p += commit
        return np.array(out, dtype=np.int64)

    def replay_counts(self, depth: int) -> np.ndarray:
        """Verify steps each request needs at a fixed ``depth`` (vectorised over requests)."""
        lengths = self.lengths
        p = np.zeros(len(self), dtype=np.int64)
        steps = np.zeros(len(self), dtype=np.int64)
        active = np.flatnonzero(lengths > 0)
        while active.size:
            a = np.minimum(self.values[self.offsets[active] + p[active]], depth).astype(np.int64)
            p[active] += np.minimum(a + 1, lengths[active] - p[active])
            steps[active] += 1
            active = active[p[active] < lengths[active]]
        return steps

    def mean_accepted(self, depth: int) -> float:
        """Accepted drafts per verify step over all requests at a fixed ``depth``."""
        steps = int(self.replay_counts(depth).sum())
        if steps == 0:
            return 0.0
        return (int(self.lengths.sum()) - steps) / steps


class AcceptanceModel(ABC):
    """Draws :class:`AcceptanceTable` s for requests.

    Attributes:
        max_depth: The depth ``D`` the tables refer to; entries are <= D.
    """

    max_depth: int

    @abstractmethod
    def draw(
        self,
        output_tokens: np.ndarray,
        request_class: np.ndarray | None,
        rng: np.random.Generator,
    ) -> AcceptanceTable:
        """A table for requests with these output lengths (and optional classes)."""

    @abstractmethod
    def expected_accepted(self, depth: int) -> float:
        """Long-run accepted drafts per verify step at a fixed ``depth``.

        What replaying this model's tables at ``depth`` yields, ignoring the
        truncation of a request's last step.
        """

    def expected_accept_length_at(self, depth: int) -> float:
        """``1 + expected_accepted(depth)``: tokens committed per verify step."""
        return 1.0 + self.expected_accepted(depth)

    @abstractmethod
    def to_config(self) -> dict:
        """A JSON/YAML-friendly description; :func:`acceptance_from_config` inverts it."""


def _check_lengths(output_tokens: np.ndarray) -> np.ndarray:
    lengths = np.asarray(output_tokens, dtype=np.int64)
    if lengths.ndim != 1:
        raise ValueError("output_tokens must be 1-D")
    if lengths.size and lengths.min() < 0:
        raise ValueError("output_tokens must be >= 0")
    return lengths


class _SegmentPool:
    """Logged per-position arrays (turns or recorded requests) to tile new requests from.

    A request draws segments uniformly (among those of its class when the class
    is known to the pool, else among all) and concatenates them until its
    output length is covered, the last one truncated. Segments start at a step
    boundary, so concatenating them keeps the saw-tooth structure valid.
    """

    def __init__(self, table: AcceptanceTable, classes: np.ndarray | None) -> None:
        keep = np.flatnonzero(table.lengths > 0)  # empty segments can tile nothing
        if keep.size == 0:
            raise ValueError("no non-empty segments to draw from")
        self.table = table
        self.segments = keep
        self.by_class: dict[str, np.ndarray] = {}
        if classes is not None:
            labels = np.asarray(classes, dtype=object)[keep]
            for label in sorted({str(c) for c in labels if c is not None}):
                self.by_class[label] = keep[np.array([c == label for c in labels])]

    def draw(
        self, output_tokens: np.ndarray, request_class: np.ndarray | None, rng: np.random.Generator
    ) -> AcceptanceTable:
        lengths = _check_lengths(output_tokens)
        n = lengths.size
        # Candidate segment set per request: one group per known class, plus "any".
        group = np.zeros(n, dtype=np.int64)
        pools = [self.segments]
        if request_class is not None and self.by_class:
            classes = np.asarray(request_class, dtype=object)
            if classes.shape != (n,):
                raise ValueError(f"request_class has shape {classes.shape}, expected ({n},)")
            for g, (label, members) in enumerate(self.by_class.items(), start=1):
                pools.append(members)
                group[classes == label] = g
        seg_len = self.table.lengths
        seg_start = self.table.offsets[:-1]

        req_parts, seg_parts, take_parts, round_parts = [], [], [], []
        remaining = lengths.copy()
        todo = np.flatnonzero(remaining > 0)
        rnd = 0
        while todo.size:
            chosen = np.empty(todo.size, dtype=np.int64)
            for g, members in enumerate(pools):
                sel = np.flatnonzero(group[todo] == g)
                if sel.size:
                    chosen[sel] = members[rng.integers(0, members.size, size=sel.size)]
            take = np.minimum(seg_len[chosen], remaining[todo])
            req_parts.append(todo)
            seg_parts.append(chosen)
            take_parts.append(take)
            round_parts.append(np.full(todo.size, rnd, dtype=np.int64))
            remaining[todo] -= take
            todo = todo[remaining[todo] > 0]
            rnd += 1
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if not req_parts:
            return AcceptanceTable(offsets, np.empty(0, dtype=np.int8))
        req = np.concatenate(req_parts)
        seg = np.concatenate(seg_parts)
        take = np.concatenate(take_parts)
        order = np.lexsort((np.concatenate(round_parts), req))  # request-major, then round
        seg, take = seg[order], take[order]
        source = _ramp(seg_start[seg], take)
        return AcceptanceTable(offsets, self.table.values[source])


# ---------------------------------------------------------------------------
# Spec-Bench logs
# ---------------------------------------------------------------------------

_SPEC_BENCH_FILE = "vicuna-7b-v1.3-eagle-float16-temperature-0.0.jsonl"


def _int_list(value: object, path: Path, line: int, name: str, minimum: int) -> list[int]:
    if not isinstance(value, list):
        raise AcceptanceLogError(path, line, name, f"expected a list, got {type(value).__name__}")
    for j, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, int):
            raise AcceptanceLogError(path, line, name, f"entry {j} is not an integer: {v!r}")
        if v < minimum:
            raise AcceptanceLogError(path, line, name, f"entry {j} must be >= {minimum}, got {v}")
    return value


class SpecBenchAcceptance(AcceptanceModel):
    """Acceptance replayed from a Spec-Bench per-step log.

    Each line of the log is one question: ``category`` and
    ``choices[0].{accept_lengths, decoding_steps, new_tokens}``, where
    ``accept_lengths`` lists the tokens committed by each decoding step over
    all turns. Every turn becomes a saw-tooth array: a step at position ``p``
    that committed ``L`` tokens accepted ``k = L - 1`` drafts, so ``A[p + j] =
    k - j`` for ``j = 0..k`` (greedy decoding: a verify starting later in the
    same run would have accepted the rest of it); values are capped at
    ``max_depth``. Replaying a turn at depth ``>= max(k)`` reproduces its
    logged accept lengths exactly.

    The shipped log is EAGLE-1 with *tree* drafting; using its accepted path as
    a chain is optimistic for chain drafting at the same depth.

    Args:
        path: A Spec-Bench ``model_answer`` JSONL; default: the shipped EAGLE log.
        categories: Keep only turns of these categories (default: all).
        max_depth: Cap of the table values.
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        categories: Sequence[str] | None = None,
        max_depth: int = DEFAULT_MAX_DEPTH,
    ) -> None:
        if not 1 <= max_depth <= _INT8_MAX:
            raise ValueError(f"max_depth must be in [1, {_INT8_MAX}], got {max_depth}")
        self.max_depth = int(max_depth)
        self.path = None if path is None else Path(path)
        self._categories_arg = None if categories is None else list(categories)
        if self.path is None:
            ref = resources.files("env.sim").joinpath("data", "acceptance", _SPEC_BENCH_FILE)
            with resources.as_file(ref) as p:
                turn_category, turn_steps, accept_lengths = self._parse(Path(p))
            self.source = f"package:env/sim/data/acceptance/{_SPEC_BENCH_FILE}"
        else:
            turn_category, turn_steps, accept_lengths = self._parse(self.path)
            self.source = str(self.path)
        all_categories = sorted(set(turn_category.tolist()))
        if categories is not None:
            unknown = sorted(set(categories) - set(all_categories))
            if unknown:
                raise ValueError(f"unknown categories {unknown}; the log has {all_categories}")
            keep_turn = np.isin(turn_category, list(categories))
        else:
            keep_turn = np.ones(turn_category.size, dtype=bool)
        step_turn = np.repeat(np.arange(turn_steps.size), turn_steps)
        keep_step = keep_turn[step_turn]
        #: Category of each kept turn.
        self.turn_category = turn_category[keep_turn]
        #: Logged accept lengths of each kept step, turn after turn.
        self.accept_lengths = accept_lengths[keep_step]
        #: Steps of each kept turn.
        self.turn_steps = turn_steps[keep_turn]
        self.categories = sorted(set(self.turn_category.tolist()))
        if not self.turn_steps.size:
            raise ValueError("no turns left after the category filter")
        self._step_offsets = np.zeros(self.turn_steps.size + 1, dtype=np.int64)
        np.cumsum(self.turn_steps, out=self._step_offsets[1:])
        kept_step_turn = np.repeat(np.arange(self.turn_steps.size), self.turn_steps)
        turn_tokens = np.bincount(
            kept_step_turn, weights=self.accept_lengths, minlength=self.turn_steps.size
        ).astype(np.int64)
        token_offsets = np.zeros(turn_tokens.size + 1, dtype=np.int64)
        np.cumsum(turn_tokens, out=token_offsets[1:])
        values = _sawtooth(self.accept_lengths - 1, self.accept_lengths)
        #: The turns as a table (one row per turn), capped at max_depth.
        self.turns = AcceptanceTable(token_offsets, np.minimum(values, self.max_depth))
        self._pool = _SegmentPool(self.turns, self.turn_category)

    @staticmethod
    def _parse(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        categories: list[str] = []
        steps: list[int] = []
        accept: list[int] = []
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise AcceptanceLogError(path, None, None, f"not UTF-8 text: {exc}") from None
        lines = text.splitlines()
        while lines and not lines[-1].strip():
            lines.pop()
        if not lines:
            raise AcceptanceLogError(path, None, None, "empty file")
        for i, line in enumerate(lines):
            n = i + 1
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise AcceptanceLogError(path, n, None, f"malformed JSON: {exc.msg}") from None
            if not isinstance(obj, dict):
                raise AcceptanceLogError(path, n, None, "expected a JSON object")
            category = obj.get("category")
            if not isinstance(category, str) or not category:
                raise AcceptanceLogError(path, n, "category", "missing or not a string")
            choices = obj.get("choices")
            if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
                raise AcceptanceLogError(path, n, "choices", "expected a non-empty list of objects")
            choice = choices[0]
            for key in ("accept_lengths", "decoding_steps", "new_tokens"):
                if key not in choice:
                    raise AcceptanceLogError(path, n, f"choices[0].{key}", "missing field")
            al = _int_list(choice["accept_lengths"], path, n, "choices[0].accept_lengths", 1)
            ds = _int_list(choice["decoding_steps"], path, n, "choices[0].decoding_steps", 0)
            nt = _int_list(choice["new_tokens"], path, n, "choices[0].new_tokens", 0)
            if len(ds) != len(nt):
                raise AcceptanceLogError(
                    path,
                    n,
                    "choices[0].new_tokens",
                    f"{len(nt)} turns, but decoding_steps has {len(ds)}",
                )
            if len(al) != sum(ds):
                raise AcceptanceLogError(
                    path,
                    n,
                    "choices[0].accept_lengths",
                    f"has {len(al)} steps, but sum(decoding_steps) = {sum(ds)}",
                )
            if sum(al) != sum(nt):
                raise AcceptanceLogError(
                    path,
                    n,
                    "choices[0].accept_lengths",
                    f"sums to {sum(al)} tokens, but sum(new_tokens) = {sum(nt)}",
                )
            start = 0
            for t, (s, tokens) in enumerate(zip(ds, nt, strict=True)):
                if sum(al[start : start + s]) != tokens:
                    raise AcceptanceLogError(
                        path,
                        n,
                        "choices[0].accept_lengths",
                        f"turn {t}: its {s} steps sum to {sum(al[start : start + s])} tokens, "
                        f"but new_tokens[{t}] = {tokens}",
                    )
                start += s
            categories.extend([category] * len(ds))
            steps.extend(ds)
            accept.extend(al)
        return (
            np.array(categories, dtype=object),
            np.array(steps, dtype=np.int64),
            np.array(accept, dtype=np.int64),
        )

    def turn_accept_lengths(self, turn: int) -> np.ndarray:
        """The logged accept lengths of kept turn ``turn``."""
        return self.accept_lengths[self._step_offsets[turn] : self._step_offsets[turn + 1]]

    def mean_accept_length(self, category: str | None = None) -> float:
        """Mean logged accept length (tokens per step), overall or of one category."""
        if category is None:
            return float(self.accept_lengths.mean())
        if category not in self.categories:
            raise ValueError(f"unknown category {category!r}; choose from {self.categories}")
        step_turn = np.repeat(np.arange(self.turn_steps.size), self.turn_steps)
        return float(self.accept_lengths[self.turn_category[step_turn] == category].mean())

    def category_means(self) -> dict[str, float]:
        """Mean logged accept length per category."""
        return {c: self.mean_accept_length(c) for c in self.categories}

    def draw(
        self,
        output_tokens: np.ndarray,
        request_class: np.ndarray | None,
        rng: np.random.Generator,
    ) -> AcceptanceTable:
        """Tile each request from random turns (of its class, when it is a known category)."""
        return self._pool.draw(output_tokens, request_class, rng)

    def expected_accepted(self, depth: int) -> float:
        """Accepted drafts per step when every logged turn is replayed at ``depth``."""
        return self.turns.mean_accepted(depth)

    def to_config(self) -> dict:
        config: dict = {"model": "spec_bench", "max_depth": self.max_depth}
        if self.path is not None:
            config["path"] = str(self.path)
        if self._categories_arg is not None:
            config["categories"] = list(self._categories_arg)
        return config


# ---------------------------------------------------------------------------
# Parametric
# ---------------------------------------------------------------------------


class ParametricAcceptance(AcceptanceModel):
    """Acceptance from per-position conditional rates ``alpha_k``.

    ``alpha_k = P(draft k accepted | drafts 1..k-1 accepted)``, k = 1..D with
    ``D = len(alphas) = max_depth``. A verify step starting anywhere accepts
    ``K`` drafts with ``P(K >= j) = alpha_1 * ... * alpha_j`` (the chain
    distribution, cut at D).

    ``structure`` says how a table's positions relate:

    * ``"iid"`` (default): each ``A[p]`` is an independent chain draw. The
      long-run accepted drafts at every depth ``d`` then equal the chain
      formula exactly (:meth:`expected_accept_length`), which is what the
      feature builder's acceptance estimates and the profiles' calibration
      assume.
    * ``"sawtooth"``: runs like a greedy log: a step at ``p`` draws ``K`` and
      fills ``K, K-1, ..., 0`` at ``p..p+K``; the next run starts at ``p+K+1``.
      At depth D this is identical to ``"iid"``; below D a step may start
      inside a run, whose remainder is cut by D, so it accepts less than the
      chain formula (:meth:`expected_accepted` gives the exact long-run value).
    """

    def __init__(
        self,
        alphas: Sequence[float],
        structure: Literal["iid", "sawtooth"] = "iid",
    ) -> None:
        alphas = np.asarray(alphas, dtype=np.float64)
        if alphas.ndim != 1 or not 1 <= alphas.size <= _INT8_MAX:
            raise ValueError(f"alphas must be a 1-D sequence of 1..{_INT8_MAX} rates")
        if not np.isfinite(alphas).all() or (alphas < 0).any() or (alphas > 1).any():
            raise ValueError(f"every alpha must lie in [0, 1], got {alphas.tolist()}")
        if structure not in ("iid", "sawtooth"):
            raise ValueError(f"structure must be 'iid' or 'sawtooth', got {structure!r}")
        self.alphas = alphas
        self.structure = structure
        self.max_depth = int(alphas.size)
        #: survival[j] = P(K >= j), j = 0..D (survival[0] = 1).
        self.survival = np.concatenate([[1.0], np.cumprod(alphas)])

    @classmethod
    def calibrated(
        cls,
        mean_accept_length: float,
        depth: int,
        max_depth: int = DEFAULT_MAX_DEPTH,
        decay: float = 0.95,
        structure: Literal["iid", "sawtooth"] = "iid",
    ) -> ParametricAcceptance:
        """Geometric-with-decay rates ``alpha_k = a * decay**(k-1)`` (``a`` solved for)
        whose accept length at ``depth`` (:meth:`expected_accept_length`) equals
        ``mean_accept_length``.

        For example the EAGLE-3 paper's tau values are accept lengths at the
        depth of its drafts. Raises ValueError if no ``a`` in [0, 1] reaches the
        target.
        """
        if not 1 <= depth <= max_depth:
            raise ValueError(f"depth must be in [1, max_depth={max_depth}], got {depth}")
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        powers = decay ** np.arange(max_depth)

        def length(a: float) -> float:
            return cls(np.minimum(a * powers, 1.0), structure).expected_accept_length(depth)

        lo_len, hi_len = length(0.0), length(1.0)
        if not lo_len <= mean_accept_length <= hi_len:
            raise ValueError(
                f"accept length {mean_accept_length} at depth {depth} is out of reach with "
                f"decay {decay}: achievable [{lo_len:.4f}, {hi_len:.4f}]"
            )
        lo, hi = 0.0, 1.0
        for _ in range(100):  # bisection: length(a) is increasing in a
            mid = 0.5 * (lo + hi)
            if length(mid) < mean_accept_length:
                lo = mid
            else:
                hi = mid
        return cls(np.minimum(0.5 * (lo + hi) * powers, 1.0), structure)

    def expected_accept_length(self, depth: int) -> float:
        """Chain formula: ``1 + sum_{j<=depth} prod_{i<=j} alpha_i`` (depth capped at D)."""
        d = max(0, min(int(depth), self.max_depth))
        return float(self.survival[: d + 1].sum())

    def expected_accepted(self, depth: int) -> float:
        """Long-run accepted drafts per step when a table is replayed at ``depth``.

        ``"iid"``: the chain formula minus 1. ``"sawtooth"``: by renewal over
        runs, tokens per run ``E[K + 1]`` over steps per run ``E[ceil((K+1)/(d+1))]``.
        """
        d = max(0, min(int(depth), self.max_depth))
        if self.structure == "iid" or d == self.max_depth:
            return self.expected_accept_length(d) - 1.0
        pmf = self.survival - np.append(self.survival[1:], 0.0)  # P(K = k), k = 0..D
        k = np.arange(self.max_depth + 1)
        tokens = float((pmf * (k + 1)).sum())
        steps = float((pmf * np.ceil((k + 1) / (d + 1))).sum())
        return tokens / steps - 1.0

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """``size`` independent chain draws ``K`` (int8)."""
        u = rng.random(size, dtype=np.float32)
        # K = #{j >= 1 : u < survival[j]}; D comparisons beat a search for small D.
        k = np.zeros(size, dtype=np.int8)
        for s in self.survival[1:].astype(np.float32):
            k += u < s
        return k

    def draw(
        self,
        output_tokens: np.ndarray,
        request_class: np.ndarray | None,
        rng: np.random.Generator,
    ) -> AcceptanceTable:
        """A table for these output lengths (``request_class`` is ignored)."""
        lengths = _check_lengths(output_tokens)
        offsets = np.zeros(lengths.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        total = int(offsets[-1])
        if self.structure == "iid":
            return AcceptanceTable(offsets, self.sample(rng, total))
        # Saw-tooth: request i gets n_i candidate runs (enough: each covers >= 1
        # position); keep the runs that start inside the request, cut the last.
        k = self.sample(rng, total).astype(np.int64)
        owner = np.repeat(np.arange(lengths.size), lengths)
        run_len = k + 1
        end = np.cumsum(run_len)
        first_run = offsets[:-1]  # the first candidate run of request i is at index offsets[i]
        base = np.zeros(lengths.size, dtype=np.int64)
        has = lengths > 0
        base[has] = np.where(first_run[has] > 0, end[np.maximum(first_run[has] - 1, 0)], 0)
        start_in_req = end - run_len - base[owner]
        keep = start_in_req < lengths[owner]
        covered = np.minimum(run_len[keep], lengths[owner[keep]] - start_in_req[keep])
        values = _sawtooth(k[keep], covered)
        return AcceptanceTable(offsets, values.astype(np.int8))

    def to_config(self) -> dict:
        return {
            "model": "parametric",
            "alphas": [float(a) for a in self.alphas],
            "structure": self.structure,
        }


class DriftingAcceptance(AcceptanceModel):
    """Chain acceptance whose rates differ by request class and drift between requests.

    Request ``i`` (in arrival order within a draw) accepts with the rates
    ``min(1, alphas * m_i)``: ``m_i = exp(w_i + c_i)``, ``w`` a Gaussian random
    walk over requests (log-std ``drift_sigma`` per request, clipped to +-1.5)
    and ``c_i`` a log-normal factor (log-std ``class_sigma``) per distinct
    request class of the draw. Acceptance measured early in an episode is then
    only a guide to acceptance later, as on a server whose traffic mix moves.
    ``expected_accepted`` is that of the base rates.
    """

    def __init__(self, alphas: Sequence[float], drift_sigma: float = 0.05,
                 class_sigma: float = 0.3) -> None:
        self.base = ParametricAcceptance(alphas)
        if drift_sigma < 0 or class_sigma < 0:
            raise ValueError("drift_sigma and class_sigma must be >= 0")
        self.alphas = self.base.alphas
        self.max_depth = self.base.max_depth
        self.drift_sigma = float(drift_sigma)
        self.class_sigma = float(class_sigma)

    def draw(self, output_tokens: np.ndarray, request_class: np.ndarray | None,
             rng: np.random.Generator) -> AcceptanceTable:
        lengths = _check_lengths(output_tokens)
        n = lengths.size
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        log_m = np.clip(np.cumsum(rng.normal(0.0, self.drift_sigma, n)), -1.5, 1.5)
        if request_class is not None and self.class_sigma > 0 and n:
            _, cls = np.unique(np.asarray(request_class, dtype=str), return_inverse=True)
            log_m = log_m + rng.normal(0.0, self.class_sigma, cls.max() + 1)[cls]
        rates = np.minimum(self.alphas[None, :] * np.exp(log_m)[:, None], 1.0)
        survival = np.cumprod(rates, axis=1).astype(np.float32)  # (n, D): P(K >= j)
        owner = np.repeat(np.arange(n), lengths)
        u = rng.random(int(offsets[-1]), dtype=np.float32)
        k = (u[:, None] < survival[owner]).sum(axis=1).astype(np.int8)
        return AcceptanceTable(offsets, k)

    def expected_accepted(self, depth: int) -> float:
        return self.base.expected_accepted(depth)

    def to_config(self) -> dict:
        return {"model": "drifting", "alphas": [float(a) for a in self.alphas],
                "drift_sigma": self.drift_sigma, "class_sigma": self.class_sigma}


# ---------------------------------------------------------------------------
# SGLang's simulated acceptance
# ---------------------------------------------------------------------------


class SGLangSimulatedAcceptance(AcceptanceModel):
    """SGLang's ``SGLANG_SIMULATE_ACC_LEN`` with ``SGLANG_SIMULATE_ACC_METHOD=match-expected``.

    SGLang clamps the mean ``m`` to ``[1, steps + 1]`` and commits ``floor(m)``
    or ``floor(m) + 1`` tokens, the latter with probability ``m - floor(m)``,
    so the mean matches. Here each position draws ``A[p] = L - 1`` with ``L`` in
    ``{floor(m'), floor(m') + 1}``, ``m' = clip(m, 1, max_depth + 1)``; at depth
    ``d``, ``min(A[p], d) + 1`` has exactly SGLang's distribution at
    ``steps = d`` (e.g. m = 3.5 accepts 1, 2 and 2.5 drafts on average at
    steps 1, 2 and >= 3, as the measured H200 data show).

    SGLang draws one length per verify step for the whole batch; by default this
    model draws one per request and position (same mean, less variance of the batch
    total: what real drafts do). ``batch_wide=True`` draws as SGLang does (the
    simulator asks :meth:`draw_step` once per verify step), for replaying servers
    run with ``SGLANG_SIMULATE_ACC_LEN``: there every request of a batch advances in
    lockstep, so requests that start together finish together, and a closed loop's
    clients keep arriving in waves (one prefill of up to C prompts) where per-request
    draws spread them out (``docs/FIDELITY.md``, run 6).
    """

    def __init__(self, mean_accept_length: float, max_depth: int = DEFAULT_MAX_DEPTH,
                 batch_wide: bool = False) -> None:
        if not math.isfinite(mean_accept_length) or mean_accept_length <= 0:
            raise ValueError(f"mean_accept_length must be > 0, got {mean_accept_length}")
        if not 1 <= max_depth <= _INT8_MAX:
            raise ValueError(f"max_depth must be in [1, {_INT8_MAX}], got {max_depth}")
        self.mean_accept_length = float(mean_accept_length)
        self.max_depth = int(max_depth)
        self.batch_wide = bool(batch_wide)
        m = min(max(self.mean_accept_length, 1.0), self.max_depth + 1.0)
        self._lower = math.floor(m)
        self._p_upper = m - self._lower if self._lower < self.max_depth + 1 else 0.0

    def draw_step(self, rng: np.random.Generator) -> int:
        """One verify step's ``L - 1`` for every request of the batch (``batch_wide``)."""
        return self._lower - 1 + int(rng.random() < self._p_upper)

    def draw(
        self,
        output_tokens: np.ndarray,
        request_class: np.ndarray | None,
        rng: np.random.Generator,
    ) -> AcceptanceTable:
        """i.i.d. per-position values ``L - 1`` (``request_class`` is ignored)."""
        lengths = _check_lengths(output_tokens)
        offsets = np.zeros(lengths.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        upper = rng.random(int(offsets[-1]), dtype=np.float32) < np.float32(self._p_upper)
        values = (self._lower - 1) + upper.astype(np.int8)
        return AcceptanceTable(offsets, values.astype(np.int8))

    def expected_accepted(self, depth: int) -> float:
        """``E[min(L - 1, depth)]``."""
        d = max(0, int(depth))
        low = min(self._lower - 1, d)
        high = min(self._lower, d)
        return (1.0 - self._p_upper) * low + self._p_upper * high

    def to_config(self) -> dict:
        config = {
            "model": "sglang_simulated",
            "mean_accept_length": self.mean_accept_length,
            "max_depth": self.max_depth,
        }
        if self.batch_wide:
            config["batch_wide"] = True
        return config


# ---------------------------------------------------------------------------
# Recorded traces
# ---------------------------------------------------------------------------


class TraceAcceptance(AcceptanceModel):
    """Acceptance fitted from a recorded specctl trace.

    Uses the decode steps that carry ``request_ids`` (of the lowest rank of each
    server: tensor-parallel ranks report the same steps). For each request its
    verify steps are laid out in order, each covering the tokens it committed,
    and every observation gives a saw-tooth run as in :class:`SpecBenchAcceptance`:

    * accepted ``a < steps_used``: exact, ``A[p] = a`` (the draft was rejected at
      position a + 1), then ``a - 1, ..., 0``;
    * accepted ``a == steps_used``, a steps=0 step (a lower bound of 0), and a
      request's last step (which the end of its output may have cut short):
      censored, ``A[p] >= a``. Under the saw-tooth, either the run ends at the
      step's last committed position (``A[p] = a``) or it continues into the
      next step's start, which then fixes it (``A[p] = a + 1 + A[next]``); the
      branch is drawn with the empirical rate ``alpha_{a+1}``. A request's last
      step has no next one: ``A[p] = a + extra`` with ``P(extra >= j) =
      alpha_{a+1} ... alpha_{a+j}``.

    The rates ``alpha_k`` are estimated like the feature builder's: trials at
    position k are observations that drafted at least k tokens and accepted at
    least k - 1; successes are those that accepted at least k. A position with
    no trials borrows the rate of the position before it. Requests whose steps
    include a speculative step without per-request acceptance cannot be laid
    out and are left out (:attr:`dropped_requests` counts them).

    New requests (:meth:`draw`) tile the recorded requests' arrays, of the same
    class where the trace's request records give one.

    Args:
        trace: A trace with step records that carry ``request_ids``.
        max_depth: Cap of the table values (and of the estimated rates).
        seed: Seed of the censored fills (the fit is deterministic for a seed).
    """

    def __init__(self, trace: Trace, max_depth: int = DEFAULT_MAX_DEPTH, seed: int = 0) -> None:
        if not 1 <= max_depth <= _INT8_MAX:
            raise ValueError(f"max_depth must be in [1, {_INT8_MAX}], got {max_depth}")
        self.max_depth = int(max_depth)
        source = ", ".join(str(p) for p in trace.sources) or "<trace>"
        cols = trace.step_columns()
        n_steps = len(cols)
        if n_steps == 0:
            raise ValueError(f"{source}: the trace holds no step records")

        # Lowest rank per server.
        servers = cols.server.astype(str)
        min_rank: dict[str, int] = {}
        for s, r in zip(servers, cols.rank, strict=True):
            min_rank[s] = min(min_rank.get(s, int(r)), int(r))
        use = np.array(
            [
                cols.request_ids[i] is not None
                and cols.prefill_tokens[i] == 0
                and cols.rank[i] == min_rank[servers[i]]
                for i in range(n_steps)
            ],
            dtype=bool,
        )
        step_idx = np.flatnonzero(use)
        if step_idx.size == 0:
            raise ValueError(f"{source}: no decode step carries request_ids")

        # One observation per (step, request of the batch), in step order.
        ids: list[str] = []
        depth: list[int] = []
        accepted: list[int] = []
        for i in step_idx:
            batch_ids = cols.request_ids[i]
            s = int(cols.steps_used[i])
            acc = cols.accepted(i)
            ids.extend(batch_ids)
            depth.extend([s] * len(batch_ids))
            if s == 0:
                accepted.extend([0] * len(batch_ids))
            elif acc.size == len(batch_ids):
                accepted.extend(acc.tolist())
            else:
                accepted.extend([-1] * len(batch_ids))  # unobservable
        obs_id = np.array(ids, dtype=object)
        obs_depth = np.array(depth, dtype=np.int64)
        obs_acc = np.array(accepted, dtype=np.int64)

        unique_ids, first_seen, obs_req = np.unique(
            obs_id.astype(str), return_index=True, return_inverse=True
        )
        # Requests in order of first appearance.
        appearance = np.argsort(first_seen, kind="stable")
        rank_of = np.empty_like(appearance)
        rank_of[appearance] = np.arange(appearance.size)
        obs_req = rank_of[obs_req]
        request_ids = unique_ids[appearance]

        bad_req = np.zeros(request_ids.size, dtype=bool)
        bad_req[obs_req[obs_acc < 0]] = True
        #: Requests left out because a speculative step did not report their acceptance.
        self.dropped_requests = int(bad_req.sum())
        keep = ~bad_req[obs_req]
        obs_req, obs_depth, obs_acc = obs_req[keep], obs_depth[keep], obs_acc[keep]
        if obs_req.size == 0:
            raise ValueError(f"{source}: no request has fully observed acceptance")

        # A request's last step may have been cut by the end of its output (EOS or
        # max tokens): its acceptance is only a lower bound, like a full acceptance.
        last = np.zeros(obs_req.size, dtype=bool)
        last[np.unique(obs_req[::-1], return_index=True)[1]] = True
        last = last[::-1]
        truncated = last & (obs_depth > 0)

        # Empirical conditional rates from speculative observations. A censored
        # observation (accepted == depth, or a last step) says nothing about the
        # position after its accepted drafts.
        spec = obs_depth > 0
        d_cap = self.max_depth
        alphas = np.empty(d_cap)
        prev = math.nan
        for k in range(1, d_cap + 1):
            reached = spec & (obs_depth >= k) & (obs_acc >= k - 1)
            wins = np.count_nonzero(reached & (obs_acc >= k))
            trials = wins + np.count_nonzero(reached & (obs_acc == k - 1) & ~truncated)
            if trials:
                prev = wins / trials
            elif math.isnan(prev):
                raise ValueError(f"{source}: no speculative step to estimate acceptance from")
            alphas[k - 1] = prev
        #: Estimated conditional acceptance rate per draft position 1..max_depth.
        self.alphas = alphas

        censored = (obs_depth == 0) | (obs_acc >= obs_depth) | truncated
        bound = np.minimum(np.where(obs_depth == 0, 0, obs_acc), d_cap)
        committed = np.where(obs_depth == 0, 1, np.minimum(obs_acc, obs_depth) + 1)
        survival = np.concatenate([[1.0], np.cumprod(alphas)])
        rng = np.random.default_rng(seed)

        # Work in request order (stable: step order within a request).
        order = np.argsort(obs_req, kind="stable")
        cens, bnd, last_o = censored[order], bound[order], last[order]
        base = np.minimum(obs_acc[order], d_cap).astype(np.int64)
        u = rng.random(order.size)
        # A censored step that is not the request's last: its run either ends at its
        # last committed position (A = bound), or, with probability alpha_{bound+1},
        # continues into the next step's start, whose value then fixes it:
        # A = bound + 1 + A[next]. Chaining keeps the saw-tooth consistent with the
        # next observation.
        s_next = survival[np.minimum(bnd + 1, d_cap)] * (bnd < d_cap)
        cont_p = np.where(
            survival[bnd] > 0, s_next / np.where(survival[bnd] > 0, survival[bnd], 1), 0
        )
        cont = cens & ~last_o & (u < cont_p)
        base = np.where(cens & ~last_o, bnd + cont, base)
        # A censored last step: bound + extra, P(A >= b + j | A >= b) from the rates.
        tail = np.flatnonzero(cens & last_o)
        if tail.size:
            b = bnd[tail]
            extra = np.zeros(tail.size, dtype=np.int64)
            denom = np.where(survival[b] > 0, survival[b], 1.0)
            for j in range(1, d_cap + 1):
                cond = np.where(b + j <= d_cap, survival[np.minimum(b + j, d_cap)] / denom, 0.0)
                extra += u[tail] < cond
            base[tail] = b + extra
        # value_i = base_i + cont_i * value_{i+1}: a reverse segmented sum; a segment
        # ends (in reverse) wherever cont is 0, e.g. at every request's last step.
        rev_base, rev_cont = base[::-1], cont[::-1]
        csum = np.cumsum(rev_base)
        seg_start = np.flatnonzero(~rev_cont)
        start_of = seg_start[np.searchsorted(seg_start, np.arange(rev_base.size), "right") - 1]
        before = np.where(start_of > 0, csum[np.maximum(start_of - 1, 0)], 0)
        value = np.minimum((csum - before)[::-1], d_cap)

        values = _sawtooth(value, committed[order])
        per_request = np.bincount(obs_req, weights=committed, minlength=request_ids.size)
        per_request = per_request.astype(np.int64)[~bad_req]
        offsets = np.zeros(per_request.size + 1, dtype=np.int64)
        np.cumsum(per_request, out=offsets[1:])
        #: Ids of the requests in :attr:`table`, in order of first appearance.
        self.request_ids = request_ids[~bad_req]
        #: One row per recorded request (its observed positions, filled).
        self.table = AcceptanceTable(offsets, np.minimum(values, d_cap).astype(np.int8))

        classes = None
        if len(trace.requests):
            known = dict(
                zip(
                    trace.requests.request_id.astype(str), trace.requests.request_class, strict=True
                )
            )
            labels = np.array([known.get(r) for r in self.request_ids], dtype=object)
            if any(c is not None for c in labels):
                classes = labels
        self._pool = _SegmentPool(self.table, classes)

    def draw(
        self,
        output_tokens: np.ndarray,
        request_class: np.ndarray | None,
        rng: np.random.Generator,
    ) -> AcceptanceTable:
        """Tile each request from random recorded requests (of its class when known)."""
        return self._pool.draw(output_tokens, request_class, rng)

    def expected_accepted(self, depth: int) -> float:
        """Accepted drafts per step when the recorded requests are replayed at ``depth``."""
        return self.table.mean_accepted(depth)

    def to_config(self) -> dict:
        return {"model": "trace", "max_depth": self.max_depth}


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def expected_accepted(table_or_model: AcceptanceTable | AcceptanceModel, depth: int) -> float:
    """Accepted drafts per verify step at a fixed ``depth``.

    For a table: replayed exactly (last steps truncated). For a model: its
    long-run value (:meth:`AcceptanceModel.expected_accepted`).
    """
    if isinstance(table_or_model, AcceptanceTable):
        return table_or_model.mean_accepted(depth)
    return table_or_model.expected_accepted(depth)


def acceptance_from_config(config: Mapping) -> AcceptanceModel:
    """Build a model from a config mapping (e.g. a profile's ``acceptance:`` section).

    ``model`` is one of:

    * ``parametric``: ``alphas`` (and optional ``structure``), or
      ``mean_accept_length`` + ``depth`` (+ optional ``max_depth``, ``decay``,
      ``structure``) for :meth:`ParametricAcceptance.calibrated`;
    * ``sglang_simulated``: ``mean_accept_length`` (+ ``max_depth``, ``batch_wide``);
    * ``spec_bench``: optional ``path``, ``categories``, ``max_depth``;
    * ``drifting``: ``alphas`` (+ ``drift_sigma``, ``class_sigma``), see
      :class:`DriftingAcceptance`.

    Keys that only document (``note``, ``source``) are allowed; others are an error.
    """
    cfg = dict(config)
    kind = cfg.pop("model", None)
    for doc_key in ("note", "source", "assumption"):
        cfg.pop(doc_key, None)
    allowed = {
        "parametric": {"alphas", "structure", "mean_accept_length", "depth", "max_depth", "decay"},
        "sglang_simulated": {"mean_accept_length", "max_depth", "batch_wide"},
        "spec_bench": {"path", "categories", "max_depth"},
        "drifting": {"alphas", "drift_sigma", "class_sigma"},
    }
    if kind not in allowed:
        raise ValueError(f"acceptance model must be one of {sorted(allowed)}, got {kind!r}")
    unknown = sorted(set(cfg) - allowed[kind])
    if unknown:
        raise ValueError(f"unknown keys for acceptance model {kind!r}: {unknown}")
    if kind == "parametric":
        structure = cfg.get("structure", "iid")
        if "alphas" in cfg:
            extra = sorted(set(cfg) - {"alphas", "structure"})
            if extra:
                raise ValueError(f"give either alphas or a calibration target, not both: {extra}")
            return ParametricAcceptance(cfg["alphas"], structure)
        missing = [k for k in ("mean_accept_length", "depth") if k not in cfg]
        if missing:
            raise ValueError(f"parametric acceptance needs alphas or {missing}")
        return ParametricAcceptance.calibrated(
            float(cfg["mean_accept_length"]),
            int(cfg["depth"]),
            max_depth=int(cfg.get("max_depth", DEFAULT_MAX_DEPTH)),
            decay=float(cfg.get("decay", 0.95)),
            structure=structure,
        )
    if kind == "drifting":
        return DriftingAcceptance(cfg["alphas"], float(cfg.get("drift_sigma", 0.05)),
                                  float(cfg.get("class_sigma", 0.3)))
    if kind == "sglang_simulated":
        if "mean_accept_length" not in cfg:
            raise ValueError("sglang_simulated acceptance needs mean_accept_length")
        return SGLangSimulatedAcceptance(
            float(cfg["mean_accept_length"]), int(cfg.get("max_depth", DEFAULT_MAX_DEPTH)),
            batch_wide=bool(cfg.get("batch_wide", False))
        )
    return SpecBenchAcceptance(
        path=cfg.get("path"),
        categories=cfg.get("categories"),
        max_depth=int(cfg.get("max_depth", DEFAULT_MAX_DEPTH)),
    )
