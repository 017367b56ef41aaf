#!/usr/bin/env python
"""Mutation testing of chosen modules with mutmut: ``python scripts/mutation.py MODULE...``.

For each module (a path such as ``env/traces/trace_format.py``) the tests that guard it are
looked up in ``[tool.specctl-mutation.tests]`` of ``pyproject.toml``. Each module runs in
its own scratch copy of the work tree, ``.mutation/<module>/`` (git-ignored; mutmut keeps
its results there, so a rerun only retests what changed), whose ``pyproject.toml`` gets
the shared ``[tool.mutmut]`` settings narrowed to that module and its tests. The score and
every mutant not killed (with its diff, given ``--diffs``) go to
``.mutation/<module>/summary.md``; the scores of the run to ``.mutation/summary.md``.

Tests in ``tests/test_sglang_inside.py`` need one pinned SGLang on the path (they run
in a subprocess of ``tests/test_sglang_versions.py`` in the normal suite); for mutation
they run in-process against ``.sglang/<SGLANG_VERSION>`` (default 0.5.23).

After adding tests, ``--retest`` runs the mutants that were not killed last time again
(mutmut keeps earlier results, and a mutant it has a result for is not rerun unless named).
``--only PATTERN`` restricts a run to the mutants whose names match (a large module in
little time); the score is then over the mutants run, and marked partial.

Exit status: 0 when every module reaches ``--min-score`` (default 0: report only).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: the project's own packages
WORK = REPO / ".mutation"
INSIDE = "tests/test_sglang_inside.py"


def tests_for(modules: list[str]) -> dict[str, list[str]]:
    """Module -> test files, from pyproject.toml (a clear error for an unknown module)."""
    table = tomllib.loads((REPO / "pyproject.toml").read_text())
    mapping = table.get("tool", {}).get("specctl-mutation", {}).get("tests", {})
    chosen = {}
    for module in modules:
        if not (REPO / module).is_file():
            raise SystemExit(f"mutation: {module}: no such file under {REPO}")
        if module not in mapping:
            raise SystemExit(f"mutation: {module}: no entry in pyproject.toml "
                             "[tool.specctl-mutation.tests]; add the test files that guard it")
        chosen[module] = list(mapping[module])
    return chosen


def toml_value(value: object) -> str:
    """TOML for the str / number / bool / list-of-str values of [tool.mutmut]."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value)  # JSON strings, numbers and lists of them are valid TOML


def scratch_copy(module: str, tests: list[str]) -> Path:
    """The work tree (tracked and untracked, not ignored files) with its mutmut config
    narrowed to ``module``; mutmut's own ``mutants/`` folder there is kept between runs."""
    work = WORK / module.replace("/", "__").removesuffix(".py")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                           check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        source, target = REPO / name, work / name
        if not source.is_file():
            continue  # deleted in the work tree
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists() or target.read_bytes() != source.read_bytes():
            shutil.copy2(source, target)
    pyproject = (REPO / "pyproject.toml").read_text()
    settings = tomllib.loads(pyproject)["tool"]["mutmut"]
    settings["only_mutate"] = [module]
    settings["pytest_add_cli_args_test_selection"] = tests
    section = "\n".join(f"{key} = {toml_value(value)}" for key, value in settings.items())
    # Replace the [tool.mutmut] section (up to the next table header) by the narrowed one.
    pyproject = re.sub(r"^\[tool\.mutmut\]\n(?:(?!\[).*\n)*", f"[tool.mutmut]\n{section}\n\n",
                       pyproject, count=1, flags=re.M)
    (work / "pyproject.toml").write_text(pyproject)
    return work


