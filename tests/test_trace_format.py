"""Tests of the Parquet trace format: round trips, rotation, validation errors."""

from __future__ import annotations

import json
import re
import tarfile
import tempfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from env.traces.schema import SCHEMA_VERSION, RequestRecord, StepRecord
from env.traces.trace_format import (
    RequestColumns,
    StepColumns,
    Trace,
    TraceFormatError,
    TraceWriter,
    expand_paths,
    is_trace_file,
    read_packed_trace,
    read_trace,
    write_trace,
)


def make_requests() -> list[RequestRecord]:
    return [
        RequestRecord("r0", 0.0, 100, 20, "coding"),
        RequestRecord("r1", 0.5, 7, 1, None),
        RequestRecord("r2", 2.25, 4000, 300, "writing"),
    ]


def make_steps(n: int = 5, start: int = 0, server: str = "s0", rank: int = 0) -> list[StepRecord]:
    steps = []
    for i in range(n):
        depth = i % 4
        batch = 2
        accepted = np.array([min(i, depth), 0], dtype=np.int8) if depth else np.array([], np.int8)
        steps.append(
            StepRecord(
                server=server,
                rank=rank,
                step_index=start + 2 * i,
                time_s=0.01 * i,
                batch_size=batch,
                waiting_requests=i,
                running_requests=batch,
                kv_used_tokens=1000 + i,
                kv_capacity_tokens=100_000,
                prefill_tokens=0 if i % 5 else 64,
                steps_used=depth if i % 5 else 0,
                accepted_drafts=accepted if i % 5 else np.array([], np.int8),
                step_latency_s=0.005 + 0.001 * i,
                request_ids=["r0", "r1"] if i % 2 else None,
                # unknown, known, and a warm-up on the depth-0 decode steps 4, 8, ...
                warmup=None if i % 3 == 0 else (i % 4 == 0 and i % 5 != 0),
                # unknown, and known: true on the steps right before a prefill (5, 10, ...)
                before_prefill=None if i % 4 == 1 else i % 5 == 4,
            )
        )
    return steps


def assert_steps_equal(a: list[StepRecord], b: list[StepRecord]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        for name in StepRecord.__dataclass_fields__:
            vx, vy = getattr(x, name), getattr(y, name)
            if name == "accepted_drafts":
                assert vy.dtype == np.int8
                np.testing.assert_array_equal(vx, vy)
            else:
                assert vx == vy, name


def test_round_trip(tmp_path):
    requests, steps = make_requests(), make_steps(7)
    meta = {"server_args": {"tp": 1}, "profile": "h200_llama31_8b"}
    path = write_trace(tmp_path / "t.parquet", requests, steps, meta)
    trace = read_trace(path)
    assert trace.requests.records() == requests
    assert_steps_equal(steps, trace.steps)
    assert trace.meta == meta
    assert trace.sources == [path]
    cols = trace.step_columns()
    np.testing.assert_array_equal(cols.step_index, [s.step_index for s in steps])
    np.testing.assert_array_equal(cols.accepted(1), steps[1].accepted_drafts)
    # Exact field names and key-value metadata of the file itself.
    schema = pq.read_schema(path)
    expected = ["record", *RequestRecord.__dataclass_fields__, *StepRecord.__dataclass_fields__]
    assert sorted(schema.names) == sorted(set(expected))
    assert schema.field("accepted_drafts").type == pa.list_(pa.int8())
    assert schema.field("request_ids").type == pa.list_(pa.string())
    assert schema.metadata[b"specctl.format"] == b"specctl-trace"
    assert schema.metadata[b"specctl.schema_version"] == str(SCHEMA_VERSION).encode()
    assert json.loads(schema.metadata[b"specctl.meta"]) == meta


def test_writer_sorts_requests_by_arrival(tmp_path):
    requests = make_requests()[::-1]
    path = write_trace(tmp_path / "t.parquet", requests, [], {})
    arrivals = read_trace(path).requests.arrival_s
    assert list(arrivals) == sorted(r.arrival_s for r in requests)


def test_writer_rotates_atomically_and_reads_back(tmp_path):
    steps, requests = make_steps(7), make_requests()
    with TraceWriter(tmp_path / "run", server="s0", rank=0, rotate_records=3, meta={"a": 1}) as w:
        for s in steps:
            w.add_step(s)
        for r in requests:
            w.add_request(r)
    # 10 rows, 3 per file: three full files and one on close.
    assert [p.name for p in w.files] == [f"run-s0-r0-{i:05d}.parquet" for i in range(4)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [p.name for p in w.files]
    trace = read_trace(tmp_path)
    assert_steps_equal(steps, trace.steps)
    assert trace.requests.records() == requests
    assert trace.meta["a"] == 1 and trace.meta["server"] == "s0"
    with pytest.raises(RuntimeError, match=r"^TraceWriter is closed$"):
        w.add_step(steps[0])


def test_writer_never_overwrites(tmp_path):
    with TraceWriter(tmp_path / "run", server="s0", rank=1) as w:
        w.add_step(make_steps(1, rank=1)[0])
    with TraceWriter(tmp_path / "run", server="s0", rank=1) as w2:
        w2.add_step(make_steps(1, rank=1)[0])
    assert [p.name for p in w.files] == ["run-s0-r1-00000.parquet"]
    assert [p.name for p in w2.files] == ["run-s0-r1-00001.parquet"]


def test_writer_rejects_foreign_and_backward_steps(tmp_path):
    w = TraceWriter(tmp_path / "run", server="s0", rank=0)
    w.add_step(make_steps(1, server="other")[0])
    with pytest.raises(TraceFormatError, match="field 'server'"):
        w.flush()
    w.add_step(make_steps(1, start=10)[0])
    w.flush()
    w.add_step(make_steps(1, start=10)[0])
    with pytest.raises(
        TraceFormatError, match=r"field .step_index.: must strictly increase: 10 after 10"
    ):
        w.flush()


def test_read_natural_order_and_cross_file_continuity(tmp_path):
    write_trace(tmp_path / "t-s0-r0-00010.parquet", [], make_steps(2, start=100))
    write_trace(tmp_path / "t-s0-r0-00009.parquet", [], make_steps(2, start=0))
    trace = read_trace(tmp_path / "t-*.parquet")
    assert [s.step_index for s in trace.steps] == [0, 2, 100, 102]
    write_trace(tmp_path / "t-s0-r0-00011.parquet", [], make_steps(1, start=50))
    with pytest.raises(TraceFormatError) as exc:
        read_trace(tmp_path)
    assert "t-s0-r0-00011.parquet: row 0, field 'step_index'" in str(exc.value)


def test_runs_restart_their_step_index_but_each_run_must_increase(tmp_path):
    # Regression: a server restarted into the same directory starts again at step 0,
    # which made the whole directory unreadable.
    for run in ("20261201T100000Z-aaaaaa", "20261201T110000Z-bbbbbb"):
        with TraceWriter(tmp_path / "trace", server="s0", rank=0, run_id=run) as w:
            for step in make_steps(3):
                w.add_step(step)
        [written] = w.files
        assert run in written.name
    trace = read_trace(tmp_path)
    assert [s.step_index for s in trace.steps] == [0, 2, 4, 0, 2, 4]
    assert trace.meta["run_id"] == "20261201T100000Z-aaaaaa"
    # the same run going backwards is still an error, named with its run
    again = tmp_path / "trace-20261201T110000Z-bbbbbb-s0-r0-00001.parquet"
    write_trace(again, [], make_steps(1), {"run_id": "20261201T110000Z-bbbbbb"})
    with pytest.raises(TraceFormatError, match=r"00001.parquet: row 0, field 'step_index': must "
                       r"strictly increase per \(server, rank\) = \('s0', 0\), run "
                       r"'20261201T110000Z-bbbbbb' across files: 0 after 4 in \S+-00000"
                       r"\.parquet$"):  # no note on files without a run_id
        read_trace(tmp_path)
    with pytest.raises(ValueError, match="run_id must be"):
        TraceWriter(tmp_path / "trace", server="s0", rank=0, run_id="a/b")


@pytest.mark.parametrize("keep", [0.5, 0.99])
def test_a_truncated_file_is_called_truncated(tmp_path, keep):
    path = write_trace(tmp_path / "t.parquet", make_requests(), make_steps(6))
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(TraceFormatError, match=r"t.parquet: truncated or corrupt Parquet file"):
        read_trace(path)


def test_expand_paths_errors(tmp_path):
    missing = tmp_path / "missing.parquet"
    with pytest.raises(FileNotFoundError, match=f"^{re.escape(str(missing))}: no such file or "
                       "directory$"):
        expand_paths(missing)
    with pytest.raises(FileNotFoundError, match=f"^{re.escape(str(tmp_path))}: no "
                       r"\*\.parquet files in this directory$"):
        expand_paths(tmp_path)  # empty directory
    pattern = str(tmp_path / "*.parquet")
    with pytest.raises(FileNotFoundError, match=f"^{re.escape(pattern)}: the pattern matches "
                       "no file$"):
        expand_paths(pattern)


def test_expand_paths_takes_a_list_of_paths(tmp_path):
    a = write_trace(tmp_path / "a.parquet", [], make_steps(1))
    b = write_trace(tmp_path / "b.parquet", [], make_steps(1))
    assert expand_paths([str(b), a, b]) == [a, b]  # sorted, each once


def test_written_files_are_zstd_compressed_with_sorted_json_meta(tmp_path):
    one = write_trace(tmp_path / "one.parquet", make_requests(), [], {"b": 2, "a": tmp_path})
    two = write_trace(tmp_path / "two.parquet", make_requests(), [], {"a": str(tmp_path), "b": 2})
    metas = [pq.read_schema(p).metadata[b"specctl.meta"] for p in (one, two)]
    assert metas[0] == metas[1] == json.dumps({"a": str(tmp_path), "b": 2}).encode()
    assert read_trace(one).meta == {"a": str(tmp_path), "b": 2}  # a Path written as text
    column = pq.ParquetFile(one).metadata.row_group(0).column(0)
    assert column.compression == "ZSTD"
    circular: dict = {}
    circular["self"] = circular
    bad = tmp_path / "bad.parquet"
    with pytest.raises(ValueError, match=f"^{re.escape(str(bad))}: trace meta is not "
                       "JSON-serialisable: Circular reference detected$"):
        write_trace(bad, [], [], circular)


def test_request_columns_from_records_have_fixed_dtypes():
    cols = RequestColumns.from_records([RequestRecord("a", 1, 2, 3, "coding")])  # int arrival
    assert cols.arrival_s.dtype == np.float64 and cols.request_class.dtype == object


def test_is_trace_file(tmp_path):
    ours = write_trace(tmp_path / "t.parquet", make_requests(), [])
    plain = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"x": [1, 2]}), plain)
    text = tmp_path / "x.csv"
    text.write_text("a,b\n1,2\n")
    assert is_trace_file(ours)
    assert not is_trace_file(plain)
    assert not is_trace_file(text)
    assert not is_trace_file(tmp_path / "missing")
    # a format tag that is not UTF-8 is no trace either (and no exception)
    mangled = tmp_path / "mangled.parquet"
    pq.write_table(pa.table({"x": [1]}).replace_schema_metadata(
        {b"specctl.format": b"\xffspecctl-trace"}), mangled)
    assert not is_trace_file(mangled)


