"""SPECCTL_HOOK_TIMING: O(1) per step on the scheduler thread, never raises into SGLang."""

from __future__ import annotations

import json
import logging

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from sglang_hooks import timing
from sglang_hooks.timing import HookClock, bucket_low, bucket_of


@given(st.integers(0, 2**63 - 1))
def test_a_duration_falls_in_its_bucket(ns):
    index = bucket_of(ns)
    assert bucket_low(index) <= ns < bucket_low(index + 1)
    # log-linear: a bucket is at most 1/16 of its lower edge wide (exact below 16 ns)
    assert bucket_low(index + 1) - bucket_low(index) <= max(1, bucket_low(index) // 16)


@given(st.integers(-10**6, 2**63 - 1))
def test_a_histogram_counts_a_duration_in_its_bucket(ns):
    histogram = timing.Histogram()
    histogram.add(ns)
    assert histogram.counts[bucket_of(max(ns, 0))] == 1 == sum(histogram.counts)
    assert histogram.max_ns == histogram.total_ns == max(ns, 0)


def test_percentiles_are_within_one_bucket_of_the_exact_ones():
    rng = np.random.default_rng(0)
    values = rng.lognormal(np.log(20_000), 1.0, size=5000).astype(np.int64)
    clock = HookClock("unused", write_every_s=0)
    for v in values:
        clock.current_ns = int(v)
        clock.end_step()
    summary = clock.summary()
    ordered = np.sort(values)
    for key, q in (("p50_us", 0.5), ("p90_us", 0.9), ("p99_us", 0.99)):
        exact = ordered[int(q * len(values))] / 1e3
        assert exact / (1 + 1 / 16) <= summary[key] <= exact
    assert summary["steps"] == 5000
    assert summary["max_us"] == values.max() / 1e3
    assert abs(summary["mean_us"] - values.mean() / 1e3) < 1e-6 * summary["mean_us"]


def test_ending_a_step_never_writes_the_file(monkeypatch):
    # Regression: end_step wrote (and sorted up to 200k entries) on the scheduler thread.
    clock = HookClock("unused", write_every_s=0)

    def fail() -> bool:
        raise AssertionError("written from the scheduler thread")

    monkeypatch.setattr(clock, "write", fail)
    for i in range(1000):
        clock.current_ns = i
        clock.end_step()
    assert clock.total_steps == 1000


def test_an_unwritable_file_is_logged_once_and_never_raises(tmp_path, caplog):
    # Regression: an unwritable SPECCTL_HOOK_TIMING path raised into Scheduler.run_batch.
    path = str(tmp_path / "missing-dir" / "hooks.json")
    clock = HookClock(path, write_every_s=0)
    with caplog.at_level(logging.WARNING, logger="sglang_hooks.timing"):
        clock.end_step()
        assert clock.write() is False
        assert clock.write() is False
        clock.close()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and path in warnings[0].getMessage()


def test_the_writer_thread_writes_the_summary_and_survives_failures(tmp_path):
    path = tmp_path / "hooks.json"
    clock = HookClock(str(tmp_path / "missing-dir" / "x.json"), write_every_s=0.01)
    clock.current_ns = 5_000
    clock.end_step()  # starts the writer thread, whose writes fail
    clock.path = str(path)  # the thread is still alive and writes on close
    clock.close()
    assert json.loads(path.read_text())["steps"] == 1


class FakeClock:
    """perf_counter_ns advancing ``tick`` ns per reading (plus what a hook 'spends')."""

    def __init__(self, tick: int) -> None:
        self.now, self.tick = 0, tick

    def __call__(self) -> int:
        self.now += self.tick
        return self.now


def test_the_wrappers_own_cost_is_measured_and_subtracted(monkeypatch):
    fake = FakeClock(tick=100)
    monkeypatch.setattr(timing.time, "perf_counter_ns", fake)
    clock = HookClock("unused", write_every_s=0)
    # plain: two readings around the hook; AROUND: two more around the original; outside:
    # two readings inside a plain method, less the one the plain subtraction covers
    assert (clock.plain_overhead_ns, clock.around_overhead_ns) == (100, 200)
    assert clock.outside_overhead_ns == 100

    def hook(*args):
        fake.now += 5_000  # the hook's own work

    def around_hook(original, *args):
        fake.now += 3_000
        return original(*args)

    def sglang_code(*args):
        fake.now += 7_000  # not the plugin's: excluded

    def policy_method(*args):
        fake.now += 2_000  # the plugin's part of the method
        untimed()  # SGLang's own rule, called from it: excluded

    untimed = clock.outside(sglang_code)
    clock.plain(hook)()
    clock.around(around_hook)(sglang_code)
    clock.plain(policy_method)()
    assert clock.current_ns == 5_000 + 3_000 + 2_000
    clock.end_step()
    clock.plain(lambda: None)()
    clock.end_step()  # a do-nothing hook's step reads 0
    clock.plain(clock.outside(lambda: None))()
    clock.end_step()  # nor does a method that only calls SGLang
    assert clock.max_ns == 10_000 and clock.total_ns == 10_000
    assert clock.summary()["subtracted_per_call_us"] == {"plain": 0.1, "around": 0.2,
                                                         "outside": 0.1}


def _spending(fake: FakeClock, ns: int):
    def hook(*args):
        fake.now += ns
    return hook


def test_idle_loop_iterations_are_counted_apart_not_added_to_the_next_step(monkeypatch):
    """The server idle between requests spins its loop, calling the input hooks each
    time: those iterations are idle time, not one long step at the next launch."""
    fake = FakeClock(tick=0)  # readings cost nothing: nothing is subtracted
    monkeypatch.setattr(timing.time, "perf_counter_ns", fake)
    clock = HookClock("unused", write_every_s=0)
    pull = clock.plain(_spending(fake, 500), "_pull_raw_reqs")
    inputs = clock.plain(_spending(fake, 1_000), "process_input_requests",
                         starts_iteration=True)

    def launch(original, *args):
        clock.end_step()  # as the runtime's run_batch hook does
        fake.now += 2_000
        return original(*args)

    run_batch = clock.around(launch, "run_batch")
    for _ in range(5):
        pull(), inputs(), run_batch(lambda: None)
    for _ in range(100):  # idle: no batch launched
        pull(), inputs()
    for _ in range(3):
        pull(), inputs(), run_batch(lambda: None)
    summary = clock.summary()
    assert summary["steps"] == 8
    # every step is one iteration's hooks (the first launch closes a step of 1,500)
    assert clock.max_ns == 3_500 and summary["p50_us"] == bucket_low(bucket_of(3_500)) / 1e3
    assert summary["idle_iterations"] == {"n": 100, "total_us": 150.0, "max_us": 1.5}
    assert {name: hook["n"] for name, hook in summary["per_hook"].items()} == {
        "_pull_raw_reqs": 108, "process_input_requests": 108, "run_batch": 8}
    assert summary["per_hook"]["run_batch"]["mean_us"] == 2.0


def test_without_idle_iterations_every_step_keeps_its_whole_time(monkeypatch):
    fake = FakeClock(tick=0)
    monkeypatch.setattr(timing.time, "perf_counter_ns", fake)
    clock = HookClock("unused", write_every_s=0)
    inputs = clock.plain(_spending(fake, 1_000), "process_input_requests",
                         starts_iteration=True)
    result = clock.plain(_spending(fake, 700), "process_batch_result")
    for _ in range(10):
        inputs()
        clock.end_step()
        result()
    assert clock.total_steps == 10 and clock.total_ns == 9 * 1_700 + 1_000
    assert clock.idle_iterations == 0


def test_collections_while_a_hook_runs_are_counted_as_the_hooks(tmp_path):
    import gc

    clock = HookClock(str(tmp_path / "hooks.json"), write_every_s=0)  # close() writes
    clock.end_step()  # the first step registers the collector's callback
    try:
        clock.plain(lambda: gc.collect(), "process_input_requests")()
        in_hooks = clock.summary()["gc"]["in_hooks"]["n"]
        everything = clock.summary()["gc"]["all"]["n"]
        assert in_hooks >= 1 and everything >= in_hooks
        gc.collect()  # SGLang's (or anyone's) collection, outside the plugin's hooks
        gc_summary = clock.summary()["gc"]
        assert gc_summary["in_hooks"]["n"] == in_hooks
        assert gc_summary["all"]["n"] > everything
        # inside an AROUND hook's original it is SGLang's time, not the hook's
        clock.around(lambda original: original(), "run_batch")(gc.collect)
        assert clock.summary()["gc"]["in_hooks"]["n"] == in_hooks
    finally:
        clock.close()
    assert clock.depth == 0


def test_sglangs_rule_is_counted_apart(monkeypatch):
    fake = FakeClock(tick=0)
    monkeypatch.setattr(timing.time, "perf_counter_ns", fake)
    clock = HookClock("unused", write_every_s=0)
    rule = clock.outside(_spending(fake, 4_000))
    clock.plain(lambda: rule(), "on_verify_complete")()
    clock.end_step()
    summary = clock.summary()
    assert summary["sglang_rule"] == {"calls": 1, "mean_us": 4.0}
    assert summary["steps"] == 1 and clock.max_ns == 0


def test_the_wrappers_cost_in_situ_beyond_the_calibration_is_probed(monkeypatch):
    """Calibrated warm, the wrappers can cost more where the hooks run (cold caches):
    probes of do-nothing hooks, at the top of every 8th loop iteration, say how much."""
    fake = FakeClock(tick=100)
    monkeypatch.setattr(timing.time, "perf_counter_ns", fake)
    clock = HookClock("unused", write_every_s=0)
    fake.tick = 300  # in situ every reading costs 3x what it did at calibration
    inputs = clock.plain(lambda: None, "process_input_requests", starts_iteration=True)
    for _ in range(16):
        inputs()
        clock.end_step()
    in_situ = clock.summary()["instrument_in_situ"]
    assert in_situ["probes"] == 2
    # plain: 2 readings (300 ns) less the 100 calibrated; AROUND: 4 readings (900 ns)
    # less the original's 300 and the 200 calibrated; outside: a plain around it records
    # 4 readings (less 100) less its window (300) and its 100 calibrated, 400 ns, of which
    # the plain's excess is 200
    assert in_situ["excess_per_call_p50_us"] == {"plain": 0.2, "around": 0.4, "outside": 0.2}
    # one plain hook per step, nothing else: 16 input calls over 16 steps
    assert in_situ["excess_per_step_us"] == 0.2
    assert clock.summary()["per_hook"]["process_input_requests"]["n"] == 16


def test_closing_a_step_inside_the_launch_hook_is_not_the_hooks_time(monkeypatch):
    """end_step runs inside run_batch's timed window: its bookkeeping is the clock's."""
    fake = FakeClock(tick=0)
    monkeypatch.setattr(timing.time, "perf_counter_ns", fake)
    clock = HookClock("unused", write_every_s=0)
    add = timing.Histogram.add

    def slow_add(self, ns: int) -> None:  # the histograms on cold caches
        fake.now += 5_000
        add(self, ns)

    monkeypatch.setattr(timing.Histogram, "add", slow_add)

    def launch(original, *args):
        clock.end_step()
        fake.now += 2_000  # the hook's own work
        return original(*args)

    run_batch = clock.around(launch, "run_batch")
    for _ in range(3):
        run_batch(lambda: None)
    clock.end_step()  # outside any hook: nothing is left over for the next one
    run_batch(lambda: None)
    hook = clock.summary()["per_hook"]["run_batch"]
    assert hook["n"] == 4 and hook["max_us"] == hook["mean_us"] == 2.0
    assert clock.max_ns == 2_000


def test_durations_appended_while_a_fold_runs_are_kept():
    histogram = timing.Histogram()
    histogram.pending.extend([1_000, 2_000])

    class Appending(list):  # the scheduler thread appends (once) while the writer folds
        appended = False

        def __getitem__(self, index):
            taken = super().__getitem__(index)
            if not self.appended:
                self.appended = True
                self.append(5_000)
            return taken

    histogram.pending = Appending(histogram.pending)
    histogram.fold()
    assert histogram.n == 2 and list(histogram.pending) == [5_000]
    histogram.fold()
    assert histogram.n == 3 and histogram.max_ns == 5_000 and not histogram.pending


def test_nothing_accumulates_unread_on_the_scheduler_thread():
    """Every list the wrappers append to is binned by the writer (or reset): a server
    running for days must not grow them."""
    clock = HookClock("unused", write_every_s=0)
    inputs = clock.plain(lambda: None, "process_input_requests", starts_iteration=True)
    run_batch = clock.around(lambda original: (clock.end_step(), original())[1], "run_batch")
    for _ in range(800):
        inputs()
        run_batch(lambda: None)
    clock.summary()  # what the writer thread does every few seconds
    assert not clock.steps.pending and clock.total_steps == 800
    assert all(not hist.pending for hist in clock.hooks.values())
    assert not clock._probe_scratch.pending  # the probes ran 100 times
    assert clock.summary()["instrument_in_situ"]["probes"] == 100


def test_without_a_writer_the_scheduler_thread_bins_a_long_backlog(monkeypatch):
    monkeypatch.setattr(timing, "_MAX_PENDING", 10)
    clock = HookClock("unused", write_every_s=0)
    for i in range(25):
        clock.current_ns = 1_000 * (i + 1)
        clock.end_step()
        assert len(clock.steps.pending) <= 11
    assert clock.total_steps == 25 and clock.max_ns == 25_000


def test_the_writer_bins_a_backlog_in_chunks(monkeypatch):
    monkeypatch.setattr(timing, "_FOLD_CHUNK", 7)
    clock = HookClock("unused", write_every_s=0)
    for i in range(30):
        clock.current_ns = 100 * i
        clock.end_step()
    clock._fold_in_chunks()
    assert 0 < len(clock.steps.pending) <= 7  # the rest is binned by the write's summary
    assert clock.summary()["steps"] == 30 and clock.max_ns == 2_900


def _two_clocks(monkeypatch) -> tuple[FakeClock, FakeClock]:
    """Fake wall and CPU clocks that only the hooks advance (readings cost nothing)."""
    wall, cpu = FakeClock(tick=0), FakeClock(tick=0)
    monkeypatch.setattr(timing.time, "perf_counter_ns", wall)
    monkeypatch.setattr(timing.time, "thread_time_ns", cpu)
    return wall, cpu


def test_the_cpu_split_tells_time_off_the_cpu_from_the_hooks_work(monkeypatch):
    wall, cpu = _two_clocks(monkeypatch)
    clock = HookClock("unused", write_every_s=0, cpu=True)

    def spend(wall_ns: int, cpu_ns: int):
        def hook(*args):
            wall.now += wall_ns
            cpu.now += cpu_ns
        return hook

    preempted = clock.plain(spend(5_000, 2_000), "process_batch_result")  # 3 us off-CPU

    def launch(original, *args):
        spend(3_000, 3_000)()
        return original(*args)

    rule = clock.outside(spend(4_000, 1_000))  # SGLang's, off-CPU part too: excluded

    def policy_method():
        spend(2_000, 2_000)()
        rule()

    run_batch = clock.around(launch, "run_batch")
    method = clock.plain(policy_method, "get_steps_for_batch")
    run_batch(spend(7_000, 7_000))  # SGLang's original: excluded
    method()
    preempted()
    assert (clock.current_ns, clock.current_cpu_ns) == (10_000, 7_000)
    clock.end_step()
    clock.plain(spend(25_000, 1_000), "process_batch_result")()  # 24 us off-CPU
    clock.end_step()
    summary = clock.summary()["cpu"]
    assert summary["step_cpu"]["max_us"] == 7.0 and summary["step_cpu"]["mean_us"] == 4.0
    assert summary["step_off_cpu"]["max_us"] == 24.0
    assert summary["step_off_cpu"]["mean_us"] == (3.0 + 24.0) / 2
    assert summary["steps_off_cpu_over_us"] == {"threshold_us": 10.0, "n": 1}
    per_hook = summary["per_hook_off_cpu"]
    assert per_hook["process_batch_result"]["max_us"] == 24.0
    assert per_hook["run_batch"]["max_us"] == per_hook["get_steps_for_batch"]["max_us"] == 0
    # each hook's own time leaves SGLang's out, as the step's does
    assert clock.summary()["per_hook"]["get_steps_for_batch"]["max_us"] == 2.0


def test_the_cpu_clocks_readings_are_calibrated_out(monkeypatch):
    """Every reading of either clock costs 100 ns, on the CPU (one clock for both): the
    CPU clock's window inside a wrapper is narrower than the wall clock's, so each has its
    own calibration, and do-nothing hooks read 0 on both clocks, none of it off the CPU."""
    now = FakeClock(tick=100)
    monkeypatch.setattr(timing.time, "perf_counter_ns", now)
    monkeypatch.setattr(timing.time, "thread_time_ns", now)
    clock = HookClock("unused", write_every_s=0, cpu=True)
    assert clock.summary() == {"steps": 0}
    # plain: wall start, CPU start, CPU end, wall end; AROUND: two more around the original
    assert (clock.plain_overhead_ns, clock.around_overhead_ns,
            clock.outside_overhead_ns) == (300, 400, 100)
    assert (clock.plain_cpu_overhead_ns, clock.around_cpu_overhead_ns,
            clock.outside_cpu_overhead_ns) == (100, 400, 300)
    nothing = clock.plain(lambda: None, "process_input_requests")
    around = clock.around(lambda original: original(), "run_batch")
    method = clock.plain(clock.outside(lambda: None), "get_steps_for_batch")
    for _ in range(5):
        nothing(), around(lambda: None), method()
        assert (clock.current_ns, clock.current_cpu_ns) == (0, 0)
        clock.end_step()
    summary = clock.summary()["cpu"]
    assert summary["step_off_cpu"]["max_us"] == summary["step_cpu"]["max_us"] == 0


def test_idle_iterations_leave_the_step_on_both_clocks(monkeypatch):
    wall, cpu = _two_clocks(monkeypatch)
    clock = HookClock("unused", write_every_s=0, cpu=True)

    def polling():
        wall.now += 1_000
        cpu.now += 400

    inputs = clock.plain(polling, "process_input_requests", starts_iteration=True)
    for _ in range(3):  # one step of one iteration, then idle ones
        inputs()
    assert clock.idle_iterations == 2
    clock.end_step()
    summary = clock.summary()["cpu"]
    assert summary["step_cpu"]["max_us"] == 0.4 and summary["step_off_cpu"]["max_us"] == 0.6


def test_without_the_cpu_split_the_cpu_clock_is_never_read(monkeypatch):
    def fail():
        raise AssertionError("the thread's CPU clock was read")

    monkeypatch.setattr(timing.time, "thread_time_ns", fail)
    clock = HookClock("unused", write_every_s=0)
    clock.plain(lambda: None, "process_input_requests")()
    clock.end_step()
    assert "cpu" not in clock.summary() and clock.summary()["steps"] == 1
