"""Tests of workload readers, shipped data and workload transforms."""

from __future__ import annotations

import hashlib
import re
import shutil
from datetime import datetime, timedelta
from importlib import resources
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from env.scenarios import ScenarioSampler
from env.traces.schema import RequestRecord
from env.traces.trace_format import DataFileError, write_trace
from env.traces.workloads import (
    ClosedLoop,
    Workload,
    WorkloadFormatError,
    detect_format,
    load_workload,
    read_azure_csv,
    read_mooncake_jsonl,
    shipped_workload,
)

DATA = Path(str(resources.files("env.traces").joinpath("data")))

# Facts from env/traces/data/SOURCES.md (computed upstream from the files themselves).
SHIPPED = {
    "azure_code": dict(rows=8819, span_s=3435.9, prompt_mean=2048, output_mean=28),
    "azure_conv": dict(rows=19366, span_s=3501.7, prompt_mean=1155, output_mean=211),
    "mooncake": dict(rows=3993, span_s=1022.0, prompt_mean=15325, output_mean=149),
}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_workloads(name):
    w = shipped_workload(name)
    facts = SHIPPED[name]
    assert len(w) == facts["rows"]
    assert w.arrival_s[0] == 0.0
    assert np.all(np.diff(w.arrival_s) >= 0)
    assert w.duration_s == pytest.approx(facts["span_s"], abs=0.1)
    assert w.prompt_tokens.mean() == pytest.approx(facts["prompt_mean"], abs=1)
    assert w.output_tokens.mean() == pytest.approx(facts["output_mean"], abs=1)
    assert w.prompt_tokens.dtype == np.int32 and w.output_tokens.min() >= 1


def test_azure_timestamps_parsed_to_sub_microsecond():
    w = shipped_workload("azure_code")
    # Rows 1 and 2: 18:17:03.9799600 and 18:17:04.0319600.
    assert w.arrival_s[1] == pytest.approx(0.052, abs=1e-9)


@pytest.mark.parametrize(("package", "files"), [
    ("env.traces", 3),  # the public workload traces
    ("env.sim", 1 + 5),  # the Spec-Bench acceptance log, the measured H200 folder
])
def test_shipped_files_match_sources_sha256(package, files):
    data = Path(str(resources.files(package).joinpath("data")))
    text = (data / "SOURCES.md").read_text()
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    checked = 0
    for section in sections:
        name = section.split("`")[1]
        if name.endswith("/"):  # a folder: "`file` `digest`" for each of its files
            found = re.findall(r"`([^`/]+)` `([0-9a-f]{64})`", section)
            assert {f for f, _ in found} == {p.name for p in (data / name).iterdir()}, name
            pairs = [(data / name / f, digest) for f, digest in found]
        else:
            pairs = [(data / name, re.search(r"sha256 `([0-9a-f]{64})`", section).group(1))]
        for path, digest in pairs:
            assert hashlib.sha256(path.read_bytes()).hexdigest() == digest, path
            checked += 1
    assert checked == files