def _rewrite(path, column: str, row: int, value) -> None:
    """Overwrite one cell of a trace file, keeping its metadata."""
    table = pq.read_table(path)
    values = table.column(column).to_pylist()
    values[row] = value
    i = table.column_names.index(column)
    table = table.set_column(i, column, pa.array(values, type=table.schema.field(column).type))
    pq.write_table(table, path)


def _one_cell_changed(tmp_path, column: str, row: int, value):
    """A trace of make_requests() and make_steps(6) with one cell rewritten. Rows: 0..2
    are the requests, 3..8 the steps: steps_used 0,1,2,3,0,0; accepted_drafts [], [1,0],
    [2,0], [3,0], [], []; request_ids on rows 4, 6 and 8; prefill steps rows 3 and 8;
    warmup None, False, False, None, True, False."""
    path = write_trace(tmp_path / "t.parquet", make_requests(), make_steps(6))
    _rewrite(path, column, row, value)
    return path


def _with_metadata(path, **changes) -> None:
    table = pq.read_table(path)
    meta = dict(table.schema.metadata)
    meta.update({k.encode(): v.encode() for k, v in changes.items()})
    pq.write_table(table.replace_schema_metadata(meta), path)


def test_metadata_errors(tmp_path):
    path = write_trace(tmp_path / "t.parquet", make_requests(), [])
    _with_metadata(path, **{"specctl.schema_version": str(SCHEMA_VERSION + 1)})
    with pytest.raises(TraceFormatError, match="unsupported schema version"):
        read_trace(path)
    _with_metadata(path, **{"specctl.format": "other"})
    with pytest.raises(TraceFormatError, match="wrong format tag 'other'"):
        read_trace(path)
    not_parquet = tmp_path / "x.parquet"
    not_parquet.write_text("hello")
    with pytest.raises(TraceFormatError, match="bad magic"):
        read_trace(not_parquet)


@pytest.mark.parametrize(("changes", "message"), [
    ({"specctl.format": None}, "not a specctl trace (no 'specctl.format' key)"),
    ({"specctl.format": b"\xffx"}, "wrong format tag '\ufffdx', expected 'specctl-trace'"),
    ({"specctl.schema_version": None}, "unsupported schema version ''"),
    ({"specctl.schema_version": b"\xff"}, "unsupported schema version '\ufffd'"),
    ({"specctl.meta": b"{"}, "'specctl.meta' is not valid JSON: "),
    ({"specctl.meta": b"\xff"}, "'specctl.meta' is not valid JSON: "),
    ({"specctl.meta": b"[1]"}, "'specctl.meta' must be a JSON object"),
])
def test_metadata_errors_name_the_file(tmp_path, changes, message):
    path = write_trace(tmp_path / "t.parquet", make_requests(), [])
    table = pq.read_table(path)
    meta = dict(table.schema.metadata)
    for key, value in changes.items():
        if value is None:
            del meta[key.encode()]
        else:
            meta[key.encode()] = value
    pq.write_table(table.replace_schema_metadata(meta), path)
    with pytest.raises(TraceFormatError) as exc:
        read_trace(path)
    assert (exc.value.file, exc.value.where, exc.value.field) == (str(path), None, None)
    assert exc.value.message.startswith(message), exc.value.message


