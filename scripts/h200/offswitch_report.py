"""Summarise the off-switch runs (``offswitch.py``'s results) into ``offswitch.json`` and tables.

    python scripts/h200/offswitch_report.py [docs/results/h200/offswitch]

Writes ``<folder>/../offswitch.json`` in the issue's format (rows: TPOT and throughput of
the off path against the server without speculation per model and concurrency; headline:
the replayed workload per model@acceptance and policy) and prints Markdown tables: per-C
TPOT, the greedy-output comparison, the replay, and the cost of a switch read from the
recorded traces (each step classified by the explore rule that drove it).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np

from env.traces.trace_format import read_packed_trace

#: (model name, no-speculation result, off result, run) per measured pair, in run order.
#: Runs 1-2 (dense) and 1 (MoE): the off switch at commit 81e6690; run 3: at 4cc857b (the
#: verify graph no longer planned on off steps; followers, dwell, lean hooks and the rest
#: of that day's plugin work included), three one-batch sweeps per C. Run 4: the MoE on the
#: same code as run 3 (2026-12-01, second session), three sweeps per C. Run 5: the MoE
#: with a prefill while off skipping the draft's extend (``SPECCTL_OFF_PREFILL=skip``,
#: 2026-12-01, third session), three sweeps per C.
PAIRS = (
    ("llama31_8b", "dense_nospec_run1.json", "dense_off_run1.json", 1),
    ("llama31_8b", "dense_nospec_run2.json", "dense_off_run2.json", 2),
    ("llama31_8b", "dense_nospec_run3.json", "dense_off_run3.json", 3),
    ("qwen3_30b_a3b", "moe_nospec.json", "moe_off.json", 1),
    ("qwen3_30b_a3b", "moe_nospec_run4.json", "moe_off_run4.json", 4),
    ("qwen3_30b_a3b", "moe_nospec_run5.json", "moe_off_run5.json", 5),
)
#: (key, no-speculation result, replay result with the plugin) per headline: the newest
#: run of each cell (code at 4cc857b, the retrained default policy). SGLang's simulated
#: acceptance writes token id 100 for every generated token unless
#: ``SGLANG_SIMULATE_ACC_TOKEN_MODE=real-draft-token``; on the MoE that routes every
#: request to the same experts and makes steps cheap, so only the real-token run compares
#: with the no-speculation server (``docs/OFFSWITCH.md``).
HEADLINES = (
    # Run 5 (the newest: the keys without a run): the policy shipped now (sha256
    # fb769766...), a prefill while off skipping the draft's extend, real tokens on the MoE
    # (SGLANG_SIMULATE_ACC_TOKEN_MODE=real-draft-token), against the no-speculation server
    # of the same lease (the dense one: run 1's, the dense model had no lease this time).
    ("qwen3_30b_a3b@2.5", "moe_nospec_run5.json", "moe_acc2.5_replay_run5.json"),
    ("qwen3_30b_a3b@1.1", "moe_nospec_run5.json", "moe_acc1.1_replay_run5.json"),
    ("llama31_8b@3.5", "dense_nospec_run1.json", "dense_acc3.5_replay_run5.json"),
    # The off path alone (constant policy 0, no simulated acceptance: real tokens).
    ("qwen3_30b_a3b, off path", "moe_nospec_run5.json", "moe_off_run5.json"),
    # Run 4: the same policy, EAGLE's prefill work still run while off.
    ("qwen3_30b_a3b@2.5 (run 4)", "moe_nospec_run4.json", "moe_acc2.5_replay_run4.json"),
    ("qwen3_30b_a3b@1.1 (run 4)", "moe_nospec_run4.json", "moe_acc1.1_replay_run4.json"),
    ("llama31_8b@3.5 (run 4)", "dense_nospec_run1.json", "dense_acc3.5_replay_run4.json"),
    ("qwen3_30b_a3b, off path (run 4)", "moe_nospec_run4.json", "moe_off_run4.json"),
    # Runs 2-3: the policy before (code at 4cc857b).
    ("llama31_8b@3.5 (run 2)", "dense_nospec_run1.json", "dense_acc3.5_replay_run2.json"),
    ("qwen3_30b_a3b@1.1 (run 3, real tokens)", "moe_nospec_run2.json",
     "moe_acc1.1_replay_realtokens.json"),
    ("qwen3_30b_a3b@1.1 (run 2, token 100)", "moe_nospec_run2.json",
     "moe_acc1.1_replay_run2.json"),
    ("qwen3_30b_a3b@2.5 (run 2, token 100)", "moe_nospec_run2.json", "moe_acc2.5_replay.json"),
)
#: The same cells from the first session (code at 81e6690, the policy trained before it).
FIRST_HEADLINES = (
    ("llama31_8b@3.5", "dense_nospec_run1.json", "dense_acc3.5_replay.json"),
    ("qwen3_30b_a3b@1.1 (token 100)", "moe_nospec.json", "moe_acc1.1_replay.json"),
)
TRACES = (("llama31_8b", "dense_off_trace.tar.gz"),
          ("llama31_8b run 3", "dense_off_trace_run3.tar.gz"),
          ("qwen3_30b_a3b", "moe_off_trace.tar.gz"),
          ("qwen3_30b_a3b run 4", "moe_off_trace_run4.tar.gz"),
          ("qwen3_30b_a3b run 5", "moe_off_trace_run5.tar.gz"))
CANDIDATES = [0, 1, 3, 5]  # offswitch.py's adaptive config; explored with dwell 1


def load(folder: Path, name: str) -> dict:
    return json.loads((folder / name).read_text())


def summary(run: dict) -> dict:
    return {k: run[k] for k in ("throughput_tok_s", "mean_tpot_ms", "mean_ttft_ms", "failed")}


def repeats(sweep: dict) -> dict[int, list[dict]]:
    """Per concurrency, every one-batch result of a sweep (``"C"`` and repeats ``"C#k"``)."""
    out: dict[int, list[dict]] = {}
    for key, result in sweep.items():
        out.setdefault(int(key.split("#")[0]), []).append(result)
    return out


def median_of(results: list[dict], field: str) -> float:
    return float(np.median([r[field] for r in results]))


def tpot_rows(folder: Path) -> list[dict]:
    """Per model, run and C: TPOT and throughput, the median over the run's repeats."""
    rows = []
    for model, nospec_name, off_name, run in PAIRS:
        nospec = repeats(load(folder, nospec_name)["sweep"])
        off = repeats(load(folder, off_name)["sweep_off"])
        for c in sorted(nospec):
            rows.append({"model": model, "run": run, "concurrency": c,
                         "repeats": len(off[c]),
                         "nospec_tpot_ms": median_of(nospec[c], "mean_tpot_ms"),
                         "off_tpot_ms": median_of(off[c], "mean_tpot_ms"),
                         "nospec_tok_s": median_of(nospec[c], "throughput_tok_s"),
                         "off_tok_s": median_of(off[c], "throughput_tok_s")})
    return rows


