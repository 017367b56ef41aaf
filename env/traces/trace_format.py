"""The project's trace format: one Parquet file per trace (or per rotated chunk).

A trace holds the requests of a workload and/or the scheduler steps an SGLang
server ran, with the field names of :mod:`env.traces.schema`. Both kinds of record
live in one table with a union schema; the ``record`` column says which kind a
row is, and the columns of the other kind are null on that row.

File-level key-value metadata:

* ``specctl.format``: ``"specctl-trace"``;
* ``specctl.schema_version``: ``str(env.traces.schema.SCHEMA_VERSION)``;
* ``specctl.meta``: a free-form JSON object (server args, profile used, ...).

Columns (R = request rows, S = step rows; every column is nullable, and must be
non-null on the rows of the kinds listed, except ``request_class`` and
``request_ids``):

==================  =============  =====  ==============================================
column              type           rows   meaning
==================  =============  =====  ==============================================
record              string         R S    ``"request"`` or ``"step"``
request_id          string         R      unique id of the request within the trace
arrival_s           float64        R      arrival time (s) from the start of the trace
prompt_tokens       int32          R      prompt length in tokens, >= 1
output_tokens       int32          R      generated tokens, >= 1
request_class       string         R      optional category (e.g. a Spec-Bench category)
server              string         S      name of the server that ran the step
rank                int32          S      tensor-parallel rank that reported it
step_index          int64          S      step counter, strictly increasing per (server,
                                          rank, run): see ``run_id`` below
time_s              float64        S      launch time of the step (monotonic clock, s)
batch_size          int32          S      requests in the step's batch, >= 0
waiting_requests    int32          S      requests queued at launch, >= 0
running_requests    int32          S      requests admitted at launch, >= 0
kv_used_tokens      int64          S      KV-cache slots in use at launch, >= 0
kv_capacity_tokens  int64          S      KV-cache slots in all, >= 0
prefill_tokens      int64          S      prompt tokens computed (0 for a decode step)
steps_used          int8           S      draft depth of the step (0 = no speculation)
accepted_drafts     list<int8>     S      accepted drafts per request of the batch, each
                                          in [0, steps_used]; empty if steps_used == 0;
                                          at most ``batch_size`` entries
step_latency_s      float64        S      wall time of the step (s), finite and >= 0:
                                          previous step's result to this step's
request_ids         list<string>   S      optional: ids of the batch, ``batch_size`` of
                                          them, aligned with ``accepted_drafts``
prefill_pairs       float64        S      optional: a prefill step's attention token
                                          pairs over its prompts, finite and >= 0; the
                                          column may be absent (files written before it)
warmup              bool           S      optional: the step was the plugin's re-entry
                                          warm-up (``StepRecord.warmup``); true only on
                                          a decode row with ``steps_used`` 0; null
                                          where unknown; the column may be absent (files
                                          written before it: every row unknown)
before_prefill      bool           S      optional: the batch launched right after this
                                          step, before its result was processed, was a
                                          prefill (``StepRecord.before_prefill``); null
                                          where unknown; the column may be absent (files
                                          written before it: every row unknown)
==================  =============  =====  ==============================================

Request rows must be sorted by ``arrival_s`` within a file (the writer sorts
them); when several files are read, their requests are merged by arrival.

A recording run (one server process writing rotated files) puts its ``run_id``
in ``specctl.meta`` and in the file names. A server restarted into the same
directory starts its step counter again under a new run id, so ``step_index``
must increase only within a (server, rank, run); files without a ``run_id``
(written by :func:`write_trace`) count as one run per (server, rank).

Errors name the file, the 0-based row of the Parquet table and the field, e.g.
``trace.parquet: row 12, field 'output_tokens': must be >= 1, got -3``.
"""

from __future__ import annotations

import glob
import json
import os
import re
import tarfile
import tempfile
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from env.traces.schema import SCHEMA_VERSION, RequestRecord, StepRecord

FORMAT = "specctl-trace"
META_FORMAT = b"specctl.format"
META_SCHEMA_VERSION = b"specctl.schema_version"
META_META = b"specctl.meta"
PARQUET_MAGIC = b"PAR1"

REQUEST = "request"
STEP = "step"

#: The table's columns, in order, with their Arrow types.
SCHEMA = pa.schema(
    [
        ("record", pa.string()),
        ("request_id", pa.string()),
        ("arrival_s", pa.float64()),
        ("prompt_tokens", pa.int32()),
        ("output_tokens", pa.int32()),
        ("request_class", pa.string()),
        ("server", pa.string()),
        ("rank", pa.int32()),
        ("step_index", pa.int64()),
        ("time_s", pa.float64()),
        ("batch_size", pa.int32()),
        ("waiting_requests", pa.int32()),
        ("running_requests", pa.int32()),
        ("kv_used_tokens", pa.int64()),
        ("kv_capacity_tokens", pa.int64()),
        ("prefill_tokens", pa.int64()),
        ("steps_used", pa.int8()),
        ("accepted_drafts", pa.list_(pa.int8())),
        ("step_latency_s", pa.float64()),
        ("request_ids", pa.list_(pa.string())),
        ("prefill_pairs", pa.float64()),
        ("warmup", pa.bool_()),
        ("before_prefill", pa.bool_()),
    ]
)
#: Columns a file may lack (written before they existed): read as all null.
_OPTIONAL_COLUMNS = ("prefill_pairs", "warmup", "before_prefill")
#: The codes of a flag column (:data:`FLAG_COLUMNS`) in :class:`StepColumns`: unknown
#: (None), false, true.
FLAG_UNKNOWN, FLAG_NO, FLAG_YES = -1, 0, 1
#: The optional bool columns: a bool or null (unknown) per step row.
FLAG_COLUMNS = ("warmup", "before_prefill")

_REQUEST_REQUIRED = ("request_id", "arrival_s", "prompt_tokens", "output_tokens")
_STEP_SCALARS = (
    "server",
    "rank",
    "step_index",
    "time_s",
    "batch_size",
    "waiting_requests",
    "running_requests",
    "kv_used_tokens",
    "kv_capacity_tokens",
    "prefill_tokens",
    "steps_used",
    "step_latency_s",
)
_STEP_NON_NEGATIVE = (
    "batch_size",
    "waiting_requests",
    "running_requests",
    "kv_used_tokens",
    "kv_capacity_tokens",
    "prefill_tokens",
    "steps_used",
)