def test_a_file_without_specctl_meta_reads_as_empty_meta(tmp_path):
    path = write_trace(tmp_path / "t.parquet", make_requests(), [])
    table = pq.read_table(path)
    meta = {k: v for k, v in table.schema.metadata.items() if k != b"specctl.meta"}
    pq.write_table(table.replace_schema_metadata(meta), path)
    assert read_trace(path).meta == {}


def test_empty_request_columns_have_the_columns_types():
    empty, full = RequestColumns.empty(), RequestColumns.from_records(make_requests())
    assert len(empty) == 0
    for name in RequestColumns.__dataclass_fields__:
        assert getattr(empty, name).dtype == getattr(full, name).dtype, name
        assert getattr(empty, name).shape == (0,), name


def test_column_errors(tmp_path):
    path = write_trace(tmp_path / "t.parquet", make_requests(), make_steps(2))
    table = pq.read_table(path)
    meta = table.schema.metadata
    pq.write_table(table.append_column("extra", pa.array([1] * table.num_rows)), path)
    _restore_meta(path, meta)
    with pytest.raises(TraceFormatError, match="field 'extra': unknown column") as exc:
        read_trace(path)
    assert exc.value.file == str(path) and exc.value.where is None
    pq.write_table(table.drop_columns(["rank"]).replace_schema_metadata(meta), path)
    with pytest.raises(TraceFormatError, match="field 'rank': missing column") as exc:
        read_trace(path)
    assert exc.value.file == str(path) and exc.value.where is None
    bad_type = table.set_column(
        table.column_names.index("request_id"),
        "request_id",
        pa.array([1.5] * table.num_rows),
    )
    pq.write_table(bad_type.replace_schema_metadata(meta), path)
    with pytest.raises(TraceFormatError, match="field 'request_id'"):
        read_trace(path)


def _restore_meta(path, meta) -> None:
    pq.write_table(pq.read_table(path).replace_schema_metadata(meta), path)


def test_write_trace_refuses_invalid_records(tmp_path):
    bad = [RequestRecord("a", 0.0, 5, 0)]
    with pytest.raises(TraceFormatError, match="field 'output_tokens': must be >= 1, got 0") as exc:
        write_trace(tmp_path / "t.parquet", bad, [])
    assert exc.value.file == str(tmp_path / "t.parquet")
    assert not list(tmp_path.iterdir())  # nothing (not even a temporary file) left


def test_add_step_only_buffers_until_the_rotation_size(tmp_path, monkeypatch):
    """The scheduler thread's cost: a list append, no Arrow or file work, until
    ``rotate_records`` rows are buffered (the time per call is a benchmark's business)."""
    flushes = []
    monkeypatch.setattr(TraceWriter, "flush", lambda self: flushes.append(
        (len(self._steps), len(self._requests))))
    record = make_steps(2)[1]
    w = TraceWriter(tmp_path / "run", server="s0", rank=0, rotate_records=5)
    for _ in range(3):
        w.add_step(record)
    w.add_request(RequestRecord("r", 0.0, 1, 1))
    assert flushes == [] and list((tmp_path / "run").glob("*")) == []
    w.add_step(record)
    assert flushes == [(4, 1)], "the fifth row, of either kind, rotates"


step_strategy = st.builds(
    lambda depth, batch, acc_seed, latency, with_ids, warmup, before: (
        depth, batch, acc_seed, latency, with_ids, warmup, before),
    st.integers(0, 7),
    st.integers(0, 6),
    st.integers(0, 10**6),
    st.floats(0, 10, allow_nan=False),
    st.booleans(),
    st.sampled_from([None, False, True]),
    st.sampled_from([None, False, True]),
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(specs=st.lists(step_strategy, max_size=12), n_requests=st.integers(0, 5))
def test_round_trip_property(tmp_path, specs, n_requests):
    steps = []
    for i, (depth, batch, seed, latency, with_ids, warmup, before) in enumerate(specs):
        rng = np.random.default_rng(seed)
        accepted = (
            rng.integers(0, depth + 1, size=batch).astype(np.int8)
            if depth
            else np.array([], np.int8)
        )
        steps.append(
            StepRecord(
                "srv",
                3,
                i,
                float(i),
                batch,
                0,
                batch,
                10 * batch,
                1000,
                0,
                depth,
                accepted,
                latency,
                [f"q{j}" for j in range(batch)] if with_ids else None,
                warmup=warmup and not depth,  # a warm-up only at steps 0
                before_prefill=before,
            )
        )
    requests = [RequestRecord(f"q{j}", float(j), j + 1, 2 * j + 1) for j in range(n_requests)]
    path = write_trace(tmp_path / "p.parquet", requests, steps, {"n": len(steps)})
    trace = read_trace(path)
    assert trace.requests.records() == requests
    assert_steps_equal(steps, trace.steps)


def test_writer_loses_nothing_under_concurrent_flush(tmp_path):
    import threading

    template = make_steps(2)[1]
    n = 20_000
    writer = TraceWriter(tmp_path / "run", server="s0", rank=0, rotate_records=7_000)

    def produce() -> None:
        for i in range(n):
            writer.add_step(
                StepRecord(
                    **{**{f: getattr(template, f) for f in StepRecord.__slots__}, "step_index": i}
                )
            )

    thread = threading.Thread(target=produce)
    thread.start()
    while thread.is_alive():
        writer.flush()
    thread.join()
    writer.close()
    indices = [s.step_index for s in read_trace(tmp_path).steps]
    assert indices == list(range(n))


# -- what the mutation run (scripts/mutation.py env/traces/trace_format.py) found unchecked ------


def test_requests_of_several_files_merge_stably_by_arrival(tmp_path):
    """Equal arrival times keep file order; 10 per file is enough for numpy's default
    (unstable) sort to reorder them."""
    for name, arrival in (("a", 0.0), ("b", 1.0), ("c", 0.5)):
        write_trace(tmp_path / f"t-{name}.parquet",
                    [RequestRecord(f"{name}{i}", arrival, 1, 1) for i in range(10)], [])
    ids = list(read_trace(tmp_path).requests.request_id)
    assert ids == [f"{name}{i}" for name in "acb" for i in range(10)]


def test_a_request_id_in_two_files_names_both_files(tmp_path):
    paths = [write_trace(tmp_path / f"t-{i}.parquet", [RequestRecord(rid, float(i), 1, 1)], [])
             for i, rid in enumerate(["x", "dup", "y", "dup"])]
    with pytest.raises(TraceFormatError) as exc:
        read_trace(tmp_path)
    assert exc.value.file == f"{paths[1]}, {paths[3]}"
    assert exc.value.where is None and exc.value.field == "request_id"
    assert exc.value.message == "duplicate id 'dup' across files"


def test_error_args_carry_the_message(tmp_path):
    error = TraceFormatError("f.parquet", 3, "rank", "bad")
    assert str(error) == "f.parquet: row 3, field 'rank': bad"
    assert error.args == (str(error),)  # what repr() and tracebacks of re-raises show


def test_request_columns_of_unequal_length_are_an_error():
    columns = RequestColumns.from_records(make_requests())
    columns.prompt_tokens = columns.prompt_tokens[:2]
    n = len(make_requests())
    with pytest.raises(ValueError, match=re.escape(
            f"request columns of unequal length: {{'request_id': {n}, 'arrival_s': {n}, "
            f"'prompt_tokens': 2, 'output_tokens': {n}, 'request_class': {n}}}")):
        columns.records()


def test_step_columns_are_cached_until_the_steps_change():
    trace = Trace(RequestColumns.empty(), make_steps(3))
    columns = trace.step_columns()
    assert list(columns.step_index) == [0, 2, 4]
    assert trace.step_columns() is columns
    trace.steps.append(make_steps(1, start=10)[0])
    assert list(trace.step_columns().step_index) == [0, 2, 4, 10]


def test_write_trace_takes_columns_too(tmp_path):
    original = read_trace(write_trace(tmp_path / "a.parquet", make_requests(), make_steps(4)))
    path = write_trace(tmp_path / "b.parquet", original.requests, original.step_columns())
    again = read_trace(path)
    assert again.requests.records() == make_requests()
    assert_steps_equal(again.steps, original.steps)


def test_writer_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="rotate_records must be >= 1, got 0"):
        TraceWriter(tmp_path / "run", server="s0", rank=0, rotate_records=0)
    with pytest.raises(ValueError, match=r"^server must be a non-empty name$"):
        TraceWriter(tmp_path / "run", server="", rank=0)
    with TraceWriter(tmp_path / "run", server="s0", rank=0, rotate_records=1,
                     run_id="run1") as w:
        assert w.run_id == "run1"
        for step in make_steps(2):
            w.add_step(step)
    assert len(w.files) == 2, "rotate_records=1: one file per record"
    with pytest.raises(RuntimeError, match=r"^TraceWriter is closed$"):
        w.add_request(make_requests()[0])


