"""The floor of necessary work on the plugin's own clock: hooks that do only what must
happen on the scheduler thread, next to the four empty hooks and the source rank.

A diagnostic, not a test (issue 12's "at most 2x the empty hooks" target). In
``bench_online.py``'s stand-in loop, lock-step, on the clock ``SPECCTL_HOOK_TIMING``
uses (``HookClock``), three loops:

* ``empty``: the four do-nothing hooks (``bench_online``'s floor row);
* ``necessary``: the same four hooks and the policy's two methods doing only what the
  source rank cannot move off the scheduler thread: the launch reads SGLang's state into
  one tuple (the nine values the telemetry needs), the result reads the time and appends
  one tuple, the pull checks the client's marker, the input hook looks at its list, the
  policy answers by one dictionary lookup and queues the verify with one append;
* ``source``: the plugin's source rank with a live ``specctl-serve``.

    python benchmarks/necessary_hooks.py [--runs 3] [--iterations 4000]
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_online import (  # noqa: E402
    TimedEmptyHooks,
    rank_loop_builder,
    scheduler_batch,
    start_controller,
)
from controller.policy_file import ExportedPolicy  # noqa: E402

_RING = 16


class NecessaryHooks(TimedEmptyHooks):
    """The four hooks doing only the source rank's necessary reads (see module docstring),
    on the same clock as :class:`TimedEmptyHooks`."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.launches: list[tuple | None] = [None] * _RING
        self.out: deque[tuple] = deque()
        self.marker = None  # the client's newest marker (never set here)
        self.last_marker = None

    def _pull(self, result, *args, **kwargs):
        if result is None:
            return None
        marker = self.marker
        if marker is not None and marker is not self.last_marker:
            result.append(marker)
        return None

    @staticmethod
    def _input(scheduler, *args, **kwargs):
        recv_reqs = args[0] if args else kwargs.get("recv_reqs")
        if not recv_reqs:
            return None
        return None

    def _launch(self, original, scheduler, batch):
        self.clock.end_step()
        step = scheduler.forward_ct + 1
        mode = batch.forward_mode
        is_decode = mode.is_decode()
        if is_decode or mode.is_extend():
            reqs = batch.reqs
            running = scheduler.running_batch
            self.launches[step % _RING] = (
                step, time.monotonic(), is_decode, len(reqs), len(scheduler.waiting_queue),
                len(running.reqs) if running is not None else 0,
                scheduler.max_total_num_tokens,
                scheduler.token_to_kv_pool_allocator.available_size(),
                scheduler.tree_cache.evictable_size(),
                None if is_decode else batch.extend_num_tokens)
        return original(scheduler, batch)

    def _result(self, original, scheduler, batch, *args):
        step = batch.forward_iter
        result = original(scheduler, batch, *args)
        self.out.append((self.launches[step % _RING], time.monotonic()))
        return result

    def hook_table(self) -> dict:
        clock = self.clock
        return {"_pull_raw_reqs": (clock.plain(self._pull, "_pull_raw_reqs"), "AFTER"),
                "process_input_requests": (clock.plain(
                    self._input, "process_input_requests", starts_iteration=True), "BEFORE"),
                "run_batch": (clock.around(self._launch, "run_batch"), "AROUND"),
                "process_batch_result": (clock.around(self._result, "process_batch_result"),
                                         "AROUND")}

    def params_class(self, base: type) -> type:
        """SGLang's params with the policy's two methods doing their necessary part,
        timed by this clock as the plugin's are."""
        memo: dict[int, int] = {}
        queued: deque[tuple] = deque()

        def get_steps_for_batch(params, batch_size: int) -> int:
            steps = memo.get(batch_size)
            if steps is None:
                steps = memo[batch_size] = 3
            return steps

        def on_verify_complete(params, drafts: list[int], batch_size: int) -> None:
            queued.append((drafts, batch_size))
            return None

        clock = self.clock
        return type("NecessaryParams", (base,), {
            "get_steps_for_batch": clock.plain(get_steps_for_batch, "get_steps_for_batch"),
            "on_verify_complete": clock.plain(on_verify_complete, "on_verify_complete")})


def one_run(iterations: int) -> dict[str, dict]:
    """One lock-step run; each loop's clock summary."""
    with tempfile.TemporaryDirectory(prefix="sc-necessary-", ignore_cleanup_errors=True) as tmp:
        workdir = Path(tmp)
        build = rank_loop_builder(REPO / ".sglang" / "0.5.23", workdir)
        from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams

        from sglang_hooks.compat import Ranks, installed_version
        from sglang_hooks.config import PluginConfig
        from sglang_hooks.runtime import Runtime
        from sglang_hooks.testing import ReqStandIn

        policy = workdir / "policy.npz"
        ExportedPolicy.random(seed=0).save(policy)
        endpoint = f"ipc://{workdir}/hooks.sock"
        controller = start_controller(policy, endpoint)
        empty = TimedEmptyHooks(str(workdir / "empty.json"))
        necessary = NecessaryHooks(str(workdir / "necessary.json"))
        source = Runtime(PluginConfig(server="s", controller=endpoint,
                                      hook_timing=str(workdir / "source")),
                         installed_version(), ranks=Ranks(0, 2, 0, 1, 0, False))
        try:
            loops = {"empty": build(empty, True),
                     "necessary": build(necessary, True,
                                        necessary.params_class(AdaptiveSpeculativeParams)),
                     "source": build(source, True)}
            reqs = [ReqStandIn(f"r{i}") for i in range(64)]
            for i in range(iterations):
                for loop in loops.values():
                    pulled = loop.pull()
                    loop.iterate(pickle.loads(pickle.dumps(pulled)) if pulled else [],
                                 scheduler_batch(i, reqs))
                    time.sleep(0.001 / len(loops))
            for loop in loops.values():
                loop.drain()
            return {"empty": empty.clock.summary(), "necessary": necessary.clock.summary(),
                    "source": source.clock.summary()}
        finally:
            controller.kill()
            source.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=4000)
    args = parser.parse_args()
    rows = []
    for run in range(args.runs):
        load = os.getloadavg()[0]
        clocks = one_run(args.iterations)
        row = {name: clock["p50_us"] for name, clock in clocks.items()}
        rows.append(row)
        print(f"run {run + 1} (load {load:.1f}): clock p50 "
              + ", ".join(f"{name} {value:.2f} us" for name, value in row.items())
              + f"; necessary / empty {row['necessary'] / row['empty']:.2f}, "
                f"source / empty {row['source'] / row['empty']:.2f}")
        for name, clock in clocks.items():
            print(f"  {name:10s} per hook p50 (us): " + ", ".join(
                f"{hook} {h['p50_us']:.2f}" for hook, h in clock["per_hook"].items()))
    medians = {name: float(np.median([r[name] for r in rows])) for name in rows[0]}
    ratios = {name: float(np.median([r[name] / r["empty"] for r in rows]))
              for name in ("necessary", "source")}
    print("median clock p50 (us): " + ", ".join(f"{k} {v:.2f}" for k, v in medians.items())
          + "; median ratio to the empty hooks: "
          + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))


if __name__ == "__main__":
    main()
