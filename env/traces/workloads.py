"""Request workloads: open-loop arrival traces and closed-loop client configs.

A :class:`Workload` is a list of requests (arrival time, prompt length, output
length, optional class), read from one of three formats, told apart by content:

* the Azure LLM inference trace CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``);
* the Mooncake JSON-lines trace (``timestamp`` in ms, ``input_length``,
  ``output_length``, ``hash_ids``: the prompt's prefix blocks, ``Workload.prefix_blocks``);
* a specctl trace (:mod:`env.traces.trace_format`), whose request records are used.

:func:`shipped_workload` loads the copies that ship with the package (see
``env/traces/data/SOURCES.md`` for origin and licenses). :class:`ClosedLoop` describes
a fixed number of clients that each send a new request when the previous one
finishes.

Errors name the file, the 1-based line and the field, e.g.
``conv.csv: line 7, field 'GeneratedTokens': must be >= 1, got 0``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from env.traces.trace_format import PARQUET_MAGIC, DataFileError, read_trace


class WorkloadFormatError(DataFileError):
    """A workload file is malformed (``where`` is a 1-based line number)."""

    unit = "line"


@dataclass(frozen=True)
class Workload:
    """An open-loop workload: requests with arrival times and lengths.

    Attributes:
        name: Short name (e.g. ``azure_conv``).
        arrival_s: Arrival times in seconds, float64, sorted, starting near 0.
        prompt_tokens: Prompt lengths, int32, >= 1.
        output_tokens: Output lengths, int32, >= 1.
        request_class: Per-request class (object array of str or None), or None.
        source: Where it came from (a path or a description).
        prefix_blocks: Per request, the ids of its prompt's blocks of
            ``prefix_block_tokens`` tokens (object array of int64 arrays; Mooncake's
            ``hash_ids``): two prompts that share leading ids share that prefix, which
            SGLang's radix cache need not compute twice. None when unknown.
        prefix_block_tokens: Tokens per prefix block (Mooncake: 512).
    """

    name: str
    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    request_class: np.ndarray | None = None
    source: str = ""
    prefix_blocks: np.ndarray | None = None
    prefix_block_tokens: int = 512

    def __post_init__(self) -> None:
        # Coerce once here so every consumer can rely on dtypes and invariants.
        arrival = np.asarray(self.arrival_s, dtype=np.float64)
        prompt = np.asarray(self.prompt_tokens)
        output = np.asarray(self.output_tokens)
        for label, arr in (("prompt_tokens", prompt), ("output_tokens", output)):
            if arr.size and (arr < 1).any():
                i = int(np.flatnonzero(arr < 1)[0])
                raise ValueError(f"workload {self.name!r}: {label}[{i}] = {arr[i]} must be >= 1")
            if arr.size and arr.max() > np.iinfo(np.int32).max:
                raise ValueError(f"workload {self.name!r}: {label} exceeds int32")
        n = arrival.size
        if arrival.ndim != 1 or prompt.shape != (n,) or output.shape != (n,):
            raise ValueError(
                f"workload {self.name!r}: arrival_s, prompt_tokens and output_tokens must be "
                f"1-D of equal length, got {arrival.shape}, {prompt.shape}, {output.shape}"
            )
        if n and not np.isfinite(arrival).all():
            raise ValueError(f"workload {self.name!r}: arrival_s must be finite")
        if n > 1 and (np.diff(arrival) < 0).any():
            i = int(np.flatnonzero(np.diff(arrival) < 0)[0]) + 1
            raise ValueError(f"workload {self.name!r}: arrival_s not sorted at index {i}")
        object.__setattr__(self, "arrival_s", arrival)
        object.__setattr__(self, "prompt_tokens", prompt.astype(np.int32))
        object.__setattr__(self, "output_tokens", output.astype(np.int32))
        if self.request_class is not None:
            classes = np.asarray(self.request_class, dtype=object)
            if classes.shape != (n,):
                raise ValueError(
                    f"workload {self.name!r}: request_class has shape {classes.shape}, "
                    f"expected ({n},)"
                )
            object.__setattr__(self, "request_class", classes)
        if self.prefix_blocks is not None:
            if len(self.prefix_blocks) != n:
                raise ValueError(f"workload {self.name!r}: prefix_blocks has "
                                 f"{len(self.prefix_blocks)} entries, expected {n}")
            blocks = np.empty(n, dtype=object)
            blocks[:] = [np.asarray(b, dtype=np.int64) for b in self.prefix_blocks]
            object.__setattr__(self, "prefix_blocks", blocks)
        if self.prefix_block_tokens < 1:
            raise ValueError(f"workload {self.name!r}: prefix_block_tokens must be >= 1")

    def __len__(self) -> int:
        return int(self.arrival_s.size)

    @property
    def duration_s(self) -> float:
        """Time from 0 to the last arrival (0 for an empty workload)."""
        return float(self.arrival_s[-1]) if len(self) else 0.0

    @property
    def mean_rate(self) -> float:
        """Requests per second over :attr:`duration_s`."""
        return len(self) / self.duration_s if self.duration_s > 0 else math.inf

    def _subset(self, index: np.ndarray, arrival: np.ndarray, name: str) -> Workload:
        return Workload(
            name=name,
            arrival_s=arrival,
            prompt_tokens=self.prompt_tokens[index],
            output_tokens=self.output_tokens[index],
            request_class=None if self.request_class is None else self.request_class[index],
            source=self.source,
            prefix_blocks=None if self.prefix_blocks is None else self.prefix_blocks[index],
            prefix_block_tokens=self.prefix_block_tokens,
        )

    def select(self, mask: np.ndarray) -> Workload:
        """The requests where ``mask`` is true (arrival times unchanged)."""
        index = np.flatnonzero(mask)
        return self._subset(index, self.arrival_s[index], self.name)

    def window(self, start_s: float, duration_s: float) -> Workload:
        """Requests arriving in ``[start_s, start_s + duration_s)``, re-based so start_s = 0."""
        if duration_s <= 0:
            raise ValueError(f"duration_s must be > 0, got {duration_s}")
        lo = np.searchsorted(self.arrival_s, start_s, side="left")
        hi = np.searchsorted(self.arrival_s, start_s + duration_s, side="left")
        index = np.arange(lo, hi)
        return self._subset(
            index, self.arrival_s[index] - start_s, f"{self.name}[{start_s:g}+{duration_s:g}s]"
        )

    def scaled(self, rate_multiplier: float) -> Workload:
        """The same requests arriving ``rate_multiplier`` times as fast (times divided)."""
        if not rate_multiplier > 0:
            raise ValueError(f"rate_multiplier must be > 0, got {rate_multiplier}")
        index = np.arange(len(self))
        return self._subset(
            index, self.arrival_s / rate_multiplier, f"{self.name}x{rate_multiplier:g}"
        )

    def modulated(self, period_s: float, depth: float, phase: float = 0.0) -> Workload:
        """Time-warp the arrivals so the rate rises and falls periodically.

        The new arrival times ``tau`` solve ``W(tau) = t`` for each original time
        ``t``, with ``W(tau) = tau + depth * period/(2 pi) * (cos(phase) -
        cos(2 pi tau/period + phase))``. If the original arrivals have a steady
        rate ``r``, the warped ones have rate ``r * (1 + depth * sin(2 pi tau/period +
        phase))``: the same mean over whole periods, peaks ``(1+depth)/(1-depth)``
        times the troughs. ``depth`` must lie in ``[0, 1)``.
        """
        if not 0.0 <= depth < 1.0:
            raise ValueError(f"depth must be in [0, 1), got {depth}")
        if not period_s > 0:
            raise ValueError(f"period_s must be > 0, got {period_s}")
        t = self.arrival_s
        if depth == 0.0 or not len(self):
            return self._subset(np.arange(len(self)), t.copy(), self.name)
        omega = 2.0 * math.pi / period_s
        amp = depth / omega

        def warp(tau: np.ndarray) -> np.ndarray:
            return tau + amp * (math.cos(phase) - np.cos(omega * tau + phase))

        # W is strictly increasing (W' = 1 + depth*sin(.) >= 1 - depth > 0) and
        # |W(tau) - tau| <= 2*amp, so bisection on [t - 2 amp, t + 2 amp] converges.
        lo = t - 2.0 * amp
        hi = t + 2.0 * amp
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            below = warp(mid) < t
            lo = np.where(below, mid, lo)
            hi = np.where(below, hi, mid)
        tau = np.maximum.accumulate(0.5 * (lo + hi))  # guard against rounding ties
        return self._subset(np.arange(len(self)), tau, f"{self.name}~{period_s:g}s/{depth:g}")

    def with_output_cap(self, max_output_tokens: int) -> Workload:
        """Output lengths capped at ``max_output_tokens`` (>= 1)."""
        if max_output_tokens < 1:
            raise ValueError(f"max_output_tokens must be >= 1, got {max_output_tokens}")
        return Workload(
            name=self.name,
            arrival_s=self.arrival_s,
            prompt_tokens=self.prompt_tokens,
            output_tokens=np.minimum(self.output_tokens, max_output_tokens),
            request_class=self.request_class,
            source=self.source,
            prefix_blocks=self.prefix_blocks,
            prefix_block_tokens=self.prefix_block_tokens,
        )


# ---------------------------------------------------------------------------
# Readers
# ---------------------------------------------------------------------------

_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def _read_lines(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise WorkloadFormatError(path, None, None, f"not UTF-8 text: {exc}") from None
    lines = text.splitlines()
    while lines and not lines[-1].strip():
        lines.pop()  # a trailing newline (or several) is fine
    return lines


_INT32_MAX = int(np.iinfo(np.int32).max)


def _check_count(value: int, path: Path, line: int, field: str) -> None:
    """A token count must lie in [1, int32 max]; the error names file, line and field."""
    if value < 1:
        raise WorkloadFormatError(path, line, field, f"must be >= 1, got {value}")
    if value > _INT32_MAX:
        raise WorkloadFormatError(path, line, field, f"too large: {value} (at most {_INT32_MAX})")


def _parse_ints(values: list[str], path: Path, field: str, first_line: int) -> np.ndarray:
    """Parse decimal ints in [1, int32 max]; the error names the first bad line."""
    try:
        out = np.array(values, dtype=np.int64)
    except (ValueError, OverflowError):
        # Slow path, only to say where: int() takes any size, so 10**20 reaches the check.
        for i, v in enumerate(values):
            try:
                number = int(v)
            except ValueError:
                raise WorkloadFormatError(
                    path, first_line + i, field, f"not an integer: {v!r}"
                ) from None
            _check_count(number, path, first_line + i, field)
        raise  # pragma: no cover - numpy and int() disagree only on overflow
    bad = np.flatnonzero((out < 1) | (out > _INT32_MAX))
    if bad.size:
        i = int(bad[0])
        _check_count(int(out[i]), path, first_line + i, field)
    return out


def _check_sorted(times: np.ndarray, path: Path, field: str, first_line: int) -> None:
    back = np.flatnonzero(np.diff(times) < 0)
    if back.size:
        i = int(back[0]) + 1
        raise WorkloadFormatError(
            path, first_line + i, field, "timestamps must not decrease (rows must be sorted)"
        )


def read_azure_csv(path: str | os.PathLike, name: str | None = None) -> Workload:
    """Read an Azure LLM inference trace CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``).

    Timestamps look like ``2023-11-16 18:17:03.9799600`` (up to 9 fractional
    digits); arrival times are seconds from the first row.
    """
    path = Path(path)
    lines = _read_lines(path)
    if not lines:
        raise WorkloadFormatError(path, None, None, "empty file")
    header = [h.strip() for h in lines[0].lstrip("\ufeff").split(",")]
    for h in header:
        if h not in _AZURE_COLUMNS:
            raise WorkloadFormatError(path, 1, h, "unknown column")
    for c in _AZURE_COLUMNS:
        if c not in header:
            raise WorkloadFormatError(path, 1, c, "missing column")
    if len(set(header)) != len(header):
        raise WorkloadFormatError(path, 1, None, f"duplicate columns in header {header}")
    if len(lines) < 2:
        raise WorkloadFormatError(path, None, None, "no data rows")
    col = {h: j for j, h in enumerate(header)}
    width = len(header)
    rows = [line.split(",") for line in lines[1:]]
    for i, r in enumerate(rows):
        if len(r) != width:
            what = "empty line" if not lines[i + 1].strip() else f"{len(r)} fields"
            raise WorkloadFormatError(path, i + 2, None, f"{what}, expected {width} fields")
    stamps = [r[col["TIMESTAMP"]].strip() for r in rows]
    try:
        times = np.array(stamps, dtype="datetime64[ns]")
    except ValueError:
        for i, s in enumerate(stamps):
            try:
                np.datetime64(s, "ns")
            except ValueError:
                raise WorkloadFormatError(
                    path, i + 2, "TIMESTAMP", f"not a timestamp: {s!r}"
                ) from None
        raise  # pragma: no cover
    if np.isnat(times).any():
        i = int(np.flatnonzero(np.isnat(times))[0])
        raise WorkloadFormatError(path, i + 2, "TIMESTAMP", f"not a timestamp: {stamps[i]!r}")
    ns = times.astype(np.int64)
    _check_sorted(ns, path, "TIMESTAMP", 2)
    prompt = _parse_ints([r[col["ContextTokens"]].strip() for r in rows], path, "ContextTokens", 2)
    output = _parse_ints(
        [r[col["GeneratedTokens"]].strip() for r in rows], path, "GeneratedTokens", 2
    )
    return Workload(
        name=name or path.stem,
        arrival_s=(ns - ns[0]) / 1e9,
        prompt_tokens=prompt,
        output_tokens=output,
        source=str(path),
    )


_MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length")
_MOONCAKE_OPTIONAL = ("hash_ids",)
#: Tokens per ``hash_ids`` block of the Mooncake traces (FAST'25 release).
MOONCAKE_BLOCK_TOKENS = 512


def read_mooncake_jsonl(path: str | os.PathLike, name: str | None = None) -> Workload:
    """Read a Mooncake trace (JSON lines: ``timestamp`` ms, ``input_length``, ``output_length``,
    optionally ``hash_ids``: the prompt's 512-token blocks, shared ids = a shared prefix).

    Any other key is an error. Arrival times are seconds from the first row. The
    workload has ``prefix_blocks`` when every row has ``hash_ids``.
    """
    path = Path(path)
    lines = _read_lines(path)
    if not lines:
        raise WorkloadFormatError(path, None, None, "empty file")
    ts = np.empty(len(lines), dtype=np.float64)
    prompt = np.empty(len(lines), dtype=np.int64)
    output = np.empty(len(lines), dtype=np.int64)
    allowed = set(_MOONCAKE_FIELDS) | set(_MOONCAKE_OPTIONAL)
    blocks: list[np.ndarray | None] = []
    for i, line in enumerate(lines):
        lineno = i + 1
        if not line.strip():
            raise WorkloadFormatError(path, lineno, None, "empty line")
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkloadFormatError(path, lineno, None, f"malformed JSON: {exc.msg}") from None
        except RecursionError:
            raise WorkloadFormatError(
                path, lineno, None, "JSON nested too deeply (expected one flat object)"
            ) from None
        if not isinstance(obj, dict):
            raise WorkloadFormatError(path, lineno, None, "expected a JSON object")
        for key in obj:
            if key not in allowed:
                raise WorkloadFormatError(path, lineno, key, "unknown field")
        for key in _MOONCAKE_FIELDS:
            if key not in obj:
                raise WorkloadFormatError(path, lineno, key, "missing field")
        t = obj["timestamp"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
            raise WorkloadFormatError(path, lineno, "timestamp", f"not a finite number: {t!r}")
        ts[i] = t
        for key, dest in (("input_length", prompt), ("output_length", output)):
            v = obj[key]
            if isinstance(v, bool) or not isinstance(v, int):
                raise WorkloadFormatError(path, lineno, key, f"not an integer: {v!r}")
            _check_count(v, path, lineno, key)
            dest[i] = v
        blocks.append(_hash_ids(obj.get("hash_ids"), path, lineno))
    _check_sorted(ts, path, "timestamp", 1)
    return Workload(
        name=name or path.stem,
        arrival_s=(ts - ts[0]) / 1e3,
        prompt_tokens=prompt,
        output_tokens=output,
        source=str(path),
        prefix_blocks=None if any(b is None for b in blocks) else blocks,
        prefix_block_tokens=MOONCAKE_BLOCK_TOKENS,
    )


def _hash_ids(value, path: Path, lineno: int) -> np.ndarray | None:
    """A row's ``hash_ids``: a list of non-negative integers (None when absent)."""
    if value is None:
        return None
    if not isinstance(value, list) or any(
            isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value):
        raise WorkloadFormatError(path, lineno, "hash_ids",
                                  f"not a list of non-negative integers: {value!r:.80}")
    return np.asarray(value, dtype=np.int64)


def workload_from_trace(paths: str | os.PathLike | Sequence, name: str | None = None) -> Workload:
    """The request records of a specctl trace as a workload (arrivals re-based to 0)."""
    trace = read_trace(paths)
    req = trace.requests
    if not len(req):
        src = ", ".join(str(p) for p in trace.sources)
        raise WorkloadFormatError(src, None, None, "trace holds no request records")
    classes = req.request_class
    has_class = any(c is not None for c in classes)
    first = Path(trace.sources[0])
    return Workload(
        name=name or first.stem,
        arrival_s=req.arrival_s - req.arrival_s[0],
        prompt_tokens=req.prompt_tokens,
        output_tokens=req.output_tokens,
        request_class=classes if has_class else None,
        source=", ".join(str(p) for p in trace.sources),
    )


def detect_format(path: str | os.PathLike) -> str:
    """``"trace"``, ``"azure_csv"`` or ``"mooncake_jsonl"``, judged by content."""
    path = Path(path)
    if path.is_dir():
        return "trace"
    with path.open("rb") as fh:
        head = fh.read(4096)
    if head.startswith(PARQUET_MAGIC):
        # The trace reader says what is wrong with it: no specctl metadata, or a
        # truncated / corrupt file (whose metadata cannot be read at all).
        return "trace"
    first = head.split(b"\n", 1)[0].decode("utf-8", "replace").lstrip("\ufeff").strip()
    if first.startswith("{"):
        return "mooncake_jsonl"
    if "TIMESTAMP" in [h.strip() for h in first.split(",")]:
        return "azure_csv"
    raise WorkloadFormatError(
        path,
        1,
        None,
        "unrecognised workload format (expected a specctl trace, an Azure CSV with a "
        "TIMESTAMP column, or Mooncake JSON lines)",
    )


def load_workload(path: str | os.PathLike, name: str | None = None) -> Workload:
    """Read a workload from any supported file, telling the format by content."""
    kind = detect_format(path)
    if kind == "trace":
        return workload_from_trace(path, name)
    if kind == "azure_csv":
        return read_azure_csv(path, name)
    return read_mooncake_jsonl(path, name)


#: Shipped workloads: name -> file under ``env/traces/data/``.
SHIPPED_WORKLOADS = {
    "azure_code": "AzureLLMInferenceTrace_code.csv",
    "azure_conv": "AzureLLMInferenceTrace_conv.csv",
    "mooncake": "synthetic_trace.jsonl",
}


def shipped_workload(name: str) -> Workload:
    """A workload that ships with the package: ``azure_code``, ``azure_conv`` or ``mooncake``."""
    if name not in SHIPPED_WORKLOADS:
        raise KeyError(
            f"unknown shipped workload {name!r}; choose from {sorted(SHIPPED_WORKLOADS)}"
        )
    ref = resources.files("env.traces").joinpath("data", SHIPPED_WORKLOADS[name])
    with resources.as_file(ref) as path:
        return load_workload(path, name)


# ---------------------------------------------------------------------------
# Closed loop
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ClosedLoop:
    """``concurrency`` clients, each sending its next request when the last one ends.

    Lengths are fixed (``prompt_tokens`` / ``output_tokens``) or, where not
    fixed, sampled jointly (prompt and output of the same request, so their
    correlation is kept) from ``lengths_from``.

    Attributes:
        concurrency: Number of clients, >= 1.
        prompt_tokens: Fixed prompt length, or None to sample it.
        output_tokens: Fixed output length, or None to sample it.
        lengths_from: Workload whose requests' lengths are sampled.
        requests_per_client: Requests each client sends; None = until the horizon.
        start_interval_s: Client i sends its first request at ``i * start_interval_s``
            (a load generator starting its clients one after another).
        client_overhead_s: Time each request spends outside the server: sending
            it, HTTP handling, the response's way back. A request reaches the
            server this long after its client sends it (its first at its start
            time, later ones when the previous response is complete), so an
            end-to-end time measured by the client includes it once per request.
        send_until_s: Clients send a request only before this time, then wait for
            the answers (``scripts/h200/loadgen.py``'s closed loop: its throughput is
            every token over the time to the last answer); None: until the horizon.
    """

    concurrency: int
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    lengths_from: Workload | None = None
    requests_per_client: int | None = None
    start_interval_s: float = 0.0
    client_overhead_s: float = 0.0
    send_until_s: float | None = None

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.send_until_s is not None and not (self.send_until_s > 0.0
                                                  and math.isfinite(self.send_until_s)):
            raise ValueError(f"send_until_s must be finite and > 0 or None, "
                             f"got {self.send_until_s}")
        for label in ("start_interval_s", "client_overhead_s"):
            value = getattr(self, label)
            if not (value >= 0.0 and math.isfinite(value)):
                raise ValueError(f"{label} must be finite and >= 0, got {value}")
        for label in ("prompt_tokens", "output_tokens", "requests_per_client"):
            v = getattr(self, label)
            if v is not None and v < 1:
                raise ValueError(f"{label} must be >= 1 or None, got {v}")
        needs_sample = self.prompt_tokens is None or self.output_tokens is None
        if needs_sample and (self.lengths_from is None or not len(self.lengths_from)):
            raise ValueError(
                "give fixed prompt_tokens and output_tokens, or a non-empty lengths_from workload"
            )

    def sample_lengths(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``n`` (prompt, output) lengths as two int32 arrays."""
        if self.lengths_from is not None and (
            self.prompt_tokens is None or self.output_tokens is None
        ):
            index = rng.integers(0, len(self.lengths_from), size=n)
            prompt = self.lengths_from.prompt_tokens[index]
            output = self.lengths_from.output_tokens[index]
        else:
            prompt = output = np.empty(n, dtype=np.int32)
        if self.prompt_tokens is not None:
            prompt = np.full(n, self.prompt_tokens, dtype=np.int32)
        if self.output_tokens is not None:
            output = np.full(n, self.output_tokens, dtype=np.int32)
        return prompt.astype(np.int32, copy=False), output.astype(np.int32, copy=False)