def test_writer_names_files_safely_in_a_folder_it_creates(tmp_path):
    prefix = tmp_path / "new" / "folder" / "run"
    with TraceWriter(prefix, server="node 1/a", rank=2) as w:
        w.add_step(make_steps(1, server="node 1/a", rank=2)[0])
    assert [p.name for p in w.files] == ["run-node_1_a-r2-00000.parquet"]
    assert read_trace(w.files[0]).meta == {"server": "node 1/a", "rank": 2}


def test_writer_errors_name_the_file_row_and_field(tmp_path):
    w = TraceWriter(tmp_path / "run", server="s0", rank=0)
    for request in make_requests():
        w.add_request(request)
    w.add_step(make_steps(1)[0])
    w.add_step(make_steps(1, start=2, rank=1)[0])
    with pytest.raises(TraceFormatError) as exc:
        w.flush()
    assert exc.value.file == str(tmp_path / "run-s0-r0-00000.parquet")
    assert (exc.value.where, exc.value.field) == (3 + 1, "rank")  # after 3 requests
    assert exc.value.message == "step of ('s0', 1) given to the writer of ('s0', 0)"
    w.add_step(make_steps(1, start=10)[0])
    w.flush()
    w.add_request(make_requests()[0])
    w.add_step(make_steps(1, start=4)[0])
    with pytest.raises(TraceFormatError) as exc:
        w.flush()
    assert exc.value.file == str(tmp_path / "run-s0-r0-00002.parquet")
    assert (exc.value.where, exc.value.field) == (1, "step_index")
    assert exc.value.message == "must strictly increase: 4 after 10 in the previous file"


# Every check of the reader, each message in full where it matters (issue 14, mutation
# testing), and the boundaries (equal values that are allowed, the first that are not).
# Rows: see _one_cell_changed.
@pytest.mark.parametrize(
    ("column", "row", "value", "expected"),
    [
        ("output_tokens", 1, -3, "row 1, field 'output_tokens': must be >= 1, got -3"),
        ("prompt_tokens", 0, 0, "row 0, field 'prompt_tokens': must be >= 1, got 0"),
        ("arrival_s", 0, float("nan"), "row 0, field 'arrival_s': must be finite"),
        ("request_id", 1, "r0", "row 1, field 'request_id': duplicate id 'r0'"),
        ("step_latency_s", 4, float("inf"), "row 4, field 'step_latency_s': must be finite"),
        ("step_index", 6, 2, "row 6, field 'step_index': must strictly increase"),
        # negative, not only too large (issue 14: the '< 0' half of the range check)
        ("accepted_drafts", 4, [-1, 0], "row 4, field 'accepted_drafts': entry 0 is -1, outside"),
        ("accepted_drafts", 4, [3, 0], "row 4, field 'accepted_drafts': entry 0 is 3"),
        ("accepted_drafts", 3, [1, 1], "row 3, field 'accepted_drafts': must be empty"),
        ("request_ids", 4, ["r0"], "row 4, field 'request_ids': has 1 ids, expected batch"),
        ("kv_used_tokens", 7, -1, "row 7, field 'kv_used_tokens': must be >= 0, got -1"),
        ("record", 3, "stepp", "row 3, field 'record': must be 'request' or 'step'"),
        ("time_s", 5, None, "row 5, field 'time_s': must not be null on a step row"),
        ("prompt_tokens", 1, None, "row 1, field 'prompt_tokens': must not be null on a "
         "request row"),
        ("arrival_s", 0, -1.0, "row 0, field 'arrival_s': must be >= 0, got -1.0$"),
        ("arrival_s", 1, float("inf"), "row 1, field 'arrival_s': must be finite, got inf$"),
        ("arrival_s", 2, 0.1,
         r"row 2, field 'arrival_s': requests must be sorted by arrival: 0.1 after 0.5$"),
        ("request_id", 2, "", "row 2, field 'request_id': must not be empty$"),
        ("request_id", 2, "r0", "row 2, field 'request_id': duplicate id 'r0'$"),
        ("request_id", 2, "r1", "row 2, field 'request_id': duplicate id 'r1'$"),
        ("request_id", 0, None, "row 0, field 'request_id': must not be null on a request row$"),
        ("record", 1, None, "row 1, field 'record': must be 'request' or 'step', got None$"),
        ("batch_size", 3, -1, "row 3, field 'batch_size': must be >= 0, got -1$"),
        ("waiting_requests", 5, -2, "row 5, field 'waiting_requests': must be >= 0, got -2$"),
        ("running_requests", 6, -1, "row 6, field 'running_requests': must be >= 0, got -1$"),
        ("kv_capacity_tokens", 7, -5,
         "row 7, field 'kv_capacity_tokens': must be >= 0, got -5$"),
        ("prefill_tokens", 8, -64, "row 8, field 'prefill_tokens': must be >= 0, got -64$"),
        ("steps_used", 3, -1, "row 3, field 'steps_used': must be >= 0, got -1$"),
        ("time_s", 6, float("inf"), "row 6, field 'time_s': must be finite, got inf$"),
        ("time_s", 4, float("nan"), "row 4, field 'time_s': must be finite, got nan$"),
        ("step_latency_s", 5, -0.5, r"row 5, field 'step_latency_s': must be >= 0, got -0.5$"),
        ("server", 7, None, "row 7, field 'server': must not be null on a step row$"),
        ("accepted_drafts", 8, None,
         "row 8, field 'accepted_drafts': must not be null on a step row$"),
        ("step_index", 6, 4, r"row 6, field 'step_index': must strictly increase per "
         r"\(server, rank\) = \('s0', 0\): 4 after 4$"),
        ("batch_size", 4, 1,
         "row 4, field 'accepted_drafts': has 2 entries, more than batch_size 1$"),
        ("accepted_drafts", 7, [1, 1],
         "row 7, field 'accepted_drafts': must be empty when steps_used is 0, got 2 entries$"),
        ("accepted_drafts", 7, [0],
         "row 7, field 'accepted_drafts': must be empty when steps_used is 0, got 1 entries$"),
        # the second entry of a later row: the entry number counts within the row
        ("accepted_drafts", 5, [0, 3],
         r"row 5, field 'accepted_drafts': entry 1 is 3, outside \[0, steps_used=2\]$"),
        ("accepted_drafts", 6, [0, -1],
         r"row 6, field 'accepted_drafts': entry 1 is -1, outside \[0, steps_used=3\]$"),
        ("request_ids", 6, ["r0", "r1", "r2"],
         "row 6, field 'request_ids': has 3 ids, expected batch_size 2$"),
        ("accepted_drafts", 6, [1],
         "row 6, field 'accepted_drafts': has 1 entries but request_ids has 2$"),
        ("request_ids", 6, ["r0", None], "row 6, field 'request_ids': holds a null id$"),
        # a null entry used to read back as an arbitrary number (a NaN cast to int8)
        ("accepted_drafts", 6, [1, None], "row 6, field 'accepted_drafts': entry 1 is null$"),
        ("prefill_pairs", 3, -1.0, "row 3, field 'prefill_pairs': must be finite and >= 0, "
         "got -1.0$"),
        ("prefill_pairs", 4, float("inf"), "row 4, field 'prefill_pairs': must be finite and "
         ">= 0, got inf$"),
        ("warmup", 4, True, "row 4, field 'warmup': a warm-up must be a decode step at "
         "steps_used 0, got steps_used 1 and prefill_tokens 0$"),
        ("warmup", 8, True, "row 8, field 'warmup': a warm-up must be a decode step at "
         "steps_used 0, got steps_used 0 and prefill_tokens 64$"),
    ],
)
def test_validation_errors_name_file_row_field(tmp_path, column, row, value, expected):
    path = _one_cell_changed(tmp_path, column, row, value)
    with pytest.raises(TraceFormatError) as exc:
        read_trace(path)
    assert re.match(re.escape(f"{path}: ") + expected, str(exc.value)), str(exc.value)
    assert (exc.value.file, exc.value.where) == (str(path), row)