# The reader parses every column in one numpy call (its speed is measured in
# benchmarks/bench_simulator.py); checked here against Python's own datetime and int.
@settings(max_examples=40, deadline=None)
@given(
    start=st.datetimes(datetime(2000, 1, 1), datetime(2090, 1, 1)),
    rows=st.lists(
        st.tuples(st.integers(0, 10**12), st.integers(1, 2**31 - 1), st.integers(1, 2**31 - 1)),
        min_size=1, max_size=30,
    ),
)
def test_azure_csv_matches_an_independent_parse(tmp_path_factory, start, rows):
    """Arrivals to 100 ns (Azure's 7 fractional digits) and token counts, as written."""
    ticks = sorted(t for t, _, _ in rows)  # 100 ns ticks after ``start``
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for tick, (_, prompt, output) in zip(ticks, rows, strict=True):
        moment = start.replace(microsecond=0) + timedelta(seconds=tick // 10**7)
        lines.append(f"{moment:%Y-%m-%d %H:%M:%S}.{tick % 10**7:07d},{prompt},{output}")
    path = tmp_path_factory.mktemp("azure") / "trace.csv"
    path.write_text("\n".join(lines) + "\n")
    w = read_azure_csv(path)
    np.testing.assert_allclose(w.arrival_s, [(t - ticks[0]) / 10**7 for t in ticks],
                               rtol=0, atol=1e-9)
    assert w.prompt_tokens.tolist() == [p for _, p, _ in rows]
    assert w.output_tokens.tolist() == [o for _, _, o in rows]


def test_detection_by_content_not_extension(tmp_path):
    csv_as_jsonl = tmp_path / "a.jsonl"
    shutil.copy(DATA / "AzureLLMInferenceTrace_code.csv", csv_as_jsonl)
    jsonl_as_csv = tmp_path / "b.csv"
    shutil.copy(DATA / "synthetic_trace.jsonl", jsonl_as_csv)
    trace = tmp_path / "c.txt"
    write_trace(
        trace,
        [RequestRecord("x", 5.0, 10, 3, "qa"), RequestRecord("y", 6.5, 20, 4, None)],
        [],
    )
    assert detect_format(csv_as_jsonl) == "azure_csv"
    assert detect_format(jsonl_as_csv) == "mooncake_jsonl"
    assert detect_format(trace) == "trace"
    assert len(load_workload(csv_as_jsonl)) == 8819
    assert len(load_workload(jsonl_as_csv)) == 3993
    w = load_workload(trace)
    np.testing.assert_array_equal(w.arrival_s, [0.0, 1.5])
    assert list(w.request_class) == ["qa", None]
    junk = tmp_path / "junk.csv"
    junk.write_text("hello,world\n1,2\n")
    with pytest.raises(WorkloadFormatError, match="unrecognised workload format"):
        load_workload(junk)


AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
ROW = "2023-11-16 18:17:03.9799600,{},{}\n"


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (
            "TIMESTAMP,ContextTokens,Foo\n",
            "line 1, field 'Foo': unknown column",
        ),
        (
            "TIMESTAMP,ContextTokens\n",
            "line 1, field 'GeneratedTokens': missing column",
        ),
        (
            AZURE_HEADER + ROW.format(5, 7) + ROW.format(5, "x"),
            "line 3, field 'GeneratedTokens': not an integer: 'x'",
        ),
        (
            AZURE_HEADER + ROW.format(5, 7) + ROW.format(0, 7),
            "line 3, field 'ContextTokens': must be >= 1, got 0",
        ),
        (
            AZURE_HEADER + ROW.format(5, -2),
            "line 2, field 'GeneratedTokens': must be >= 1, got -2",
        ),
        (
            AZURE_HEADER + ROW.format(5, 7) + "2023-11-16 18:17:02.0,5,7\n",
            "line 3, field 'TIMESTAMP': timestamps must not decrease",
        ),
        (
            AZURE_HEADER + ROW.format(5, 7) + "yesterday,5,7\n",
            "line 3, field 'TIMESTAMP': not a timestamp",
        ),
        (
            AZURE_HEADER + ROW.format(5, 7) + "2023-11-16 18:17:04.0,5\n",
            "line 3: 2 fields, expected 3",
        ),
        (AZURE_HEADER, "no data rows"),
        (  # regression: 10**20 raised a bare OverflowError
            AZURE_HEADER + ROW.format(5, 7) + ROW.format(10**20, 7),
            "line 3, field 'ContextTokens': too large: 100000000000000000000",
        ),
        (
            AZURE_HEADER + ROW.format(5, 7) + ROW.format(5, 2**31),
            "line 3, field 'GeneratedTokens': too large: 2147483648",
        ),
    ],
)
def test_azure_errors(tmp_path, content, expected):
    path = tmp_path / "az.csv"
    path.write_text(content)
    with pytest.raises(WorkloadFormatError) as exc:
        read_azure_csv(path)
    assert str(exc.value).startswith(f"{path}: {expected}"), str(exc.value)