def headlines(folder: Path, cells=HEADLINES) -> dict:
    out = {}
    for key, nospec_name, replay_name in cells:
        replay = load(folder, replay_name)
        cell = {"no_speculation": summary(load(folder, nospec_name)["headline"])}
        for name, run in replay.items():
            if name.startswith("headline_"):
                policy = name.removeprefix("headline_")
                cell["off (static_0)" if policy == "static_0" else policy] = summary(run)
        out[key] = cell
    return out


def greedy(folder: Path) -> list[tuple[str, str, int, int]]:
    """(model and run, configuration, prompts identical to no speculation, prompts)."""
    out = []
    for model, nospec_name, off_name, run in PAIRS:
        reference = [g["output_ids"] for g in load(folder, nospec_name)["greedy"]]
        off = load(folder, off_name)
        for name in ("greedy_static_0", "greedy_static_3", "greedy_switching"):
            got = [g["output_ids"] for g in off[name]]
            same = sum(a == b for a, b in zip(reference, got, strict=True))
            out.append((f"{model} run {run}", name.removeprefix("greedy_"), same, len(got)))
    return out


def explored_depth(step: int) -> int:
    """The depth ``SPECCTL_FALLBACK=explore`` with dwell 1 asks for at ``step``."""
    cycle, position = divmod(step, len(CANDIDATES))
    return random.Random(cycle).sample(CANDIDATES, len(CANDIDATES))[position]