@pytest.mark.parametrize(
    ("column", "row", "value"),
    [
        ("arrival_s", 1, 0.0),  # equal arrivals are sorted
        ("arrival_s", 2, 0.5),
        ("request_id", 1, "r"),  # a prefix of another id is no duplicate
        ("step_latency_s", 5, 0.0),
        ("batch_size", 3, 0),  # no entries, batch 0: fine
        ("waiting_requests", 4, 0),
        ("kv_capacity_tokens", 4, 0),
        ("step_index", 3, -7),  # step_index may be negative; only its order matters
        ("accepted_drafts", 6, [3, 3]),  # both ends of [0, steps_used]
        ("accepted_drafts", 5, [0, 0]),
        ("accepted_drafts", 6, []),  # no entries even though request_ids has 2
        ("request_ids", 6, []),
    ],
)
def test_boundary_values_are_accepted(tmp_path, column, row, value):
    path = _one_cell_changed(tmp_path, column, row, value)
    if (column, value) == ("request_ids", []):  # with no ids, batch 0 and no entries
        _rewrite(path, "batch_size", row, 0)
        _rewrite(path, "accepted_drafts", row, [])
    trace = read_trace(path)
    record = trace.requests.records()[row] if row < 3 else trace.steps[row - 3]
    got = getattr(record, column)
    if isinstance(value, list):
        assert list(got) == value
    else:
        assert got == value


def test_one_request_and_two_unsorted_requests(tmp_path):
    one = write_trace(tmp_path / "one.parquet", [RequestRecord("a", 3.0, 1, 1)], [])
    assert read_trace(one).requests.records() == [RequestRecord("a", 3.0, 1, 1)]
    two = write_trace(tmp_path / "two.parquet", make_requests()[:2], [])
    _rewrite(two, "arrival_s", 1, -0.0)
    _rewrite(two, "arrival_s", 0, 0.25)
    with pytest.raises(TraceFormatError, match=r"row 1, field 'arrival_s': requests must be "
                       r"sorted by arrival: -0.0 after 0.25$"):
        read_trace(two)


def test_step_index_is_checked_per_server_and_rank(tmp_path):
    # Interleaved keys, each increasing on its own: valid, whatever the others do.
    steps = [
        *make_steps(1, start=9, server="b", rank=2),
        *make_steps(1, start=0, server="a", rank=0),
        *make_steps(1, start=5, server="b", rank=1),
        *make_steps(1, start=1, server="a", rank=2),
        *make_steps(1, start=10, server="b", rank=2),
        *make_steps(1, start=1, server="a", rank=0),
        *make_steps(1, start=6, server="b", rank=1),
    ]
    trace = read_trace(write_trace(tmp_path / "ok.parquet", [], steps))
    assert [s.step_index for s in trace.steps] == [9, 0, 5, 1, 10, 1, 6]
    # A repeat within one of those keys is caught at its row, naming the key.
    steps.append(make_steps(1, start=1, server="a", rank=2)[0])
    with pytest.raises(TraceFormatError, match=r"bad.parquet: row 7, field 'step_index': must "
                       r"strictly increase per \(server, rank\) = \('a', 2\): 1 after 1$"):
        write_trace(tmp_path / "bad.parquet", [], steps)


@pytest.mark.parametrize("ranks", [(1, -1), (-1, 1), (3, 1), (0, 5)])
def test_negative_or_large_ranks_do_not_mix_servers(tmp_path, ranks):
    # Two servers, one step each, the second with a smaller step_index: no error, as they
    # are different keys (a rank stride of max + 1 made ('s0', 1) and ('s1', -1) collide).
    steps = [
        *make_steps(1, start=5, server="s0", rank=ranks[0]),
        *make_steps(1, start=3, server="s1", rank=ranks[1]),
    ]
    trace = read_trace(write_trace(tmp_path / "t.parquet", [], steps))
    assert [(s.server, s.rank, s.step_index) for s in trace.steps] == [
        ("s0", ranks[0], 5), ("s1", ranks[1], 3)
    ]
    # and the same rank twice on one server is still one key
    steps.append(make_steps(1, start=5, server="s1", rank=ranks[1])[0])
    steps.append(make_steps(1, start=4, server="s0", rank=ranks[0])[0])
    with pytest.raises(TraceFormatError, match=rf"row 3, field 'step_index': .* = \('s0', "
                       rf"{ranks[0]}\): 4 after 5$"):
        write_trace(tmp_path / "bad.parquet", [], steps)


