"""Lock-step A/B of the policy's ``get_steps_for_batch`` with controller decisions.

A diagnostic, not a test. On the GPU the hook's p99 read 16-20 us when the controller
served a policy and 7.7 us when it served a static one (p50 4.4): a new decision object
arrives on a few percent of steps, and with a wandering batch size each (decision, batch
size) pair was a lookup of its own. Here two source trees' policy classes (SGLang
0.5.23's ``AdaptiveSpeculativeParams`` under each) answer the same stream, in
alternating order: a new decision every ``--every`` steps (the daemon's 20-value grid,
random steps, compressed as the daemon sends them), the batch size a random walk in
``1..--batch``, and, between calls, SGLang's work on a heap of cold objects
(``bench_hook_server``'s, so that each call starts on a cold cache as on the server).
What the client's I/O thread would do with a new marker (``specctl_prepare``, where the
tree has it) runs outside the timed call, as it does off the scheduler thread.

    python benchmarks/ab_policy_lookup.py --before /path/to/other/checkout [--steps 20000]

Printed per tree: wall time per call (p50/p90/p99/mean, us; the timer's own cost, read
on an empty call, subtracted), split into calls that saw a new decision and the others.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from source_trees import load_tree

REPO = Path(__file__).resolve().parents[1]
MODULES = ("sglang_hooks.policy", "sglang_hooks.runtime", "sglang_hooks.marker",
           "sglang_hooks.config", "sglang_hooks.compat", "sglang_hooks.testing",
           "benchmarks.bench_hook_server")
GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


def decisions(rng: random.Random, count: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(grid, steps) pairs as the daemon sends them: equal neighbours merged."""
    out = []
    for _ in range(count):
        level = rng.randint(0, 7)
        steps = [max(0, min(7, level + rng.choice((-1, 0, 0, 0, 1)))) for _ in GRID]
        grid, kept = [], []
        for size, depth in zip(GRID, steps, strict=True):
            if not kept or kept[-1] != depth:
                grid.append(size)
                kept.append(depth)
        out.append((tuple(grid), tuple(kept)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--after", type=Path, default=REPO)
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--every", type=int, default=25, help="steps per new decision")
    parser.add_argument("--batch", type=int, default=64, help="largest batch size")
    parser.add_argument("--tiers", action="store_true",
                        help="SGLang's default tiers (routing) instead of the shipped config")
    parser.add_argument("--graph-bs", default="1,2,4,8,16,24,32,48,64,96,128,256,512",
                        help="CUDA graph batch sizes SGLang sets ('' for none)")
    parser.add_argument("--heap-m", type=float, default=1.0)
    parser.add_argument("--touch", type=int, default=400)
    parser.add_argument("--sglang", type=Path, default=REPO / ".sglang" / "0.5.23")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="sc-abp-"))
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    config = None
    if args.tiers:
        config = workdir / "tiers.json"
        config.write_text(json.dumps({"1": {"candidate_steps": [1, 3, 5, 7]},
                                      "8": {"candidate_steps": [0, 1, 3]},
                                      "32": {"candidate_steps": [0, 1]},
                                      "64": {"candidate_steps": [0]}}))
    graph_bs = [int(b) for b in args.graph_bs.split(",") if b]
    policies, runtimes, markers = {}, {}, {}
    work = None
    for tag, root in trees.items():
        mods = load_tree(root, MODULES)
        if work is None:
            mods["sglang_hooks.testing"].write_import_stand_ins(workdir / "stand-ins")
            sys.path[1:1] = [str(args.sglang), str(workdir / "stand-ins")]
            from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams

            server = mods["benchmarks.bench_hook_server"]
            work = server.SGLangWork(argparse.Namespace(
                heap_m=args.heap_m, sglang_touch=args.touch, sglang_allocs=40,
                release_every=0, gpu_wait_us=0.0))
        compat, cfg = mods["sglang_hooks.compat"], mods["sglang_hooks.config"]
        rt = mods["sglang_hooks.runtime"].Runtime(
            cfg.PluginConfig(server=tag), compat.installed_version(),
            ranks=compat.Ranks(0, 1, 0, 1, 0, False))
        shipped = str(mods["sglang_hooks.policy"].__file__).replace("policy.py",
                                                                     "adaptive_config.json")
        params = mods["sglang_hooks.policy"].make_policy_class(AdaptiveSpeculativeParams, rt)(
            initial_steps=3, cfg_path=str(config or shipped))
        params.set_cuda_graph_bs(graph_bs or None)
        runtimes[tag], policies[tag] = rt, params
        markers[tag] = mods["sglang_hooks.marker"].DecisionMarker
    rng = random.Random(0)
    stream = decisions(rng, args.steps // args.every + 1)
    sizes, size = [], args.batch // 2
    for _ in range(args.steps):
        size = max(1, min(args.batch, size + rng.choice((-2, -1, 0, 0, 0, 1, 2))))
        sizes.append(size)

    def empty(batch_size: int) -> int:
        return batch_size

    spent = {tag: [] for tag in (*trees, "empty")}
    new = {tag: [] for tag in trees}
    prepare_ns = {tag: [] for tag in trees}
    answers = {tag: [] for tag in trees}
    load_before = os.getloadavg()[0]
    order = list(trees)
    clock = time.perf_counter_ns
    for i in range(args.steps):
        fresh = i % args.every == 0
        for tag in (order if i % 2 == 0 else order[::-1]):
            rt, params = runtimes[tag], policies[tag]
            if fresh:
                grid, steps = stream[i // args.every]
                marker = markers[tag](i // args.every + 1, "controller", i, grid, steps, "p")
                prepare = getattr(params, "specctl_prepare", None)
                if prepare is not None:  # the client's I/O thread, off the timed path
                    started = time.thread_time_ns()
                    prepare(marker)
                    prepare_ns[tag].append(time.thread_time_ns() - started)
                rt.controller = marker
            rt.launch_step = i
            work.work()
            started = clock()
            answer = params.get_steps_for_batch(sizes[i])
            spent[tag].append(clock() - started)
            new[tag].append(fresh)
            answers[tag].append(answer)
        work.work()
        started = clock()
        empty(sizes[i])
        spent["empty"].append(clock() - started)
    skip = args.steps // 10
    floor = float(np.percentile(spent["empty"][skip:], 50))
    if answers["before"] != answers["after"]:
        print("the two trees answered differently!")
    print(f"load {load_before:.1f} -> {os.getloadavg()[0]:.1f}; {args.steps} calls each, a new "
          f"decision every {args.every}; timer floor {floor / 1e3:.2f} us (subtracted)")
    result: dict = {"load_average_1min": [load_before, os.getloadavg()[0]], "args": {
        k: str(v) for k, v in vars(args).items()}, "floor_us": floor / 1e3}
    print(f"{'us per call':22s} {'p50':>6s} {'p90':>6s} {'p99':>6s} {'mean':>6s}")
    for tag in trees:
        values = (np.asarray(spent[tag][skip:]) - floor) / 1e3
        fresh = np.asarray(new[tag][skip:])
        for part, chosen in (("all", values), ("new decision", values[fresh]),
                             ("same decision", values[~fresh])):
            row = {k: float(np.percentile(chosen, q)) for k, q in
                   (("p50", 50), ("p90", 90), ("p99", 99))}
            row["mean"] = float(chosen.mean())
            result[f"{tag} {part}"] = row
            print(f"  {tag + ' ' + part:20s} {row['p50']:6.2f} {row['p90']:6.2f} "
                  f"{row['p99']:6.2f} {row['mean']:6.2f}")
        if prepare_ns[tag]:
            cpu = np.asarray(prepare_ns[tag]) / 1e3
            result[f"{tag} prepare_cpu_us"] = {"p50": float(np.percentile(cpu, 50)),
                                               "p99": float(np.percentile(cpu, 99))}
            print(f"  {tag} prepare (I/O thread, CPU): p50 {np.percentile(cpu, 50):.1f} us, "
                  f"p99 {np.percentile(cpu, 99):.1f} us")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