class DataFileError(ValueError):
    """A data file is malformed; says which file, where and which field.

    Attributes:
        file: Name of the file (or a label such as ``<memory>``).
        where: The row (Parquet, 0-based) or line (text files, 1-based), or None.
        field: The offending field or column, or None when the file as a whole is bad.
        message: What is wrong.
    """

    unit = "row"

    def __init__(
        self, file: str | os.PathLike, where: int | None, field: str | None, message: str
    ) -> None:
        self.file = str(file)
        self.where = where
        self.field = field
        self.message = message
        super().__init__(str(self))

    def __str__(self) -> str:
        parts = []
        if self.where is not None:
            parts.append(f"{self.unit} {self.where}")
        if self.field is not None:
            parts.append(f"field {self.field!r}")
        location = ", ".join(parts)
        if not location:
            return f"{self.file}: {self.message}"
        return f"{self.file}: {location}: {self.message}"


class TraceFormatError(DataFileError):
    """A trace file is not a valid specctl trace (``where`` is a 0-based row)."""

    unit = "row"


def _int8_drafts(values: Any) -> np.ndarray:
    """One record's accepted drafts as int8, refusing what int8 would wrap or truncate."""
    if isinstance(values, np.ndarray) and values.dtype == np.int8:
        return values.ravel()
    try:
        array = np.asarray(values)
        fractional = array.dtype.kind == "f" and not np.all(np.mod(array, 1) == 0)
        if array.size and (array.dtype.kind not in "iubf" or fractional):
            raise ValueError(f"{values!r} are not integers")
        if array.size and (array.min() < -128 or array.max() > 127):
            raise ValueError(f"{int(array.max())} does not fit int8")
        return array.astype(np.int8).ravel()
    except (OverflowError, TypeError, ValueError) as exc:
        raise StepFieldError("accepted_drafts", exc) from None


class StepFieldError(ValueError):
    """A step record's field holds a value its column cannot store (names the field)."""

    def __init__(self, field: str, problem: object) -> None:
        super().__init__(f"step records: field {field!r}: {problem}")
        self.field = field
        self.problem = problem


# ---------------------------------------------------------------------------
# In-memory representation
# ---------------------------------------------------------------------------


_REQUEST_COLUMNS = ("request_id", "arrival_s", "prompt_tokens", "output_tokens",
                    "request_class")


@dataclass
class RequestColumns:
    """The request records of a trace, column by column (sorted by arrival)."""

    request_id: np.ndarray  # object (str)
    arrival_s: np.ndarray  # float64
    prompt_tokens: np.ndarray  # int32
    output_tokens: np.ndarray  # int32
    request_class: np.ndarray  # object (str or None)

    def __len__(self) -> int:
        return int(self.arrival_s.size)

    @classmethod
    def empty(cls) -> RequestColumns:
        """No requests."""
        return cls(
            request_id=np.empty(0, dtype=object),
            arrival_s=np.empty(0, dtype=np.float64),
            prompt_tokens=np.empty(0, dtype=np.int32),
            output_tokens=np.empty(0, dtype=np.int32),
            request_class=np.empty(0, dtype=object),
        )

    @classmethod
    def from_records(cls, records: Iterable[RequestRecord]) -> RequestColumns:
        """Columns from :class:`~env.traces.schema.RequestRecord` s (kept in the given order)."""
        records = list(records)
        return cls(
            request_id=np.array([r.request_id for r in records], dtype=object),
            arrival_s=np.array([r.arrival_s for r in records], dtype=np.float64),
            prompt_tokens=np.array([r.prompt_tokens for r in records], dtype=np.int32),
            output_tokens=np.array([r.output_tokens for r in records], dtype=np.int32),
            request_class=np.array([r.request_class for r in records], dtype=object),
        )

    def records(self) -> list[RequestRecord]:
        """The rows as :class:`~env.traces.schema.RequestRecord` s (a ValueError naming
        the columns when they differ in length)."""
        lengths = {name: len(getattr(self, name)) for name in _REQUEST_COLUMNS}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"request columns of unequal length: {lengths}")
        return [
            RequestRecord(str(i), float(a), int(p), int(o), None if c is None else str(c))
            for i, a, p, o, c in zip(
                self.request_id,
                self.arrival_s,
                self.prompt_tokens,
                self.output_tokens,
                self.request_class,
                strict=True,
            )
        ]