def test_cross_file_continuity_uses_each_keys_last_index(tmp_path):
    first = write_trace(tmp_path / "t-00001.parquet", [], [
        *make_steps(2, start=0, server="s0"), *make_steps(1, start=7, server="s1")
    ], {"a": 1})
    # A file of another key in between does not reset s0's last index (2), and an equal
    # index is no increase; the row is the step's row in its file, after the requests.
    write_trace(tmp_path / "t-00002.parquet", [], make_steps(1, start=8, server="s1"), {"a": 2})
    second = write_trace(tmp_path / "t-00003.parquet", make_requests(), [
        *make_steps(1, start=9, server="s1"), *make_steps(1, start=2, server="s0")
    ])
    with pytest.raises(TraceFormatError) as exc:
        read_trace(tmp_path)
    assert str(exc.value) == (
        f"{second}: row 4, field 'step_index': must strictly increase per (server, rank) = "
        f"('s0', 0) across files: 2 after 2 in {first} (files without a 'run_id' in their "
        "metadata count as one run)"
    )
    # one more than the last index is fine; the trace's meta is the first file's
    _rewrite(second, "step_index", 4, 3)
    trace = read_trace(tmp_path)
    assert [(s.server, s.step_index) for s in trace.steps] == [
        ("s0", 0), ("s0", 2), ("s1", 7), ("s1", 8), ("s1", 9), ("s0", 3)
    ]
    assert trace.meta == {"a": 1}
    assert trace.sources == sorted(tmp_path.iterdir())


def test_a_column_of_a_wider_type_is_cast_if_every_value_fits(tmp_path):
    path = write_trace(tmp_path / "t.parquet", make_requests(), make_steps(2))
    table = pq.read_table(path)
    i = table.column_names.index("prompt_tokens")
    wide = table.set_column(i, "prompt_tokens", table.column(i).cast(pa.int64()))
    pq.write_table(wide, path)
    assert read_trace(path).requests.records() == make_requests()
    values = wide.column(i).to_pylist()
    values[1] = 2**40
    pq.write_table(wide.set_column(i, "prompt_tokens", pa.array(values, pa.int64())), path)
    with pytest.raises(TraceFormatError) as exc:
        read_trace(path)
    assert (exc.value.file, exc.value.where, exc.value.field) == (str(path), None,
                                                                  "prompt_tokens")
    assert re.match(r"has type int64, expected int32 \(.+\)$", exc.value.message), exc.value


def test_requests_of_two_files_are_both_read_and_a_duplicate_is_named(tmp_path):
    write_trace(tmp_path / "t-1.parquet", [RequestRecord("b", 1.0, 1, 1)], [])
    second = write_trace(tmp_path / "t-2.parquet", [RequestRecord("a", 0.5, 2, 2)], [])
    assert list(read_trace(tmp_path).requests.request_id) == ["a", "b"]
    # the duplicate is not the smallest id of the merged requests
    write_trace(second, [RequestRecord("a", 0.5, 2, 2), RequestRecord("b", 0.7, 1, 1)], [])
    with pytest.raises(TraceFormatError, match=r"duplicate id 'b' across files$"):
        read_trace(tmp_path)


def test_writer_names_its_file_when_a_buffered_record_is_invalid(tmp_path):
    w = TraceWriter(tmp_path / "run", server="s0", rank=0)
    w.add_request(RequestRecord("r0", 0.0, 10, 0))
    with pytest.raises(TraceFormatError) as exc:
        w.flush()
    assert str(exc.value) == (
        f"{tmp_path / 'run-s0-r0-00000.parquet'}: row 0, field 'output_tokens': "
        "must be >= 1, got 0"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "keys",
    [
        # three servers and a negative rank: a stride of max + low + 1 would mix them
        [("s0", 1, 5), ("s1", 0, 9), ("s2", -1, 3)],
        # three servers, ranks 0 and 1: keys divided instead of multiplied would mix them
        [("a", 1, 5), ("b", 0, 9), ("c", 0, 3)],
    ],
)
def test_step_index_keys_of_three_servers_stay_apart(tmp_path, keys):
    steps = [make_steps(1, start=i, server=s, rank=r)[0] for s, r, i in keys]
    trace = read_trace(write_trace(tmp_path / "t.parquet", [], steps))
    assert [(s.server, s.rank, s.step_index) for s in trace.steps] == keys


def test_two_steps_are_enough_to_be_out_of_order(tmp_path):
    steps = [*make_steps(1, start=3), *make_steps(1, start=3)]
    with pytest.raises(TraceFormatError, match=r"row 1, field 'step_index': .*: 3 after 3$"):
        write_trace(tmp_path / "t.parquet", [], steps)


def test_a_duplicate_id_is_reported_at_its_later_row(tmp_path):
    # 17 ids: enough for numpy's default (unstable) sort to put row 14 before row 10.
    requests = [RequestRecord(f"r{k}", 0.1 * k, 1, 1) for k in range(17)]
    requests[10] = RequestRecord("r14", 1.0, 1, 1)
    with pytest.raises(TraceFormatError, match=r"row 14, field 'request_id': duplicate id "
                       r"'r14'$"):
        write_trace(tmp_path / "t.parquet", requests, [])


def test_read_back_step_columns_have_the_writers_dtypes(tmp_path):
    steps = make_steps(6)
    cols = read_trace(write_trace(tmp_path / "t.parquet", [], steps)).step_columns()
    built = StepColumns.from_records(steps)
    for name in StepColumns.__dataclass_fields__:
        if name != "request_ids":
            assert getattr(cols, name).dtype == getattr(built, name).dtype, name


def test_files_are_read_in_natural_name_order(tmp_path):
    # A directory lists "-r10-" before "-r2-"; numbers in names compare as numbers.
    for rank in (10, 2):
        write_trace(tmp_path / f"t-s0-r{rank}-00000.parquet", [],
                    make_steps(2, start=0, rank=rank))
    assert [s.rank for s in read_trace(tmp_path).steps] == [2, 2, 10, 10]
    assert [p.name for p in expand_paths(tmp_path)] == ["t-s0-r2-00000.parquet",
                                                         "t-s0-r10-00000.parquet"]


def test_a_file_that_is_no_parquet_is_named(tmp_path):
    path = tmp_path / "t.parquet"
    path.write_bytes(b"PAR2" + bytes(100))
    with pytest.raises(TraceFormatError) as exc:
        read_trace(path)
    assert str(exc.value) == f"{path}: not a Parquet file (bad magic bytes)"
    assert (exc.value.file, exc.value.where, exc.value.field) == (str(path), None, None)


@pytest.mark.parametrize("opens_before", [0, 1])  # the magic's check, then the footer's
def test_a_file_that_cannot_be_opened_is_named(tmp_path, monkeypatch, opens_before):
    path = write_trace(tmp_path / "t.parquet", make_requests(), [])
    opened, really_open = [], type(path).open

    def refuse(self, *args, **kwargs):
        opened.append(self)
        if len(opened) > opens_before:
            raise PermissionError(13, "Permission denied")
        return really_open(self, *args, **kwargs)

    monkeypatch.setattr(type(path), "open", refuse)  # root may open anything: refuse here
    with pytest.raises(TraceFormatError) as exc:
        read_trace(path)
    assert str(exc.value) == f"{path}: cannot read: [Errno 13] Permission denied"
    assert (exc.value.file, exc.value.where, exc.value.field) == (str(path), None, None)


def test_corrupt_column_data_behind_a_sound_footer_is_named(tmp_path):
    path = write_trace(tmp_path / "t.parquet", make_requests(), make_steps(6))
    first_page = pq.ParquetFile(path).metadata.row_group(0).column(0).data_page_offset
    data = bytearray(path.read_bytes())
    data[first_page] ^= 0xFF  # the first page's header: the footer still reads
    path.write_bytes(bytes(data))
    with pytest.raises(TraceFormatError) as exc:
        read_trace(path)
    assert str(exc.value).startswith(f"{path}: truncated or corrupt Parquet data: ")
    assert (exc.value.file, exc.value.where, exc.value.field) == (str(path), None, None)


