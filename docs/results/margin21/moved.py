#!/usr/bin/env python
"""Two ``specctl-eval`` results files of one seed (a reference and a candidate, e.g. the
shipped file and the shipped file with ``guard.margin=-0.2``): whether they agree but for
the policy's path, the mean oracle fraction per cell kind, the cells that moved (target
status changed or oracle fraction moved by >= 0.005, as ``drop_warmup/cells.py``) with
the policy's mean TPOT and off share before and after, the scenarios (windows) whose
policy run changed most, and the in-distribution concurrency sweep where it changed.

    python docs/results/margin21/moved.py REFERENCE/results.json CANDIDATE/results.json \\
        [--top N]

Reads ``cells`` (per cell and method: ``mean_tpot_ms``, ``off_share``), ``checks.cells``
(``oracle_fraction``, ``vs_best_baseline``, ``target``, ``met``), ``scenarios`` and
``sweep`` (the ``ppo`` method is the evaluated policy), as ``specctl-eval`` wrote them.
No repository imports: plain ``python`` (the project's venv) runs it.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

MOVED = 0.005
#: Cell kinds by the target's prefix ("report only": the swapped-profile cells).
KINDS = (("held-out", "held-out exact"), ("in-distribution", "in-distribution"),
         ("perturbed", "perturbed"), ("none", "no profile"), ("report only", "swapped"))
POLICY = "ppo"


def num(value: float | None, digits: int = 3) -> str:
    """``value`` to ``digits`` decimals ("-" for None: a window the run served nothing in)."""
    return "-" if value is None else f"{value:.{digits}f}"


def kind(target: str) -> str:
    """The cell kind of a ``checks.cells`` target string."""
    return next(label for prefix, label in KINDS if target.startswith(prefix))


def identical(reference: dict[str, Any], candidate: dict[str, Any]) -> list[str]:
    """Top-level keys (but the policy's path) where the two results differ."""
    keys = sorted((set(reference) | set(candidate)) - {"policy"})
    return [k for k in keys if reference.get(k) != candidate.get(k)]


def kinds_table(before: dict[str, Any], after: dict[str, Any]) -> None:
    """Mean oracle fraction (and the worst cell) per cell kind, before and after."""
    fractions: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for key, old in before.items():
        new = after[key]
        fractions[kind(old["target"])].append((old["oracle_fraction"], new["oracle_fraction"]))
    print("| cell kind | cells | mean oracle fraction before | after | worst before | after |")
    print("|---|---|---|---|---|---|")
    for _, label in KINDS:
        pairs = fractions[label]
        if not pairs:
            continue
        olds, news = [p[0] for p in pairs], [p[1] for p in pairs]
        print(f"| {label} | {len(pairs)} | {sum(olds) / len(olds):.4f} | "
              f"{sum(news) / len(news):.4f} | {min(olds):.3f} | {min(news):.3f} |")


def cells_table(reference: dict[str, Any], candidate: dict[str, Any]) -> None:
    """The cells whose target status changed or whose oracle fraction moved >= MOVED."""
    before, after = reference["checks"]["cells"], candidate["checks"]["cells"]
    changed = sum(reference["cells"][k] != candidate["cells"].get(k) for k in reference["cells"])
    print(f"cells whose results changed at all: {changed} of {len(reference['cells'])}")
    print("| cell | kind | oracle fraction before | after | policy TPOT ms before | after "
          "| off share before | after | no_spec TPOT ms | vs best baseline before | after "
          "| met before | after |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for key in sorted(before):
        old, new = before[key], after[key]
        if old["met"] == new["met"] and abs(new["oracle_fraction"]
                                            - old["oracle_fraction"]) < MOVED:
            continue
        run_old, run_new = reference["cells"][key][POLICY], candidate["cells"][key][POLICY]
        print(f"| {key} | {kind(old['target'])} | {num(old['oracle_fraction'])} | "
              f"{num(new['oracle_fraction'])} | {num(run_old['mean_tpot_ms'])} | "
              f"{num(run_new['mean_tpot_ms'])} | {num(run_old['off_share'])} | "
              f"{num(run_new['off_share'])} | "
              f"{num(reference['cells'][key]['no_spec']['mean_tpot_ms'])} | "
              f"{num(old['vs_best_baseline'])} ({old['best_baseline']}) | "
              f"{num(new['vs_best_baseline'])} ({new['best_baseline']}) | "
              f"{old['met']} | {new['met']} |")


def scenarios_table(reference: dict[str, Any], candidate: dict[str, Any], top: int) -> None:
    """The ``top`` scenarios whose policy oracle fraction moved most (either way)."""
    after = {s["scenario"]: s for s in candidate["scenarios"]}
    moves = []
    for old in reference["scenarios"]:
        new = after.get(old["scenario"])
        if new is None or old["runs"][POLICY] == new["runs"][POLICY]:
            continue
        fraction_old = old["runs"][POLICY]["oracle_fraction"]
        fraction_new = new["runs"][POLICY]["oracle_fraction"]
        if fraction_old is None or fraction_new is None:
            continue  # a window left out as empty
        moves.append((fraction_new - fraction_old, old, new))
    print("scenarios whose policy run changed (windows served by both): "
          f"{len(moves)} of {len(reference['scenarios'])} "
          f"({sum(m[0] < 0 for m in moves)} lower oracle fraction, "
          f"{sum(m[0] > 0 for m in moves)} higher, {sum(m[0] == 0 for m in moves)} equal)")
    if not moves:
        return
    print("| scenario | policy TPOT ms before | after | off share before | after "
          "| oracle fraction before | after | no_spec TPOT ms |")
    print("|---|---|---|---|---|---|---|---|")
    for _, old, new in sorted(moves, key=lambda m: -abs(m[0]))[:top]:
        a, b = old["runs"][POLICY], new["runs"][POLICY]
        print(f"| {old['scenario']} | {num(a['mean_tpot_ms'])} | {num(b['mean_tpot_ms'])} | "
              f"{num(a['off_share'])} | {num(b['off_share'])} | {num(a['oracle_fraction'], 4)} | "
              f"{num(b['oracle_fraction'], 4)} | {num(old['runs']['no_spec']['mean_tpot_ms'])} |")


def off_share(run: dict[str, Any]) -> float:
    """The share of a sweep run's steps at depth 0."""
    steps = run["steps_chosen"]
    return steps[0] / max(sum(steps), 1)


def sweep_table(reference: dict[str, Any], candidate: dict[str, Any]) -> None:
    """The in-distribution sweep's policy runs per concurrency, where they changed."""
    old, new = reference["sweep"][POLICY], candidate["sweep"][POLICY]
    key = next(k for k in reference["checks"] if k.startswith("sweep_"))
    ratio_old = reference["checks"][key]["ratio_by_concurrency"]
    ratio_new = candidate["checks"][key]["ratio_by_concurrency"]
    rows = [c for c in old if old[c] != new.get(c)]
    print(f"sweep concurrencies whose policy run changed: {rows or 'none'}")
    if not rows:
        return
    print("| concurrency | throughput tok/s before | after | TPOT ms before | after "
          "| off share before | after | vs max(no_spec, eagle3) before | after |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c in rows:
        print(f"| {c} | {num(old[c]['throughput_tok_s'], 1)} | "
              f"{num(new[c]['throughput_tok_s'], 1)} | "
              f"{num(old[c]['mean_tpot_ms'])} | {num(new[c]['mean_tpot_ms'])} | "
              f"{off_share(old[c]):.3f} | {off_share(new[c]):.3f} | "
              f"{ratio_old.get(c, float('nan')):.4f} | {ratio_new.get(c, float('nan')):.4f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reference")
    parser.add_argument("candidate")
    parser.add_argument("--top", type=int, default=10, help="scenarios listed (default 10)")
    args = parser.parse_args()
    reference, candidate = (json.loads(Path(p).read_text())
                            for p in (args.reference, args.candidate))
    differing = identical(reference, candidate)
    print(f"{args.candidate}: " + ("identical to the reference but for the policy's path"
                                   if not differing else f"differs in {differing}"))
    print()
    kinds_table(reference["checks"]["cells"], candidate["checks"]["cells"])
    print()
    cells_table(reference, candidate)
    print()
    scenarios_table(reference, candidate, args.top)
    print()
    sweep_table(reference, candidate)


if __name__ == "__main__":
    main()