@dataclass
class StepColumns:
    """The step records of a trace, column by column.

    ``accepted_drafts`` is stored flat: request ``j`` of step ``i`` accepted
    ``accepted_values[accepted_offsets[i] + j]`` drafts.
    """

    server: np.ndarray  # object (str)
    rank: np.ndarray  # int32
    step_index: np.ndarray  # int64
    time_s: np.ndarray  # float64
    batch_size: np.ndarray  # int32
    waiting_requests: np.ndarray  # int32
    running_requests: np.ndarray  # int32
    kv_used_tokens: np.ndarray  # int64
    kv_capacity_tokens: np.ndarray  # int64
    prefill_tokens: np.ndarray  # int64
    steps_used: np.ndarray  # int8
    step_latency_s: np.ndarray  # float64
    accepted_offsets: np.ndarray  # int64, len n + 1
    accepted_values: np.ndarray  # int8
    request_ids: list[list[str] | None]
    #: float64; NaN where a step's pairs were not recorded.
    prefill_pairs: np.ndarray | None = None
    #: int8: ``StepRecord.warmup`` as FLAG_UNKNOWN (-1, None), FLAG_NO (0) or FLAG_YES (1).
    warmup: np.ndarray | None = None
    #: int8: ``StepRecord.before_prefill``, coded as :attr:`warmup`.
    before_prefill: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.prefill_pairs is None:
            self.prefill_pairs = np.full(len(self.step_index), np.nan)
        for name in FLAG_COLUMNS:
            if getattr(self, name) is None:
                setattr(self, name, np.full(len(self.step_index), FLAG_UNKNOWN, dtype=np.int8))

    def __len__(self) -> int:
        return int(self.step_index.size)

    @classmethod
    def from_records(cls, records: Sequence[StepRecord]) -> StepColumns:
        """Columns from :class:`~env.traces.schema.StepRecord` s.

        Raises :class:`StepFieldError` (naming the field and the record) for a value its
        column cannot hold: out of range, or a fraction in an integer column (numpy would
        wrap or truncate it silently).
        """
        accepted = [_int8_drafts(r.accepted_drafts) for r in records]
        lengths = np.fromiter((a.size for a in accepted), dtype=np.int64, count=len(accepted))
        offsets = np.zeros(len(accepted) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = np.concatenate(accepted) if accepted else np.empty(0, dtype=np.int8)

        def col(name: str, dtype: Any) -> np.ndarray:
            values = [getattr(r, name) for r in records]
            try:
                column = np.array(values, dtype=dtype)
            except (OverflowError, TypeError, ValueError) as exc:
                raise StepFieldError(name, exc) from None
            if column.dtype.kind == "i":
                fraction = next((v for v in values if isinstance(v, float | np.floating)
                                 and not float(v).is_integer()), None)
                if fraction is not None:
                    raise StepFieldError(name, f"{fraction!r} is not an integer")
            return column

        return cls(
            server=col("server", object),
            rank=col("rank", np.int32),
            step_index=col("step_index", np.int64),
            time_s=col("time_s", np.float64),
            batch_size=col("batch_size", np.int32),
            waiting_requests=col("waiting_requests", np.int32),
            running_requests=col("running_requests", np.int32),
            kv_used_tokens=col("kv_used_tokens", np.int64),
            kv_capacity_tokens=col("kv_capacity_tokens", np.int64),
            prefill_tokens=col("prefill_tokens", np.int64),
            steps_used=col("steps_used", np.int8),
            step_latency_s=col("step_latency_s", np.float64),
            accepted_offsets=offsets,
            accepted_values=values.astype(np.int8, copy=False),
            request_ids=[None if r.request_ids is None else list(r.request_ids) for r in records],
            prefill_pairs=np.array([np.nan if r.prefill_pairs is None else r.prefill_pairs
                                    for r in records], dtype=np.float64),
            **{name: np.array([_flag_code(name, getattr(r, name)) for r in records],
                              dtype=np.int8) for name in FLAG_COLUMNS},
        )

    def accepted(self, i: int) -> np.ndarray:
        """Accepted drafts per request of step ``i``."""
        return self.accepted_values[self.accepted_offsets[i] : self.accepted_offsets[i + 1]]

    def records(self) -> list[StepRecord]:
        """The rows as :class:`~env.traces.schema.StepRecord` s (accepted arrays are views)."""
        off = self.accepted_offsets
        vals = self.accepted_values
        out = []
        for i in range(len(self)):
            out.append(
                StepRecord(
                    server=str(self.server[i]),
                    rank=int(self.rank[i]),
                    step_index=int(self.step_index[i]),
                    time_s=float(self.time_s[i]),
                    batch_size=int(self.batch_size[i]),
                    waiting_requests=int(self.waiting_requests[i]),
                    running_requests=int(self.running_requests[i]),
                    kv_used_tokens=int(self.kv_used_tokens[i]),
                    kv_capacity_tokens=int(self.kv_capacity_tokens[i]),
                    prefill_tokens=int(self.prefill_tokens[i]),
                    steps_used=int(self.steps_used[i]),
                    accepted_drafts=vals[off[i] : off[i + 1]],
                    step_latency_s=float(self.step_latency_s[i]),
                    request_ids=self.request_ids[i],
                    prefill_pairs=(None if np.isnan(self.prefill_pairs[i])
                                   else float(self.prefill_pairs[i])),
                    warmup=_FLAG_VALUES[self.warmup[i]],
                    before_prefill=_FLAG_VALUES[self.before_prefill[i]],
                )
            )
        return out


_FLAG_VALUES = {FLAG_UNKNOWN: None, FLAG_NO: False, FLAG_YES: True}


def _flag_code(name: str, value: object) -> int:
    """A record's flag ``name`` (None, or a bool) as its :class:`StepColumns` code."""
    if value is None:
        return FLAG_UNKNOWN
    if not isinstance(value, bool | np.bool_):
        raise StepFieldError(name, f"{value!r} is not None, True or False")
    return FLAG_YES if value else FLAG_NO


@dataclass
class Trace:
    """A trace read from (or about to be written to) Parquet.

    Attributes:
        requests: Request records, columnar, sorted by arrival.
        steps: Step records in file order (files in natural name order).
        meta: The ``specctl.meta`` JSON object of the first file.
        sources: The files read, in order.
    """

    requests: RequestColumns
    steps: list[StepRecord]
    meta: dict = field(default_factory=dict)
    sources: list[Path] = field(default_factory=list)
    _step_columns: StepColumns | None = field(default=None, repr=False, compare=False)

    def step_columns(self) -> StepColumns:
        """The step records as columns (cached; built from :attr:`steps` if needed)."""
        if self._step_columns is None or len(self._step_columns) != len(self.steps):
            self._step_columns = StepColumns.from_records(self.steps)
        return self._step_columns


# ---------------------------------------------------------------------------
# Building and validating tables
# ---------------------------------------------------------------------------


def _list_array(
    offsets: np.ndarray, values: pa.Array, valid: np.ndarray, value_type: pa.DataType
) -> pa.Array:
    mask = pa.array(~valid) if not valid.all() else None
    return pa.ListArray.from_arrays(
        pa.array(offsets.astype(np.int32)), values, type=pa.list_(value_type), mask=mask
    )


def _build_table(requests: RequestColumns, steps: StepColumns) -> pa.Table:
    """One union table: request rows first, then step rows."""
    n_req, n_step = len(requests), len(steps)
    n = n_req + n_step

    def pad(name: str, values: np.ndarray | list, first: bool) -> pa.Array:
        # Request columns hold values on the first n_req rows, step columns on the rest.
        arrow_type = SCHEMA.field(name).type
        valid = np.zeros(n, dtype=bool)
        if first:
            valid[:n_req] = True
            full: list | np.ndarray = list(values) + [None] * n_step
        else:
            valid[n_req:] = True
            full = [None] * n_req + list(values)
        if arrow_type == pa.string():
            return pa.array(full, type=arrow_type)
        filled = np.zeros(n, dtype=arrow_type.to_pandas_dtype())
        given = np.asarray(values)
        converted = given.astype(filled.dtype)
        # numpy wraps an integer that does not fit (2**40 + 5 became 5): refuse it.
        if np.issubdtype(filled.dtype, np.integer) and not np.array_equal(converted, given):
            bad = given[np.flatnonzero(converted != given)[0]]
            raise OverflowError(f"field {name!r}: {bad} does not fit {arrow_type}")
        filled[valid] = converted
        return pa.array(filled, type=arrow_type, mask=~valid)

    columns: dict[str, pa.Array] = {
        "record": pa.array([REQUEST] * n_req + [STEP] * n_step, type=pa.string())
    }
    for name in ("request_id", "arrival_s", "prompt_tokens", "output_tokens"):
        columns[name] = pad(name, getattr(requests, name), True)
    columns["request_class"] = pa.array(
        [None if c is None else str(c) for c in requests.request_class] + [None] * n_step,
        type=pa.string(),
    )
    for name in _STEP_SCALARS:
        columns[name] = pad(name, getattr(steps, name), False)

    # accepted_drafts: null on request rows, a list on step rows.
    off = np.concatenate([np.zeros(n_req, dtype=np.int64), steps.accepted_offsets])
    valid = np.zeros(n, dtype=bool)
    valid[n_req:] = True
    columns["accepted_drafts"] = _list_array(
        off, pa.array(steps.accepted_values, type=pa.int8()), valid, pa.int8()
    )

    # request_ids: null on request rows and where a step has none.
    ids_valid = np.zeros(n, dtype=bool)
    ids_len = np.zeros(n, dtype=np.int64)
    flat: list[str] = []
    for i, ids in enumerate(steps.request_ids):
        if ids is not None:
            ids_valid[n_req + i] = True
            ids_len[n_req + i] = len(ids)
            flat.extend(str(x) for x in ids)
    ids_off = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(ids_len, out=ids_off[1:])
    columns["request_ids"] = _list_array(
        ids_off, pa.array(flat, type=pa.string()), ids_valid, pa.string()
    )
    # prefill_pairs: null on request rows and where a step has none (NaN).
    pairs = np.concatenate([np.full(n_req, np.nan), steps.prefill_pairs])
    columns["prefill_pairs"] = pa.array(pairs, type=pa.float64(), mask=np.isnan(pairs))
    # The flags: null on request rows and where unknown.
    for name in FLAG_COLUMNS:
        codes = np.concatenate([np.full(n_req, FLAG_UNKNOWN, dtype=np.int8),
                                getattr(steps, name)])
        columns[name] = pa.array(codes == FLAG_YES, type=pa.bool_(), mask=codes == FLAG_UNKNOWN)
    return pa.table([columns[f.name] for f in SCHEMA], schema=SCHEMA)


def _first(mask: np.ndarray) -> int | None:
    hits = np.flatnonzero(mask)
    return int(hits[0]) if hits.size else None


def _check(file: str, rows: np.ndarray, bad: np.ndarray, name: str, message: Any) -> None:
    """Raise for the first row where ``bad`` holds; ``message(i)`` builds the text."""
    i = _first(bad)
    if i is not None:
        raise TraceFormatError(file, int(rows[i]), name, message(i))


def _conform_schema(table: pa.Table, file: str) -> pa.Table:
    """Check the columns (names, types) and return the table in canonical order."""
    names = table.column_names
    unknown = [c for c in names if c not in SCHEMA.names]
    if unknown:
        raise TraceFormatError(file, None, unknown[0], "unknown column")
    missing = [c for c in SCHEMA.names if c not in names and c not in _OPTIONAL_COLUMNS]
    if missing:
        raise TraceFormatError(file, None, missing[0], "missing column")
    columns = []
    for f in SCHEMA:
        if f.name not in names:  # an optional column the file predates
            columns.append(pa.nulls(table.num_rows, type=f.type))
            continue
        col = table.column(f.name)
        if col.type != f.type:
            try:
                col = col.cast(f.type, safe=True)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise TraceFormatError(
                    file, None, f.name, f"has type {col.type}, expected {f.type} ({exc})"
                ) from None
        columns.append(col)
    return pa.table(columns, schema=SCHEMA)


def _split_table(table: pa.Table, file: str) -> tuple[RequestColumns, StepColumns, np.ndarray]:
    """Validate a canonical table; return its requests, steps and the steps' row numbers."""
    table = table.combine_chunks()
    record = table.column("record").to_numpy(zero_copy_only=False)
    is_req = record == REQUEST
    is_step = record == STEP
    bad = ~(is_req | is_step)
    i = _first(bad)
    if i is not None:
        raise TraceFormatError(file, i, "record", f"must be 'request' or 'step', got {record[i]!r}")
    req_rows = np.flatnonzero(is_req)
    step_rows = np.flatnonzero(is_step)

    def column(name: str, rows: np.ndarray) -> pa.Array:
        return table.column(name).combine_chunks().take(pa.array(rows, type=pa.int64()))

    def non_null(name: str, rows: np.ndarray) -> pa.Array:
        arr = column(name, rows)
        if arr.null_count:
            nulls = np.asarray(arr.is_null().to_numpy(zero_copy_only=False))
            raise TraceFormatError(
                file, int(rows[_first(nulls)]), name, f"must not be null on a {_kind(name)} row"
            )
        return arr

    # -- requests ----------------------------------------------------------
    for name in _REQUEST_REQUIRED:
        non_null(name, req_rows)
    req = RequestColumns(
        request_id=column("request_id", req_rows).to_numpy(zero_copy_only=False).astype(object),
        arrival_s=column("arrival_s", req_rows).to_numpy(zero_copy_only=False),
        prompt_tokens=column("prompt_tokens", req_rows).to_numpy(zero_copy_only=False),
        output_tokens=column("output_tokens", req_rows).to_numpy(zero_copy_only=False),
        request_class=column("request_class", req_rows)
        .to_numpy(zero_copy_only=False)
        .astype(object),
    )
    a = req.arrival_s
    _check(file, req_rows, ~np.isfinite(a), "arrival_s", lambda i: f"must be finite, got {a[i]}")
    _check(file, req_rows, a < 0, "arrival_s", lambda i: f"must be >= 0, got {a[i]}")
    if a.size > 1:
        _check(
            file,
            req_rows[1:],
            np.diff(a) < 0,
            "arrival_s",
            lambda i: f"requests must be sorted by arrival: {a[i + 1]} after {a[i]}",
        )
    for name in ("prompt_tokens", "output_tokens"):
        v = getattr(req, name)
        _check(file, req_rows, v < 1, name, lambda i, v=v: f"must be >= 1, got {v[i]}")
    ids = req.request_id
    if ids.size:
        empty = np.array([len(x) == 0 for x in ids], dtype=bool)
        _check(file, req_rows, empty, "request_id", lambda i: "must not be empty")
        order = np.argsort(ids.astype(str), kind="stable")
        dup = np.zeros(ids.size, dtype=bool)
        dup[order[1:]] = ids[order[1:]] == ids[order[:-1]]
        _check(file, req_rows, dup, "request_id", lambda i: f"duplicate id {ids[i]!r}")

    # -- steps ---------------------------------------------------------------
    for name in _STEP_SCALARS:
        non_null(name, step_rows)
    acc = non_null("accepted_drafts", step_rows)
    scal = {name: column(name, step_rows).to_numpy(zero_copy_only=False) for name in _STEP_SCALARS}
    for name in _STEP_NON_NEGATIVE:
        v = scal[name]
        _check(file, step_rows, v < 0, name, lambda i, v=v: f"must be >= 0, got {v[i]}")
    for name in ("time_s", "step_latency_s"):
        v = scal[name]
        _check(file, step_rows, ~np.isfinite(v), name, lambda i, v=v: f"must be finite, got {v[i]}")
    lat = scal["step_latency_s"]
    _check(file, step_rows, lat < 0, "step_latency_s", lambda i: f"must be >= 0, got {lat[i]}")

    # step_index strictly increasing per (server, rank).
    server = scal["server"].astype(object)
    rank = scal["rank"]
    index = scal["step_index"]
    if index.size > 1:
        # One integer key per (server, rank); a stable sort keeps file order within a key.
        _, server_code = np.unique(server.astype(str), return_inverse=True)
        # The stride is the span of ranks, not max + 1: a negative rank must not make two
        # servers' keys collide.
        low = int(rank.min())
        keys = server_code.astype(np.int64) * (int(rank.max()) - low + 1) + (rank - low)
        order = np.argsort(keys, kind="stable")
        same = keys[order[1:]] == keys[order[:-1]]
        not_increasing = same & (index[order[1:]] <= index[order[:-1]])
        j = _first(not_increasing)
        if j is not None:
            row = order[j + 1]
            raise TraceFormatError(
                file,
                int(step_rows[row]),
                "step_index",
                f"must strictly increase per (server, rank) = ({server[row]!r}, {rank[row]}): "
                f"{index[row]} after {index[order[j]]}",
            )

    # accepted_drafts: at most batch_size entries, each in [0, steps_used], none at steps 0.
    acc_off = np.asarray(acc.offsets.to_numpy(), dtype=np.int64)
    acc_off = acc_off - acc_off[0] if acc_off.size else np.zeros(1, dtype=np.int64)
    acc_len = np.diff(acc_off)
    flat_acc = acc.flatten()
    if flat_acc.null_count:
        # A null entry would become an arbitrary int8 (NaN cast), silently.
        k = _first(np.asarray(flat_acc.is_null().to_numpy(zero_copy_only=False)))
        i = int(np.repeat(np.arange(acc_len.size), acc_len)[k])
        raise TraceFormatError(
            file, int(step_rows[i]), "accepted_drafts", f"entry {k - acc_off[i]} is null"
        )
    acc_val = np.asarray(flat_acc.to_numpy(zero_copy_only=False), dtype=np.int8)
    batch = scal["batch_size"]
    steps_used = scal["steps_used"]
    _check(
        file,
        step_rows,
        acc_len > batch,
        "accepted_drafts",
        lambda i: f"has {acc_len[i]} entries, more than batch_size {batch[i]}",
    )
    _check(
        file,
        step_rows,
        (steps_used == 0) & (acc_len > 0),
        "accepted_drafts",
        lambda i: f"must be empty when steps_used is 0, got {acc_len[i]} entries",
    )
    if acc_val.size:
        owner = np.repeat(np.arange(acc_len.size), acc_len)
        out_of_range = (acc_val < 0) | (acc_val > steps_used[owner])
        k = _first(out_of_range)
        if k is not None:
            i = owner[k]
            raise TraceFormatError(
                file,
                int(step_rows[i]),
                "accepted_drafts",
                f"entry {k - acc_off[i]} is {acc_val[k]}, outside [0, steps_used={steps_used[i]}]",
            )

    ids_arr = column("request_ids", step_rows)
    if ids_arr.null_count < len(ids_arr):
        has_ids = ~np.asarray(ids_arr.is_null().to_numpy(zero_copy_only=False))
        ids_len = np.asarray(
            pc.list_value_length(ids_arr).fill_null(0).to_numpy(zero_copy_only=False)
        )
        _check(
            file,
            step_rows,
            has_ids & (ids_len != batch),
            "request_ids",
            lambda i: f"has {ids_len[i]} ids, expected batch_size {batch[i]}",
        )
        _check(
            file,
            step_rows,
            has_ids & (acc_len > 0) & (acc_len != ids_len),
            "accepted_drafts",
            lambda i: f"has {acc_len[i]} entries but request_ids has {ids_len[i]}",
        )
        flat_ids = ids_arr.flatten()
        if flat_ids.null_count:
            owner = np.repeat(np.arange(ids_len.size), ids_len)
            k = _first(np.asarray(flat_ids.is_null().to_numpy(zero_copy_only=False)))
            raise TraceFormatError(file, int(step_rows[owner[k]]), "request_ids", "holds a null id")
    request_ids: list[list[str] | None] = ids_arr.to_pylist()

    pairs_arr = column("prefill_pairs", step_rows)
    pairs = np.array(pairs_arr.to_numpy(zero_copy_only=False),
                     dtype=np.float64)  # null -> NaN; a copy (arrow's buffer is read-only)
    pairs_null = np.asarray(pairs_arr.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    _check(file, step_rows, ~pairs_null & ~(np.isfinite(pairs) & (pairs >= 0)), "prefill_pairs",
           lambda i: f"must be finite and >= 0, got {pairs[i]}")
    pairs[pairs_null] = np.nan

    flags = {}
    for name in FLAG_COLUMNS:
        arr = column(name, step_rows)
        null = np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool)
        true = np.asarray(arr.fill_null(False).to_numpy(zero_copy_only=False), dtype=bool)
        codes = np.where(null, FLAG_UNKNOWN, np.where(true, FLAG_YES, FLAG_NO))
        flags[name] = codes.astype(np.int8)
    warmup_true = flags["warmup"] == FLAG_YES
    _check(file, step_rows, warmup_true & ((steps_used != 0) | (scal["prefill_tokens"] != 0)),
           "warmup", lambda i: "a warm-up must be a decode step at steps_used 0, got "
           f"steps_used {steps_used[i]} and prefill_tokens {scal['prefill_tokens'][i]}")

    steps = StepColumns(
        server=server,
        rank=rank.astype(np.int32, copy=False),
        step_index=index.astype(np.int64, copy=False),
        time_s=scal["time_s"],
        batch_size=batch.astype(np.int32, copy=False),
        waiting_requests=scal["waiting_requests"].astype(np.int32, copy=False),
        running_requests=scal["running_requests"].astype(np.int32, copy=False),
        kv_used_tokens=scal["kv_used_tokens"].astype(np.int64, copy=False),
        kv_capacity_tokens=scal["kv_capacity_tokens"].astype(np.int64, copy=False),
        prefill_tokens=scal["prefill_tokens"].astype(np.int64, copy=False),
        steps_used=steps_used.astype(np.int8, copy=False),
        step_latency_s=lat,
        accepted_offsets=acc_off,
        accepted_values=acc_val,
        request_ids=request_ids,
        prefill_pairs=pairs,
        **flags,
    )
    return req, steps, step_rows


def _kind(name: str) -> str:
    return REQUEST if name in _REQUEST_REQUIRED else STEP


def _file_meta(metadata: dict[bytes, bytes] | None, file: str) -> dict:
    """Check our metadata keys; return the ``specctl.meta`` object."""
    metadata = metadata or {}
    tag = metadata.get(META_FORMAT)
    if tag is None:
        raise TraceFormatError(file, None, None, "not a specctl trace (no 'specctl.format' key)")
    if tag.decode("utf-8", "replace") != FORMAT:
        raise TraceFormatError(
            file,
            None,
            None,
            f"wrong format tag {tag.decode('utf-8', 'replace')!r}, expected {FORMAT!r}",
        )
    version = metadata.get(META_SCHEMA_VERSION, b"").decode("utf-8", "replace")
    if version != str(SCHEMA_VERSION):
        raise TraceFormatError(
            file,
            None,
            None,
            f"unsupported schema version {version!r} (this build reads version {SCHEMA_VERSION})",
        )
    raw = metadata.get(META_META, b"{}")
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TraceFormatError(
            file, None, None, f"'specctl.meta' is not valid JSON: {exc}"
        ) from None
    if not isinstance(meta, dict):
        raise TraceFormatError(file, None, None, "'specctl.meta' must be a JSON object")
    return meta


def _write_table(table: pa.Table, path: Path, meta: dict | None) -> None:
    """Write atomically: a temporary file in the same folder, then a rename."""
    try:
        meta_json = json.dumps(meta or {}, sort_keys=True, default=str)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: trace meta is not JSON-serialisable: {exc}") from None
    table = table.replace_schema_metadata(
        {
            META_FORMAT: FORMAT.encode(),
            META_SCHEMA_VERSION: str(SCHEMA_VERSION).encode(),
            META_META: meta_json.encode(),
        }
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        pq.write_table(table, tmp, compression="zstd")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


# ---------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------


def is_trace_file(path: str | os.PathLike) -> bool:
    """True if ``path`` is a Parquet file carrying our ``specctl.format`` tag.

    Cheap: reads the magic bytes and the footer only. Never raises for a file
    that is not a trace (a missing file is not a trace either).
    """
    path = Path(path)
    try:
        with path.open("rb") as fh:
            if fh.read(4) != PARQUET_MAGIC:
                return False
        metadata = pq.read_schema(path).metadata or {}
    except (OSError, pa.ArrowInvalid):
        return False
    return metadata.get(META_FORMAT, b"").decode("utf-8", "replace") == FORMAT


def _natural_key(path: Path) -> list:
    # "-r2-" sorts before "-r10-", and "-00009" before "-00010".
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(path))]