MOON = '{{"timestamp": {}, "input_length": {}, "output_length": {}, "hash_ids": [1, 2]}}\n'


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (MOON.format(0, 5, 6) + "{not json\n", "line 2: malformed JSON"),
        (
            MOON.format(0, 5, 6) + '{"timestamp": 1, "input_length": 3}\n',
            "line 2, field 'output_length': missing field",
        ),
        (
            '{"timestamp": 1, "input_length": 3, "output_length": 3, "x": 1}\n',
            "line 1, field 'x': unknown field",
        ),
        (
            MOON.format(0, 5, 6) + MOON.format(3, 0, 6),
            "line 2, field 'input_length': must be >= 1, got 0",
        ),
        (
            MOON.format(0, 5, 6) + MOON.format(3, 5, 2.5),
            "line 2, field 'output_length': not an integer: 2.5",
        ),
        (
            MOON.format(10, 5, 6) + MOON.format(3, 5, 6),
            "line 2, field 'timestamp': timestamps must not decrease",
        ),
        (MOON.format(0, 5, 6) + "\n" + MOON.format(3, 5, 6), "line 2: empty line"),
        (  # regression: 10**20 raised a bare OverflowError
            MOON.format(0, 5, 6) + MOON.format(3, 10**20, 6),
            "line 2, field 'input_length': too large: 100000000000000000000",
        ),
        (  # regression: a deeply nested line raised a bare RecursionError
            MOON.format(0, 5, 6) + "[" * 100_000 + "]" * 100_000 + "\n",
            "line 2: JSON nested too deeply",
        ),
        (
            MOON.format(0, 5, 6) + MOON.format(3, 5, 6).replace("[1, 2]", "[1, -2]"),
            "line 2, field 'hash_ids': not a list of non-negative integers: [1, -2]",
        ),
        (
            MOON.format(0, 5, 6) + MOON.format(3, 5, 6).replace("[1, 2]", '"1,2"'),
            "line 2, field 'hash_ids': not a list of non-negative integers: '1,2'",
        ),
    ],
)
def test_mooncake_errors(tmp_path, content, expected):
    path = tmp_path / "m.jsonl"
    path.write_text(content)
    with pytest.raises(WorkloadFormatError) as exc:
        read_mooncake_jsonl(path)
    assert str(exc.value).startswith(f"{path}: {expected}"), str(exc.value)