def test_a_footer_too_short_or_unreadable_is_called_truncated(tmp_path):
    path = tmp_path / "t.parquet"
    path.write_bytes(b"PAR1" + bytes(3) + b"PAR1")  # 11 bytes: no room for a footer
    with pytest.raises(TraceFormatError) as exc:
        read_trace(path)
    assert str(exc.value) == (f"{path}: truncated or corrupt Parquet file (11 bytes, no "
                              "footer magic at the end)")
    path.write_bytes(b"PAR1" + bytes(4) + b"PAR1")  # 12 bytes: a footer Arrow cannot read
    with pytest.raises(TraceFormatError) as exc:
        read_trace(path)
    assert str(exc.value).startswith(f"{path}: truncated or corrupt Parquet file: ")
    assert (exc.value.file, exc.value.where, exc.value.field) == (str(path), None, None)


def test_a_writer_rotates_every_200000_records_by_default(tmp_path):
    with TraceWriter(tmp_path / "run", server="s0", rank=0) as w:
        assert w.rotate_records == 200_000  # the documented default
    assert w.files == [] and list(tmp_path.iterdir()) == []  # nothing added, nothing written


@pytest.mark.parametrize("prompt_tokens", [2**40 + 5, 2**31])
def test_a_value_too_large_for_its_column_is_refused_not_wrapped(tmp_path, prompt_tokens):
    # Regression (found while testing _table_for_write's message for issue 14): int64
    # columns given directly were cast to the file's int32 by numpy, which wraps:
    # 2**40 + 5 was written, and read back, as 5.
    requests = RequestColumns(np.array(["a"], object), np.array([0.0]),
                              np.array([prompt_tokens]), np.array([1], np.int32),
                              np.array([None], object))
    path = tmp_path / "t.parquet"
    with pytest.raises(TraceFormatError) as exc:
        write_trace(path, requests, [])
    assert str(exc.value) == (f"{path}: records cannot be stored: field 'prompt_tokens': "
                              f"{prompt_tokens} does not fit int32")
    assert (exc.value.file, exc.value.where, exc.value.field) == (str(path), None, None)
    assert not path.exists()
    fits = RequestColumns(*(a.copy() for a in (requests.request_id, requests.arrival_s,
                                               np.array([2**31 - 1]), requests.output_tokens,
                                               requests.request_class)))
    assert read_trace(write_trace(path, fits, [])).requests.prompt_tokens.tolist() == [2**31 - 1]


def test_requests_of_equal_arrival_keep_their_order_when_sorted(tmp_path):
    # 21 requests: enough for numpy's default (unstable) sort to reorder equal arrivals.
    requests = [RequestRecord(f"r{k}", 1.0, 1, 1) for k in range(20)]
    requests.append(RequestRecord("first", 0.0, 1, 1))
    path = write_trace(tmp_path / "t.parquet", requests, [])
    assert list(read_trace(path).requests.request_id) == ["first"] + [f"r{k}" for k in range(20)]


_STEP_DTYPES = {
    "rank": np.int32, "step_index": np.int64, "time_s": np.float64, "batch_size": np.int32,
    "waiting_requests": np.int32, "running_requests": np.int32, "kv_used_tokens": np.int64,
    "kv_capacity_tokens": np.int64, "prefill_tokens": np.int64, "steps_used": np.int8,
    "step_latency_s": np.float64, "accepted_offsets": np.int64, "accepted_values": np.int8,
}


def test_step_columns_have_their_declared_dtypes_whatever_the_input_types():
    # numpy scalars of narrower types (a caller's int32/float32) must not narrow a column,
    # and no records must still give typed, empty columns (one offset, no values).
    narrow = StepRecord("s0", np.int64(0), np.int32(3), np.float32(0.5), np.int64(2), 0, 2,
                        np.int32(10), np.int32(100), np.int32(0), 1, [1, 0],
                        np.float32(0.01), None)
    for records, n_values in (([narrow], 2), ([], 0)):
        cols = StepColumns.from_records(records)
        got = {name: getattr(cols, name).dtype for name in _STEP_DTYPES}
        assert got == {name: np.dtype(t) for name, t in _STEP_DTYPES.items()}
        assert cols.accepted_offsets.tolist() == [0] + [n_values] * len(records)
        assert cols.accepted_values.size == n_values


def test_an_accepted_draft_count_that_does_not_fit_int8_is_refused_not_wrapped(tmp_path):
    # 257 wraps to 1 in int8, which would pass every range check of the reader.
    step = make_steps(2)[1]
    step = StepRecord(**{**{f: getattr(step, f) for f in StepRecord.__slots__},
                         "accepted_drafts": [257] * step.batch_size})
    path = tmp_path / "t.parquet"
    with pytest.raises(TraceFormatError, match=r"t\.parquet.*'accepted_drafts'") as info:
        write_trace(path, [], [step])
    assert info.value.field == "accepted_drafts"
    assert not path.exists()


@pytest.mark.parametrize(("field", "value", "problem"), [
    ("step_index", 2**63, "too large|out of bounds|overflow"),
    ("step_index", 3.5, "3.5 is not an integer"),
    ("batch_size", float("nan"), "NaN to integer"),
    ("kv_used_tokens", "many", "invalid literal|many"),
    ("accepted_drafts", np.array([300, 0], dtype=np.int64), "300 does not fit int8"),
    ("accepted_drafts", [1.5, 0], "are not integers"),
])
def test_a_step_value_its_column_cannot_hold_is_refused_naming_file_and_field(
        tmp_path, field, value, problem):
    """Not wrapped, truncated or raised bare: numpy would store 3.5 as 3."""
    step = make_steps(2)[1]
    step = StepRecord(**{**{f: getattr(step, f) for f in StepRecord.__slots__}, field: value})
    path = tmp_path / "t.parquet"
    with pytest.raises(TraceFormatError, match=rf"t\.parquet.*'{field}'.*({problem})") as info:
        write_trace(path, [], [step])
    assert info.value.field == field and not path.exists()
    writer = TraceWriter(tmp_path / "w", server=step.server, rank=step.rank)
    writer.add_step(step)
    with pytest.raises(TraceFormatError,
                       match=rf"w-.*\.parquet: field '{field}': records cannot be stored: "
                             rf".*({problem})") as info:
        writer.close()
    assert info.value.field == field


def test_accepted_drafts_are_stored_as_int8_exactly_to_its_limits():
    from env.traces.trace_format import StepFieldError, _int8_drafts

    assert _int8_drafts(np.array([127, -128, 0], dtype=np.int64)).tolist() == [127, -128, 0]
    assert _int8_drafts([1.0, 2.0]).dtype == np.int8  # whole floats are integers
    assert _int8_drafts([1.0, 3.0]).tolist() == [1, 3]
    assert _int8_drafts([[2], [3]]).tolist() == [2, 3]  # raveled
    for bad, problem in (([128], "128 does not fit int8"), ([-129], "does not fit int8"),
                         ([1.5], "are not integers"), ([2.5, 3.0], "are not integers"),
                         (["a"], "are not integers")):
        with pytest.raises(StepFieldError,
                           match=rf"^step records: field 'accepted_drafts': .*{problem}") as info:
            _int8_drafts(bad)
        assert info.value.field == "accepted_drafts"