def expand_paths(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """Files named by a path, a directory (its ``*.parquet``), a glob, or a list of those.

    The result is de-duplicated and in natural name order (so rotated chunks of
    one (server, rank) come in sequence).
    """
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    found: list[Path] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            matches = sorted(p.glob("*.parquet"))
            if not matches:
                raise FileNotFoundError(f"{p}: no *.parquet files in this directory")
            found.extend(matches)
        elif p.exists():
            found.append(p)
        elif glob.has_magic(str(item)):
            matches = [Path(m) for m in glob.glob(str(item))]
            if not matches:
                raise FileNotFoundError(f"{item}: the pattern matches no file")
            found.extend(matches)
        else:
            raise FileNotFoundError(f"{p}: no such file or directory")
    unique = {f.resolve(): f for f in found}
    return sorted(unique.values(), key=_natural_key)


def read_trace(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> Trace:
    """Read and validate a trace: one file, a directory, a glob, or a list of files.

    Several files are concatenated in natural name order; their request records
    are merged by arrival time, and ``step_index`` must keep strictly increasing
    per (server, rank, run) across files (the run is the ``run_id`` of the file's
    metadata, so the runs of a server restarted into one directory read
    together). Raises :class:`TraceFormatError` (naming file, row and field) on
    any violation.
    """
    files = expand_paths(paths)
    all_req: list[RequestColumns] = []
    all_steps: list[StepColumns] = []
    meta: dict | None = None
    last_index: dict[tuple[str, int, str | None], tuple[int, str]] = {}
    for path in files:
        name = str(path)
        try:
            with path.open("rb") as fh:
                magic = fh.read(4)
        except OSError as exc:
            raise TraceFormatError(name, None, None, f"cannot read: {exc}") from None
        if magic != PARQUET_MAGIC:
            raise TraceFormatError(name, None, None, "not a Parquet file (bad magic bytes)")
        pf = _open_parquet(path, name)
        file_meta = _file_meta(pf.schema_arrow.metadata, name)
        try:
            table = pf.read()
        except (pa.ArrowException, OSError) as exc:
            raise TraceFormatError(
                name, None, None, f"truncated or corrupt Parquet data: {exc}"
            ) from None
        table = _conform_schema(table, name)
        req, steps, step_rows = _split_table(table, name)
        run = file_meta.get("run_id")
        run = None if run is None else str(run)
        # Continuity of step_index with earlier files of the same (server, rank, run).
        first_of_key: dict[tuple[str, int, str | None], int] = {}
        for i in range(len(steps)):
            key = (str(steps.server[i]), int(steps.rank[i]), run)
            if key not in first_of_key:
                first_of_key[key] = i
        for key, i in first_of_key.items():
            if key in last_index and steps.step_index[i] <= last_index[key][0]:
                where = f"(server, rank) = {key[:2]}" + (f", run {run!r}" if run else "")
                raise TraceFormatError(
                    name,
                    int(step_rows[i]),
                    "step_index",
                    f"must strictly increase per {where} across files: "
                    f"{steps.step_index[i]} after {last_index[key][0]} in {last_index[key][1]}"
                    + ("" if run else " (files without a 'run_id' in their metadata count "
                       "as one run)"),
                )
        for i in range(len(steps)):
            last_index[(str(steps.server[i]), int(steps.rank[i]), run)] = (
                int(steps.step_index[i]),
                name,
            )
        if meta is None:
            meta = file_meta
        all_req.append(req)
        all_steps.append(steps)

    requests = _concat_requests(all_req, files)
    step_columns = _concat_steps(all_steps)
    return Trace(
        requests=requests,
        steps=step_columns.records(),
        meta=meta or {},
        sources=files,
        _step_columns=step_columns,
    )


def read_packed_trace(path: str | os.PathLike) -> Trace:
    """Read a trace folder packed as ``.tar.gz`` (one folder inside, as the H200 scripts
    pack a recording), or anything :func:`read_trace` takes. The archive is unpacked into
    a temporary folder, removed once the trace is read."""
    path = Path(path)
    if not path.name.endswith(".tar.gz"):
        return read_trace(path)
    with tempfile.TemporaryDirectory() as scratch, tarfile.open(path) as tar:
        tar.extractall(scratch, filter="data")
        folders = [p for p in Path(scratch).iterdir() if p.is_dir()]
        if len(folders) != 1:
            raise TraceFormatError(str(path), None, None, "expected one trace folder inside, "
                                   f"found {sorted(f.name for f in folders)}")
        return read_trace(folders[0])


def _open_parquet(path: Path, name: str) -> pq.ParquetFile:
    """Open a file that starts with the Parquet magic; a bad footer is called truncated."""
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            fh.seek(max(0, size - 4))
            tail = fh.read(4)
    except OSError as exc:
        raise TraceFormatError(name, None, None, f"cannot read: {exc}") from None
    if size < 12 or tail != PARQUET_MAGIC:
        # A Parquet file ends with its footer and the magic again: a copy or a write cut
        # short loses exactly that.
        raise TraceFormatError(
            name, None, None,
            f"truncated or corrupt Parquet file ({size} bytes, no footer magic at the end)",
        )
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise TraceFormatError(
            name, None, None, f"truncated or corrupt Parquet file: {exc}"
        ) from None


def _concat_requests(parts: list[RequestColumns], files: list[Path]) -> RequestColumns:
    if not parts:
        return RequestColumns.empty()
    if len(parts) == 1:
        return parts[0]
    merged = RequestColumns(
        *(
            np.concatenate([getattr(p, name) for p in parts])
            for name in (
                "request_id",
                "arrival_s",
                "prompt_tokens",
                "output_tokens",
                "request_class",
            )
        )
    )
    order = np.argsort(merged.arrival_s, kind="stable")
    merged = RequestColumns(
        *(
            getattr(merged, name)[order]
            for name in (
                "request_id",
                "arrival_s",
                "prompt_tokens",
                "output_tokens",
                "request_class",
            )
        )
    )
    ids = merged.request_id.astype(str)
    uniq, counts = np.unique(ids, return_counts=True)
    if (counts > 1).any():
        dup = str(uniq[counts > 1][0])  # not numpy's repr, np.str_('...')
        owners = [str(f) for f, p in zip(files, parts, strict=True) if dup in set(p.request_id)]
        raise TraceFormatError(
            ", ".join(owners), None, "request_id", f"duplicate id {dup!r} across files"
        )
    return merged


def _concat_steps(parts: list[StepColumns]) -> StepColumns:
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return StepColumns.from_records([])
    offsets = [parts[0].accepted_offsets]
    base = parts[0].accepted_offsets[-1]
    for p in parts[1:]:
        offsets.append(p.accepted_offsets[1:] + base)
        base += p.accepted_offsets[-1]
    names = [
        n
        for n in StepColumns.__dataclass_fields__
        if n not in ("accepted_offsets", "accepted_values", "request_ids")
    ]
    return StepColumns(
        **{n: np.concatenate([getattr(p, n) for p in parts]) for n in names},
        accepted_offsets=np.concatenate(offsets),
        accepted_values=np.concatenate([p.accepted_values for p in parts]),
        request_ids=[x for p in parts for x in p.request_ids],
    )


def write_trace(
    path: str | os.PathLike,
    requests: Sequence[RequestRecord] | RequestColumns = (),
    steps: Sequence[StepRecord] | StepColumns = (),
    meta: dict | None = None,
) -> Path:
    """Write one validated trace file atomically; return its path.

    Request records are sorted by arrival first (stable). Raises
    :class:`TraceFormatError` instead of writing a file that :func:`read_trace`
    would reject.
    """
    path = Path(path)
    req = (
        requests if isinstance(requests, RequestColumns) else RequestColumns.from_records(requests)
    )
    try:
        step_cols = steps if isinstance(steps, StepColumns) else StepColumns.from_records(steps)
    except StepFieldError as exc:
        raise TraceFormatError(path, None, exc.field,
                               f"records cannot be stored: {exc.problem}") from None
    table = _table_for_write(req, step_cols, str(path))
    _write_table(table, path, meta)
    return path


def _table_for_write(req: RequestColumns, steps: StepColumns, name: str) -> pa.Table:
    order = np.argsort(req.arrival_s, kind="stable")
    if not np.array_equal(order, np.arange(order.size)):
        req = RequestColumns(
            *(
                getattr(req, n)[order]
                for n in (
                    "request_id",
                    "arrival_s",
                    "prompt_tokens",
                    "output_tokens",
                    "request_class",
                )
            )
        )
    try:
        table = _build_table(req, steps)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError, ValueError) as exc:
        raise TraceFormatError(name, None, None, f"records cannot be stored: {exc}") from None
    _split_table(table, name)  # never write what the reader would reject
    return table


_SAFE_NAME = re.compile(r"[^A-Za-z0-9_.+-]")


class TraceWriter:
    """Buffers records and writes rotated Parquet files; cheap per record.

    Files are named ``<prefix>-<server>-r<rank>-<seq:05d>.parquet`` (with a
    ``run_id``: ``<prefix>-<run_id>-<server>-r<rank>-<seq:05d>.parquet``, and the
    run id in each file's metadata); a new one is written each time
    ``rotate_records`` rows (steps + requests) have been added, and on
    :meth:`flush` / :meth:`close`. Writes are atomic (temporary
    file + rename), so a reader never sees a partial file. Numbering continues
    after existing files of the same prefix, server and rank (nothing is
    overwritten). Thread-safe: records may be added from one thread while
    another flushes.

    Example::

        with TraceWriter("runs/trace", server="s0", rank=0, meta={"profile": "h200"}) as w:
            w.add_step(record)
    """

    def __init__(
        self,
        path_prefix: str | os.PathLike,
        *,
        server: str,
        rank: int,
        rotate_records: int = 200_000,
        meta: dict | None = None,
        run_id: str | None = None,
    ) -> None:
        if rotate_records < 1:
            raise ValueError(f"rotate_records must be >= 1, got {rotate_records}")
        if not server:
            raise ValueError("server must be a non-empty name")
        self.server = server
        self.rank = int(rank)
        self.rotate_records = int(rotate_records)
        self.meta = dict(meta or {})
        self.run_id = run_id
        if run_id is not None:
            if not run_id or _SAFE_NAME.search(run_id):
                raise ValueError(f"run_id must be a non-empty [A-Za-z0-9_.+-] name, got {run_id!r}")
            self.meta["run_id"] = run_id
        prefix = Path(path_prefix)
        run = f"{run_id}-" if run_id is not None else ""
        self._stem = f"{prefix.name}-{run}{_SAFE_NAME.sub('_', server)}-r{self.rank}-"
        self._dir = prefix.parent
        self._seq = self._next_free_seq()
        self._steps: list[StepRecord] = []
        self._requests: list[RequestRecord] = []
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._last_step_index: int | None = None
        self._closed = False
        #: Paths of the files written so far.
        self.files: list[Path] = []

    def _next_free_seq(self) -> int:
        pattern = re.compile(re.escape(self._stem) + r"(\d+)\.parquet$")
        existing = [
            int(m.group(1))
            for p in (self._dir.iterdir() if self._dir.is_dir() else [])
            if (m := pattern.match(p.name))
        ]
        return max(existing) + 1 if existing else 0

    # The hot path: one append and a length check under a lock, no Arrow work.
    def add_step(self, record: StepRecord) -> None:
        """Buffer one step record (rotates a file every ``rotate_records`` rows)."""
        self._buffer("_steps", record)

    def add_request(self, record: RequestRecord) -> None:
        """Buffer one request record."""
        self._buffer("_requests", record)

    def _buffer(self, rows: str, record: StepRecord | RequestRecord) -> None:
        # The lock (uncontended: ~0.1 us) keeps a concurrent flush from swapping the
        # buffer between this append and the conversion of the old one; the buffer is
        # looked up under it for the same reason.
        with self._lock:
            if self._closed:
                raise RuntimeError("TraceWriter is closed")
            getattr(self, rows).append(record)
            full = len(self._steps) + len(self._requests) >= self.rotate_records
        if full:
            self.flush()

    def flush(self) -> Path | None:
        """Write the buffered rows to a new file now; return its path (None if empty).

        Raises :class:`TraceFormatError` if a buffered record is invalid (the
        chunk is not written; the error names the file it would have been).
        """
        with self._lock:
            steps, self._steps = self._steps, []
            requests, self._requests = self._requests, []
        if not steps and not requests:
            return None
        with self._write_lock:
            path = self._dir / f"{self._stem}{self._seq:05d}.parquet"
            self._seq += 1
            name = str(path)
            try:
                step_cols = StepColumns.from_records(steps)
            except StepFieldError as exc:
                raise TraceFormatError(name, None, exc.field,
                                       f"records cannot be stored: {exc.problem}") from None
            wrong = np.flatnonzero(
                (step_cols.server != self.server) | (step_cols.rank != self.rank)
            )
            if wrong.size:
                i = int(wrong[0])
                raise TraceFormatError(
                    name,
                    len(requests) + i,
                    "server" if step_cols.server[i] != self.server else "rank",
                    f"step of ({step_cols.server[i]!r}, {step_cols.rank[i]}) given to the "
                    f"writer of ({self.server!r}, {self.rank})",
                )
            if self._last_step_index is not None and len(step_cols):
                first = int(step_cols.step_index[0])
                if first <= self._last_step_index:
                    raise TraceFormatError(
                        name,
                        len(requests),
                        "step_index",
                        f"must strictly increase: {first} after {self._last_step_index} "
                        "in the previous file",
                    )
            table = _table_for_write(RequestColumns.from_records(requests), step_cols, name)
            _write_table(table, path, {**self.meta, "server": self.server, "rank": self.rank})
            if len(step_cols):
                self._last_step_index = int(step_cols.step_index[-1])
            self.files.append(path)
            return path

    def close(self) -> None:
        """Flush what is left; further records are an error."""
        if not self._closed:
            self.flush()
            self._closed = True

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