def test_a_truncated_trace_is_called_truncated_not_foreign(tmp_path):
    # Regression: a truncated specctl trace was "a Parquet file without specctl trace
    # metadata".
    trace = write_trace(tmp_path / "t.parquet", [RequestRecord("x", 0.0, 10, 3)], [])
    data = trace.read_bytes()
    for cut in (len(data) - 1, len(data) // 2, 8):
        trace.write_bytes(data[:cut])
        with pytest.raises(DataFileError, match="truncated or corrupt Parquet"):
            load_workload(trace)
    foreign = tmp_path / "foreign.parquet"
    pq.write_table(pa.table({"a": [1, 2]}), foreign)
    with pytest.raises(DataFileError, match="not a specctl trace"):
        load_workload(foreign)


def test_mooncake_values(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(MOON.format(1000, 5, 6) + MOON.format(2500, 7, 8))
    w = read_mooncake_jsonl(path)
    np.testing.assert_allclose(w.arrival_s, [0.0, 1.5])
    np.testing.assert_array_equal(w.prompt_tokens, [5, 7])
    np.testing.assert_array_equal(w.output_tokens, [6, 8])
    # hash_ids: the prompts' prefix blocks, carried through windows and rescaling
    assert w.prefix_block_tokens == 512
    assert [b.tolist() for b in w.scaled(2.0).window(0.0, 0.5).prefix_blocks] == [[1, 2]]
    path.write_text(MOON.format(1000, 5, 6) + MOON.format(2500, 7, 8).replace(
        ', "hash_ids": [1, 2]', ""))
    assert read_mooncake_jsonl(path).prefix_blocks is None  # not known for every row


def uniform_workload(n: int = 10_000, rate: float = 10.0) -> Workload:
    arrival = np.arange(n) / rate
    return Workload("u", arrival, np.arange(n) % 50 + 1, np.arange(n) % 7 + 1)


def test_window_and_scale():
    w = uniform_workload()
    win = w.window(100.0, 50.0)
    assert len(win) == 500
    assert win.arrival_s[0] == 0.0 and win.arrival_s[-1] == pytest.approx(49.9)
    np.testing.assert_array_equal(win.prompt_tokens, w.prompt_tokens[1000:1500])
    fast = w.scaled(4.0)
    assert fast.duration_s == pytest.approx(w.duration_s / 4)
    assert fast.mean_rate == pytest.approx(w.mean_rate * 4)
    capped = w.with_output_cap(3)
    assert capped.output_tokens.max() == 3
    np.testing.assert_array_equal(capped.prompt_tokens, w.prompt_tokens)
    with pytest.raises(ValueError, match="rate_multiplier must be > 0, got 0"):
        w.scaled(0)
    with pytest.raises(ValueError, match="duration_s must be > 0, got -1"):
        w.window(0, -1)
    with pytest.raises(ValueError, match="max_output_tokens must be >= 1, got 0"):
        w.with_output_cap(0)


def test_modulated_rate_rises_and_falls():
    w = uniform_workload(n=100_000, rate=10.0)  # 10,000 s
    period, depth = 1000.0, 0.6
    m = w.modulated(period, depth)
    assert len(m) == len(w)
    assert np.all(np.diff(m.arrival_s) >= 0)
    # First half period (sin > 0): rate above the mean; second half: below.
    first = np.count_nonzero(m.arrival_s % period < period / 2)
    second = len(m) - first
    periods, rate = 10, 10.0
    expected_first = periods * rate * (period / 2 + depth * period / np.pi)  # integral of r(t)
    assert first == pytest.approx(expected_first, rel=0.01)
    assert first > 2 * second
    # Rate at the peak vs the trough, from arrivals in narrow windows.
    t = m.arrival_s
    peak = np.count_nonzero((t % period > 240) & (t % period < 260))
    trough = np.count_nonzero((t % period > 740) & (t % period < 760))
    assert peak / trough == pytest.approx((1 + depth) / (1 - depth), rel=0.05)
    assert m.duration_s == pytest.approx(w.duration_s, rel=0.01)
    assert w.modulated(period, 0.0).arrival_s.tolist() == w.arrival_s.tolist()
    with pytest.raises(ValueError, match=r"depth must be in \[0, 1\), got 1.0"):
        w.modulated(period, 1.0)
    with pytest.raises(ValueError, match="period_s must be > 0, got 0"):
        w.modulated(0, 0.5)


@settings(max_examples=30, deadline=None)
@given(
    times=st.lists(st.floats(0, 1e4, allow_nan=False), min_size=1, max_size=200),
    period=st.floats(1.0, 1e3),
    depth=st.floats(0.0, 0.95),
)
def test_modulated_is_monotone_property(times, period, depth):
    arrival = np.sort(np.asarray(times))
    w = Workload("p", arrival, np.ones(arrival.size, int), np.ones(arrival.size, int))
    m = w.modulated(period, depth)
    assert np.all(np.diff(m.arrival_s) >= 0)
    # Order preserved and displacement bounded by the warp amplitude.
    assert np.all(np.abs(m.arrival_s - arrival) <= depth * period / np.pi + 1e-6)


def test_workload_validation():
    with pytest.raises(ValueError, match="not sorted"):
        Workload("x", [1.0, 0.0], [1, 1], [1, 1])
    with pytest.raises(ValueError, match=r"output_tokens\[1\] = 0"):
        Workload("x", [0.0, 1.0], [1, 1], [1, 0])
    with pytest.raises(ValueError, match="equal length"):
        Workload("x", [0.0, 1.0], [1], [1, 1])


def test_closed_loop_sampling():
    w = uniform_workload(1000)
    cl = ClosedLoop(concurrency=8, lengths_from=w)
    rng = np.random.default_rng(0)
    prompt, output = cl.sample_lengths(rng, 5000)
    assert prompt.dtype == np.int32 and prompt.shape == (5000,)
    pairs = set(zip(w.prompt_tokens.tolist(), w.output_tokens.tolist(), strict=True))
    assert set(zip(prompt.tolist(), output.tolist(), strict=True)) <= pairs  # joint draws
    fixed = ClosedLoop(concurrency=2, prompt_tokens=256, output_tokens=128)
    p2, o2 = fixed.sample_lengths(rng, 3)
    assert p2.tolist() == [256] * 3 and o2.tolist() == [128] * 3
    mixed = ClosedLoop(concurrency=2, output_tokens=64, lengths_from=w)
    p3, o3 = mixed.sample_lengths(rng, 100)
    assert set(o3.tolist()) == {64} and len(set(p3.tolist())) > 1
    with pytest.raises(ValueError, match="concurrency must be >= 1, got 0"):
        ClosedLoop(concurrency=0, prompt_tokens=1, output_tokens=1)
    with pytest.raises(ValueError, match="give fixed prompt_tokens and output_tokens"):
        ClosedLoop(concurrency=1, prompt_tokens=1)
    with pytest.raises(ValueError, match="client_overhead_s must be finite and >= 0, got -1"):
        ClosedLoop(concurrency=1, prompt_tokens=1, output_tokens=1, client_overhead_s=-1)


def test_a_prompt_longer_than_the_kv_cache_is_left_out_of_the_load_and_reported(
    tmp_path, caplog
):
    # Regression: one such prompt in the trace entered the nominal capacity that sets
    # every window's load, and changed the results (-52% .. -90%) without a word.
    rows = [ROW.replace("18:17:03.9799600", f"18:{17 + i // 60:02d}:{i % 60:02d}.5")
            .format(400 + i % 50, 100 + i % 30) for i in range(1200)]
    clean, dirty = tmp_path / "clean.csv", tmp_path / "dirty.csv"
    clean.write_text(AZURE_HEADER + "".join(rows))
    rows[300] = rows[300].replace(",400,", ",2000000000,")
    dirty.write_text(AZURE_HEADER + "".join(rows))
    scenarios = {}
    for name, path in (("clean", clean), ("dirty", dirty)):
        spec = {"name": name, "path": str(path)}
        sampler = ScenarioSampler({"horizon_s": 10.0, "held_out_fraction": 0.2,
                                   "profiles": ["h200_llama31_8b"], "workloads": [spec]})
        with caplog.at_level("WARNING", logger="env.scenarios"):
            server = sampler.server("h200_llama31_8b", np.random.default_rng(0))
            scenarios[name] = [sampler.open_loop(spec, server, 1.0, f, 0.0, 0)
                               for f in (0.1, 0.5, 0.9)]
    np.testing.assert_allclose([s.workload.mean_rate for s in scenarios["dirty"]],
                               [s.workload.mean_rate for s in scenarios["clean"]], rtol=0.01)
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "'dirty'" in warning and str(dirty) in warning
    assert "1 of 1200 requests need more KV slots" in warning


def test_a_workloads_own_horizon_sets_its_windows_length():
    """Long-context traces get longer windows (specctl-eval: no empty window) while the
    others keep the global horizon; a bad one is refused naming the workload."""
    workloads = [{"name": "fixed", "kind": "closed", "concurrency": [1], "horizon_s": 30.0},
                 {"name": "azure_conv", "kind": "open", "load": [0.5], "horizon_s": 5.0},
                 {"name": "fixed", "kind": "closed", "concurrency": [2]}]
    sampler = ScenarioSampler({"horizon_s": 10.0, "profiles": ["h200_llama31_8b"],
                               "workloads": workloads}, split="eval")
    horizons = {s.label.split(" h200")[0]: s.horizon_s for s in sampler.evaluation(windows=1)}
    assert horizons == {"fixed C=1": 30.0, "azure_conv load=0.5 mod=0": 5.0, "fixed C=2": 10.0}
    with pytest.raises(ValueError, match="workload 'fixed': horizon_s must be > 0"):
        ScenarioSampler({"horizon_s": 10.0, "profiles": ["h200_llama31_8b"],
                         "workloads": [{**workloads[0], "horizon_s": 0}]})