def switch_costs(folder: Path, batch_sizes=(1, 32)) -> dict:
    """Median step latency per kind of decode step while exploring with dwell 1.

    Kinds: ``off`` (asked 0: the plain decode), ``warm-up`` (asked > 0 right after an
    off step: SGLang's steps=0, recorded as 0), ``d<k>``; and ``off, static`` for the
    off steps of the constant steps-0 policy earlier in the same run. The explored part
    is the longest suffix of the trace whose decode steps all match the explore rule.
    """
    out = {}
    for model, name in TRACES:
        steps = read_packed_trace(folder / name).steps
        decode = [s for s in steps if s.prefill_tokens == 0]
        kinds, previous = [], None
        for s in decode:
            want = explored_depth(s.step_index)
            if want == 0:
                kind = "off" if s.steps_used == 0 else None
            elif previous == 0:
                kind = "warm-up" if s.steps_used == 0 else None
            else:
                kind = f"d{want}" if s.steps_used == want else None
            kinds.append(kind)
            previous = want
        start = len(kinds)
        while start > 0 and kinds[start - 1] is not None:
            start -= 1
        cells: dict = {}
        for b in batch_sizes:
            row = {}
            for kind in ("off", "warm-up", "d1", "d3", "d5"):
                lat = [s.step_latency_s for s, k in zip(decode[start:], kinds[start:], strict=True)
                       if k == kind and s.batch_size == b]
                if lat:
                    row[kind] = (1e3 * float(np.median(lat)), len(lat))
            static = [s.step_latency_s for s in decode[:start]
                      if s.steps_used == 0 and s.batch_size == b]
            if static:
                row["off, static"] = (1e3 * float(np.median(static)), len(static))
            cells[b] = row
        out[model] = cells
    return out


def main(folder: Path) -> None:
    rows = tpot_rows(folder)
    report = {"rows": rows, "headline": headlines(folder),
              "headline_first_session": headlines(folder, FIRST_HEADLINES)}
    (folder.parent / "offswitch.json").write_text(json.dumps(report, indent=1) + "\n")
    print("| model | run | C | repeats | no speculation TPOT ms | off TPOT ms | off / no spec |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = r["off_tpot_ms"] / r["nospec_tpot_ms"]
        print(f"| {r['model']} | {r['run']} | {r['concurrency']} | {r['repeats']} | "
              f"{r['nospec_tpot_ms']:.2f} | {r['off_tpot_ms']:.2f} | {ratio:.3f} |")
    print("\n| model@acceptance | policy | tok/s | mean TPOT ms | mean TTFT ms | failed |")
    print("|---|---|---|---|---|---|")
    for key, cell in [*report["headline"].items(),
                      *((f"{k} (first session)", c)
                        for k, c in report["headline_first_session"].items())]:
        for policy, s in cell.items():
            print(f"| {key} | {policy} | {s['throughput_tok_s']:,.0f} | {s['mean_tpot_ms']:.1f} | "
                  f"{s['mean_ttft_ms']:,.0f} | {s['failed']} |")
    print("\n| server | configuration | greedy outputs identical to no speculation |")
    print("|---|---|---|")
    for server, name, same, total in greedy(folder):
        print(f"| {server} | {name} | {same}/{total} |")
    print("\n| model | batch | " + " | ".join(("off", "warm-up", "d1", "d3", "d5", "off, static"))
          + " |")
    print("|---|---|---|---|---|---|---|---|")
    for model, cells in switch_costs(folder).items():
        for b, row in cells.items():
            values = [f"{row[k][0]:.2f} ({row[k][1]})" if k in row else "-"
                      for k in ("off", "warm-up", "d1", "d3", "d5", "off, static")]
            print(f"| {model} | {b} | " + " | ".join(values) + " |")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/results/h200/offswitch"))