def test_whole_floats_in_an_integer_step_column_are_stored_and_fractions_named():
    """A whole float (4.0, numpy float32 10.0) is an integer; only a fraction is refused,
    by a StepFieldError whose message names the field and the value."""
    from env.traces.trace_format import StepFieldError

    step = make_steps(2)[1]
    fields = {f: getattr(step, f) for f in StepRecord.__slots__}
    cols = StepColumns.from_records([StepRecord(**{**fields, "step_index": 4.0,
                                                   "kv_used_tokens": np.float32(10.0)})])
    assert cols.step_index.tolist() == [4] and cols.step_index.dtype == np.int64
    assert cols.kv_used_tokens.tolist() == [10]
    with pytest.raises(StepFieldError,
                       match=r"^step records: field 'kv_used_tokens': 10\.5 is not an integer$"):
        StepColumns.from_records([StepRecord(**{**fields, "kv_used_tokens": 10.5})])


def test_a_column_of_the_other_kind_is_null_in_the_file(tmp_path):
    path = write_trace(tmp_path / "t.parquet", make_requests(), make_steps(3))
    table = pq.read_table(path)
    n_req = len(make_requests())
    for name in ("request_id", "arrival_s", "prompt_tokens", "output_tokens"):
        assert table.column(name).slice(n_req).null_count == 3, name
    for name in ("server", "rank", "step_index", "time_s", "kv_used_tokens", "steps_used",
                 "step_latency_s", "accepted_drafts"):
        assert table.column(name).slice(0, n_req).null_count == n_req, name


@pytest.mark.parametrize("field", ["server", "request_id"])
def test_a_non_string_name_is_refused_not_stringified(tmp_path, field):
    step = make_steps(1)[0]
    requests, steps = make_requests(), [step]
    if field == "server":
        steps = [StepRecord(**{**{f: getattr(step, f) for f in StepRecord.__slots__},
                               "server": 5})]
    else:
        requests = [RequestRecord(7, 0.0, 1, 1)]
    path = tmp_path / "t.parquet"
    with pytest.raises(TraceFormatError, match="records cannot be stored"):
        write_trace(path, requests, steps)
    assert not path.exists()


def test_step_columns_with_int64_accepted_values_are_stored(tmp_path):
    # A StepColumns built by hand may hold its accepted counts as int64: stored as int8.
    steps = make_steps(5)
    cols = StepColumns.from_records(steps)
    cols.accepted_values = cols.accepted_values.astype(np.int64)
    back = read_trace(write_trace(tmp_path / "t.parquet", [], cols)).step_columns()
    assert back.accepted_values.tolist() == [int(x) for s in steps for x in s.accepted_drafts]
    assert back.accepted_values.dtype == np.int8


def test_prefill_pairs_round_trip_and_a_file_written_before_the_column_reads_as_none(tmp_path):
    steps = make_steps(6)
    steps[0].prefill_pairs = 2080.0  # a 64-token prompt: 64 * 65 / 2
    path = write_trace(tmp_path / "t.parquet", make_requests(), steps)
    read = read_trace(path).steps
    assert [s.prefill_pairs for s in read] == [2080.0, None, None, None, None, None]
    assert np.isnan(read_trace(path).step_columns().prefill_pairs[1:]).all()
    table = pq.read_table(path)
    meta = table.schema.metadata
    pq.write_table(table.drop_columns(["prefill_pairs"]).replace_schema_metadata(meta), path)
    assert [s.prefill_pairs for s in read_trace(path).steps] == [None] * 6


@pytest.mark.parametrize(("flag", "expected"), [
    ("warmup", [None, False, False, None, True, False, None, False, True]),
    ("before_prefill", [False, None, False, False, True, None, False, False, False]),
])
def test_a_flag_round_trips_and_a_file_written_before_its_column_reads_as_unknown(
        tmp_path, flag, expected):
    steps = make_steps(9)
    path = write_trace(tmp_path / "t.parquet", make_requests(), steps)
    assert [getattr(s, flag) for s in steps] == expected  # all three kinds
    assert [getattr(s, flag) for s in read_trace(path).steps] == expected
    codes = {None: -1, False: 0, True: 1}
    assert getattr(read_trace(path).step_columns(), flag).tolist() == [codes[v] for v in expected]
    table = pq.read_table(path)
    assert table.schema.field(flag).type == pa.bool_()
    assert table.column(flag).to_pylist()[:3] == [None] * 3  # null on request rows
    meta = table.schema.metadata
    pq.write_table(table.drop_columns([flag]).replace_schema_metadata(meta), path)
    back = read_trace(path).steps
    assert [getattr(s, flag) for s in back] == [None] * 9
    other = {"warmup": "before_prefill", "before_prefill": "warmup"}[flag]
    assert [getattr(s, other) for s in back] == [getattr(s, other) for s in steps]


@pytest.mark.parametrize("flag", ["warmup", "before_prefill"])
def test_a_flag_column_of_another_type_or_a_record_with_another_value_is_refused(tmp_path, flag):
    path = write_trace(tmp_path / "t.parquet", make_requests(), make_steps(3))
    table = pq.read_table(path)
    i = table.column_names.index(flag)
    strings = pa.array(["yes"] * table.num_rows, type=pa.string())
    pq.write_table(table.set_column(i, flag, strings)
                   .replace_schema_metadata(table.schema.metadata), path)
    with pytest.raises(TraceFormatError, match=rf"field '{flag}': has type string, expected bool"):
        read_trace(path)
    steps = make_steps(3)
    setattr(steps[1], flag, 1)  # an int is not a flag
    with pytest.raises(TraceFormatError, match=rf"field '{flag}': records cannot be stored: 1 is "
                                                r"not None, True or False"):
        write_trace(tmp_path / "u.parquet", [], steps)


def test_a_packed_trace_folder_reads_as_the_folder_and_leaves_no_scratch(tmp_path, monkeypatch):
    """read_packed_trace: a ``.tar.gz`` holding one trace folder (as the H200 scripts pack a
    recording) reads as that folder, its scratch copy removed; two folders inside are an
    error that names the archive; any other path is read_trace's."""
    folder = tmp_path / "trace-sim"
    write_trace(folder / "t.parquet", make_requests(), make_steps(), meta={"t0_unix": 1.0})
    archive = tmp_path / "trace.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(folder, arcname=folder.name)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", None)
    packed = read_packed_trace(archive)
    assert_steps_equal(packed.steps, read_trace(folder).steps)
    assert packed.meta["t0_unix"] == 1.0
    assert list(scratch.iterdir()) == []
    assert_steps_equal(read_packed_trace(folder).steps, packed.steps)
    other = tmp_path / "other"
    write_trace(other / "t.parquet", make_requests(), make_steps())
    with tarfile.open(tmp_path / "two.tar.gz", "w:gz") as tar:
        tar.add(folder, arcname="a")
        tar.add(other, arcname="b")
    with pytest.raises(TraceFormatError, match=r"two\.tar\.gz.*one trace folder.*\['a', 'b'\]"):
        read_packed_trace(tmp_path / "two.tar.gz")