def environment(tests: list[str], stand_ins: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPECCTL_", "SGLANG_"))}
    env.pop("PYTHONPATH", None)  # mutmut puts its mutated copy first on sys.path itself
    # mutmut forks each mutant from a process that ran the tests; a fork of a process whose
    # OpenMP pool (torch's) is running deadlocks at its next parallel op (a false timeout).
    env["OMP_NUM_THREADS"] = "1"
    # A mutant that stops a background thread makes a test wait for what never comes;
    # with the tests' usual hang guard (60 s) that is a timeout, with 10 s a kill.
    env["SPECCTL_HANG_GUARD_S"] = "10"
    if INSIDE in tests:
        version = os.environ.get("SGLANG_VERSION", "0.5.23")
        root = REPO / ".sglang" / version
        if not (root / "sglang").is_dir():
            raise SystemExit(f"mutation: {INSIDE} needs SGLang {version} in {root} "
                             "(scripts/install_sglang_cpu.sh)")
        env["PYTHONPATH"] = os.pathsep.join([str(root), str(stand_ins)])
        env["SPECCTL_SGLANG_INSIDE"] = version
        env["SPECCTL_CONTROLLER"] = "ipc:///tmp/specctl-never-connected.sock"
    return env


def mutmut(work: Path, env: dict[str, str], *args: str, capture: bool = True) -> str:
    done = subprocess.run([sys.executable, "-m", "mutmut", *args], cwd=work, env=env,
                          text=True, capture_output=capture, check=False)
    if done.returncode != 0:
        detail = (done.stderr or "")[-3000:] if capture else ""
        raise SystemExit(f"mutation: mutmut {' '.join(args)} failed in {work} "
                         f"(exit {done.returncode})\n{detail}")
    return done.stdout or ""


def not_killed(work: Path, env: dict[str, str], statuses: tuple[str, ...] = ()) -> list[str]:
    """Names of the mutants with any result but killed (or only with ``statuses``)."""
    rows = [line.rsplit(":", 1) for line in mutmut(work, env, "results").splitlines()
            if ":" in line]
    return [name.strip() for name, status in rows
            if not statuses or status.strip() in statuses]


def summarize(module: str, work: Path, env: dict[str, str], diffs: bool) -> dict:
    """Killed / total and every other mutant (with its diff if asked: one mutmut
    process per mutant, slow), into ``work/summary.md``."""
    mutmut(work, env, "export-cicd-stats")
    stats = json.loads((work / "mutants" / "mutmut-cicd-stats.json").read_text())
    rows = [line.strip() for line in mutmut(work, env, "results").splitlines() if ":" in line]
    # A run restricted with --only leaves the other mutants unchecked: the score is then
    # over the checked ones, and marked partial.
    unchecked = sum(row.rsplit(":", 1)[1].strip() == "not checked" for row in rows)
    rows = [row for row in rows if row.rsplit(":", 1)[1].strip() != "not checked"]
    survivors = [row.rsplit(":", 1)[0] for row in rows]
    killed, total = stats["killed"], stats["total"] - unchecked
    score = killed / total if total else 1.0
    partial = f" (partial: {unchecked} mutants not run)" if unchecked else ""
    lines = [f"# Mutation score of {module}{partial}", "",
             f"killed {killed} / {total} ({100 * score:.1f} %); " + ", ".join(
                 f"{key} {value}" for key, value in stats.items()
                 if key not in ("killed", "total") and value), "",
             f"## Not killed (`cd {work} && mutmut show NAME` shows one)", ""]
    if diffs:
        lines += [f"```diff\n{mutmut(work, env, 'show', name).strip()}\n```"
                  for name in survivors]
    else:
        lines += [f"* {row}" for row in rows]
    (work / "summary.md").write_text("\n".join(lines) + "\n")
    return {"module": module, "killed": killed, "total": total, "score": score,
            "not_killed": survivors, "stats": stats, "unchecked": unchecked}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="+", help="e.g. env/traces/trace_format.py")
    parser.add_argument("--max-children", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--retest", action="store_true",
                        help="run the mutants not killed last time again (after new tests)")
    parser.add_argument("--retest-timeouts", action="store_true",
                        help="with --retest, also rerun the mutants that timed out")
    parser.add_argument("--diffs", action="store_true",
                        help="write every surviving mutant's diff to the summary (slow)")
    parser.add_argument("--fresh", action="store_true",
                        help="forget earlier results first (after the module's code moved "
                             "between functions, e.g. a merge: mutmut maps new functions "
                             "to tests only for tests it has not seen, so they read 'no "
                             "tests' or survive)")
    parser.add_argument("--only", action="append", default=[], metavar="PATTERN",
                        help="run only the mutants whose name matches (fnmatch, repeatable: "
                             "'env.sim.cost_model.x_design_matrix*'); the score is partial")
    parser.add_argument("--min-score", type=float, default=0.0,
                        help="fail (exit 1) if a module's killed fraction is below this")
    args = parser.parse_args(argv)
    chosen = tests_for(args.modules)
    WORK.mkdir(exist_ok=True)
    stand_ins = WORK / "stand-ins"
    from sglang_hooks.testing import write_import_stand_ins
    write_import_stand_ins(stand_ins)
    results = []
    for module, tests in chosen.items():
        if args.fresh:
            shutil.rmtree(WORK / module.replace("/", "__").removesuffix(".py") / "mutants",
                          ignore_errors=True)
        work = scratch_copy(module, tests)
        env = environment(tests, stand_ins)
        print(f"mutation: {module} against {' '.join(tests)} in {work}", flush=True)
        # Timeouts (a hang: caught) are not rerun; they cost the most.
        statuses = ("survived", "no tests") + (("timeout",) if args.retest_timeouts else ())
        again = (not_killed(work, env, statuses)
                 if args.retest and (work / "mutants").is_dir() else [])
        mutmut(work, env, "run", "--max-children", str(args.max_children), *args.only,
               capture=False)
        again = [name for name in again
                 if not args.only or any(fnmatch.fnmatch(name, p) for p in args.only)]
        if again:
            mutmut(work, env, "run", "--max-children", str(args.max_children), *again,
                   capture=False)
        results.append(summarize(module, work, env, args.diffs))
        r = results[-1]
        print(f"mutation: {module}: killed {r['killed']} / {r['total']} "
              f"({100 * r['score']:.1f} %), not killed: {len(r['not_killed'])} "
              f"(listed in {work / 'summary.md'})", flush=True)
    table = ["| module | killed / total | score | timeout | survived | no tests |",
             "|---|---|---|---|---|---|"]
    table += [f"| `{r['module']}`{' (partial)' if r['unchecked'] else ''} "
              f"| {r['killed']} / {r['total']} | {100 * r['score']:.1f} % "
              f"| {r['stats']['timeout']} | {r['stats']['survived']} "
              f"| {r['stats']['no_tests']} |" for r in results]
    (WORK / "summary.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    return 0 if all(r["score"] >= args.min_score for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
