"""Where the source rank's hook time goes: thread CPU per hook, next to the same hook
doing nothing (and the policy's two methods next to SGLang's own). A diagnostic, not a
test; ``bench_online.py`` (its ``hooks`` part) is the measurement.

    python benchmarks/profile_hooks.py [--iterations 4000] [--recording]

The loops of ``bench_online.py``'s hook part run in lock-step: plain (SGLang's params,
no hooks), four empty hooks, and the plugin's source rank with a live ``specctl-serve``,
each once as is (the added CPU per step, as the benchmark reports it) and once with every
hook and policy method wrapped in ``time.thread_time_ns`` (~0.6 us per reading, in both
columns of the per-hook table alike).
"""

from __future__ import annotations

import argparse
import pickle
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_online import (  # noqa: E402
    EmptyHooks,
    rank_loop_builder,
    scheduler_batch,
    start_controller,
)
from controller.policy_file import ExportedPolicy  # noqa: E402

#: Per hook (and policy method): thread CPU (ns) of each call, less the SGLang code it wraps.
_spent: dict[str, list[int]] = defaultdict(list)


def _timed_plain(name: str, fn: Callable) -> Callable:
    def timed(*args, **kwargs):
        start = time.thread_time_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            _spent[name].append(time.thread_time_ns() - start)
    return timed


def _timed_around(name: str, hook: Callable) -> Callable:
    def timed(original, *args, **kwargs):
        inner = 0

        def timed_original(*a, **k):
            nonlocal inner
            start = time.thread_time_ns()
            try:
                return original(*a, **k)
            finally:
                inner += time.thread_time_ns() - start

        start = time.thread_time_ns()
        try:
            return hook(timed_original, *args, **kwargs)
        finally:
            _spent[name].append(time.thread_time_ns() - start - inner)
    return timed


class _Timed:
    """Another hook provider's table, each hook timed under ``prefix + its name``."""

    def __init__(self, inner, prefix: str) -> None:
        self.inner, self.prefix = inner, prefix

    def hook_table(self) -> dict:
        return {name: ((_timed_around if kind == "AROUND" else _timed_plain)(
                    self.prefix + name, hook), kind)
                for name, (hook, kind) in self.inner.hook_table().items()}

    def attach(self, scheduler) -> None:
        self.inner.attach(scheduler)


def _timed_params(base: type, prefix: str) -> type:
    return type("TimedParams", (base,), {
        name: _timed_plain(prefix + name, getattr(base, name))
        for name in ("get_steps_for_batch", "on_verify_complete")})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=4000)
    parser.add_argument("--recording", action="store_true", help="the source records too")
    parser.add_argument("--sglang", type=Path, default=REPO / ".sglang" / "0.5.23")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sc-prof-", ignore_cleanup_errors=True) as tmp:
        workdir = Path(tmp)
        build = rank_loop_builder(args.sglang, workdir)
        from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams

        from sglang_hooks.compat import Ranks, installed_version
        from sglang_hooks.config import PluginConfig
        from sglang_hooks.policy import make_policy_class
        from sglang_hooks.runtime import Runtime
        from sglang_hooks.testing import ReqStandIn

        policy = workdir / "policy.npz"
        ExportedPolicy.random(seed=0).save(policy)
        endpoint = f"ipc://{workdir}/hooks.sock"
        controller = start_controller(policy, endpoint)
        extra = {"record_dir": str(workdir / "rec")} if args.recording else {}
        runtimes = [Runtime(PluginConfig(server=name, controller=endpoint, **extra),
                            installed_version(), ranks=Ranks(0, 2, 0, 1, 0, False))
                    for name in ("a", "b")]
        try:
            source, timed = runtimes
            loops = {
                "plain": build(None, True),
                "empty hooks": build(EmptyHooks(), True),
                "source": build(source, True),
                "plain, timed": build(None, True, _timed_params(AdaptiveSpeculativeParams,
                                                                "sglang:")),
                "empty hooks, timed": build(_Timed(EmptyHooks(), "empty:"), True),
                "source, timed": build(_Timed(timed, "specctl:"), True, _timed_params(
                    make_policy_class(AdaptiveSpeculativeParams, timed), "specctl:")),
            }
            reqs = [ReqStandIn(f"r{i}") for i in range(64)]
            cpu: dict[str, list[int]] = {name: [] for name in loops}
            for i in range(args.iterations):
                for name, loop in loops.items():
                    batch = scheduler_batch(i, reqs)
                    start = time.thread_time_ns()
                    pulled = loop.pull()
                    loop.iterate(pickle.loads(pickle.dumps(pulled)) if pulled else [], batch)
                    cpu[name].append(time.thread_time_ns() - start)
                    time.sleep(0.001 / len(loops))
        finally:
            controller.kill()
            for rt in runtimes:
                rt.close()

    def p50(values: list[int]) -> float:
        """Median in us, the first tenth (warm-up) left out."""
        return float(np.percentile(values[len(values) // 10:], 50)) / 1e3

    print("thread CPU per iteration added over plain (us, p50):")
    for name in ("empty hooks", "source"):
        print(f"  {name:12s} {p50(cpu[name]) - p50(cpu['plain']):7.1f}")
    print("per hook, thread CPU per call (us, p50; readings included):")
    print(f"  {'hook':32s} {'specctl':>8s} {'empty / SGLang':>15s}")
    for name in ("_pull_raw_reqs", "process_input_requests", "run_batch",
                 "process_batch_result", "get_steps_for_batch", "on_verify_complete"):
        other = _spent.get("empty:" + name) or _spent.get("sglang:" + name)
        print(f"  {name:32s} {p50(_spent['specctl:' + name]):8.2f} {p50(other):15.2f}")


if __name__ == "__main__":
    main()
