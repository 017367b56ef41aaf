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
from sglang_hooks.contract import CONTRACTS, contract_problems, target_problems

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
