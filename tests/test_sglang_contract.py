"""Everything the hooks rely on exists in each pinned SGLang's source (parsed, not imported).

SGLang's scheduler and EAGLE worker cannot be imported without a GPU stack, so
the contract (:mod:`sglang_hooks.contract`) is checked with ``ast``: hook
targets and their parameters, every attribute the hooks read, and the call
paths the rank-agreement design depends on (the request list from
``_pull_raw_reqs`` through ``broadcast_pyobj`` into ``process_input_requests``;
``forward_ct`` as the step index; acceptance reaching the policy on the
scheduler thread).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from sglang_hooks.compat import SUPPORTED_VERSIONS
from sglang_hooks.contract import (
    CONTRACTS,
    append_only_problems,
    contract_problems,
    target_problems,
    warmup_problems,
)

REPO = Path(__file__).resolve().parents[1]


def installed(version: str) -> Path:
    root = REPO / ".sglang" / version
    if not (root / "sglang").is_dir():
        pytest.skip(f"SGLang {version} is not installed in {root} "
                    "(run scripts/install_sglang_cpu.sh)")
    return root


def test_every_supported_version_has_a_contract():
    assert set(CONTRACTS) == set(SUPPORTED_VERSIONS)


@pytest.mark.parametrize("version", SUPPORTED_VERSIONS)
def test_pinned_source_satisfies_the_contract(version):
    root = installed(version)
    assert contract_problems(root, version) == []
    assert target_problems(root) == []
    # The recorder reads a step's request lists later, by reference.
    assert append_only_problems(root) == []
    # The start-up warm-up (sglang_hooks.warmup): registry, runner, requests.
    assert warmup_problems(root) == []


@pytest.mark.parametrize(("path", "old", "new", "problem"), [
    ("sglang/srt/entrypoints/warmup.py",
     "await _warmup_registry[warmup_name](disaggregation_mode, tokenizer_manager)",
     "await _warmup_registry[warmup_name](tokenizer_manager)", "execute_warmups: does not"),
    ("sglang/srt/entrypoints/engine.py", "        load_plugins()\n\n        # Not read-only",
     "\n        # Not read-only", "Engine._launch_subprocesses: does not contain"),
])
def test_the_checker_notices_a_broken_warmup_contract(tmp_path, path, old, new, problem):
    root = installed("0.5.23")
    copy = tmp_path / "sglang-copy"
    shutil.copytree(root / "sglang" / "srt" / "entrypoints", copy / "sglang/srt/entrypoints")
    text = (copy / path).read_text()
    assert old in text
    (copy / path).write_text(text.replace(old, new))
    problems = warmup_problems(copy)
    assert any(problem in p for p in problems), problems
    assert all(problem in p or "module source not found" in p for p in problems), problems


@pytest.mark.parametrize(("path", "old", "new", "problem"), [
    ("sglang/srt/managers/scheduler.py", "def process_input_requests(self, recv_reqs",
     "def process_input_requests(self, reqs", "Scheduler.process_input_requests: parameters"),
    ("sglang/srt/managers/scheduler.py", "def process_batch_result(",
     "def process_batch_results(", "Scheduler.process_batch_result: method not found"),
    ("sglang/srt/managers/scheduler.py", "self.forward_ct += 1", "self.forward_ct += 2",
     "Scheduler.run_batch: does not contain ['self.forward_ct += 1']"),
    ("sglang/srt/managers/schedule_batch.py", "forward_iter=self.forward_iter,", "",
     "ScheduleBatch.copy: does not contain"),
    ("sglang/srt/managers/scheduler_components/request_receiver.py", "broadcast_pyobj(",
     "other_broadcast(", "_broadcast_reqs_across_ranks: does not contain"),
])
def test_the_checker_notices_a_broken_contract(tmp_path, path, old, new, problem):
    version = "0.5.23"
    root = installed(version)
    copy = tmp_path / "sglang-copy"
    for module in ("scheduler.py", "schedule_batch.py",
                   "scheduler_components/request_receiver.py"):
        rel = Path("sglang/srt/managers") / module
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / rel, copy / rel)
    text = (copy / path).read_text()
    assert old in text
    (copy / path).write_text(text.replace(old, new))
    problems = contract_problems(copy, version)
    assert any(problem in p for p in problems), problems
    # The modules not copied are reported missing, and nothing else is.
    assert all(problem in p or "module source not found" in p for p in problems), problems


def test_the_checker_notices_a_batch_list_changed_in_place(tmp_path):
    # filter_batch keeping its list object and changing it: the recorder would read other
    # requests than the step's from a list it holds.
    root = installed("0.5.23")
    rel = Path("sglang/srt/managers/schedule_batch.py")
    (tmp_path / rel).parent.mkdir(parents=True)
    text = (root / rel).read_text()
    old = "self.reqs = [self.reqs[i] for i in keep_indices]"
    assert old in text
    (tmp_path / rel).write_text(text)
    assert append_only_problems(tmp_path) == []
    (tmp_path / rel).write_text(text.replace(old, old.replace("self.reqs =", "self.reqs[:] =")))
    [problem] = append_only_problems(tmp_path)
    assert problem.startswith(f"{rel}:") and "self.reqs[:] = " in problem


def test_only_appending_to_a_request_list_in_place_passes(tmp_path):
    # The recorder keeps a step's request lists by reference and reads their first entries
    # later: appending keeps those, every other change in place does not.
    module = tmp_path / "sglang" / "srt" / "managers" / "m.py"
    module.parent.mkdir(parents=True)
    allowed = """
def fine(self, batch, other, keep):
    batch.reqs.append(other.reqs[0])
    self.reqs.extend(other.reqs)
    batch.reqs += other.reqs
    self.reqs = [self.reqs[i] for i in keep]  # a new list: the old one is unchanged
    reqs = list(batch.reqs)
    reqs.sort()
    reqs[0] = None  # a copy
    n = len(batch.reqs)
"""
    changed = {
        "batch.reqs.sort()": "batch.reqs.sort()",
        "reqs = batch.reqs\n    reqs.pop()": "reqs.pop()",
        "del self.reqs[0]": "del self.reqs[0]",
        "self.reqs[1:] = []": "self.reqs[1:] = []",
        "reqs = self.reqs\n    reqs[0] = other": "reqs[0] = other",
        "batch.reqs *= 2": "batch.reqs *= 2",
        "b = make(reqs=chosen)\n    chosen.remove(x)": "chosen.remove(x)",
        "b = ScheduleBatch.init_new(chosen, 1)\n    chosen.insert(0, x)": "chosen.insert(0, x)",
        "self.reqs = chosen\n    chosen.clear()": "chosen.clear()",
        "def inner():\n        batch.reqs.reverse()": "batch.reqs.reverse()",
    }
    module.write_text(allowed)
    assert append_only_problems(tmp_path) == []
    for body, code in changed.items():
        module.write_text(f"{allowed}\n\ndef changes(self, batch, other, chosen, x):\n"
                          f"    {body}\n")
        problems = append_only_problems(tmp_path)
        assert len(problems) == 1 and "m.py:" in problems[0] and code in problems[0], (
            body, problems)
