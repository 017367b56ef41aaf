"""User mistakes end in one line on stderr and exit status 2, in every console script."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from agents import checks
from agents.cli import USAGE_EXIT, UsageError, reported
from env.cost_model import load_profile

REPO = Path(__file__).resolve().parents[1]


def run_command(module: str, *args: str, tmp_path: Path, debug: bool = False
                ) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("SPECCTL_DEBUG", "HYDRA_FULL_ERROR")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    if debug:
        env["SPECCTL_DEBUG"] = "1"
    return subprocess.run([sys.executable, "-m", module, *args, f"hydra.run.dir={tmp_path}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def assert_one_line(result: subprocess.CompletedProcess, prog: str, starts: str) -> None:
    assert result.returncode == USAGE_EXIT, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"{prog}: error: {starts}"), lines[0]


@pytest.mark.parametrize(("args", "starts", "says"), [
    (["profile=nosuch"], "profile=nosuch: ", "blackwell_tp8"),
    (["policies=[nosuch]"], "policies=[nosuch]: ", "goodput_greedy"),
    (["workload.path=/nonexistent"], "workload.path=/nonexistent: ", "no such file"),
    (["concurrency=[0]"], "concurrency=[0]: ", ">= 1"),
    (["policies=[ppo]", "policy_path=/nonexistent.npz"], "policy_path=/nonexistent.npz: ",
     "no such file"),
    (["workload.path=README.md"], "workload.path=README.md: ", "unrecognised workload format"),
])
def test_bench_mistakes_are_one_line(tmp_path, args, starts, says):
    result = run_command("agents.bench", *args, "plot=false", tmp_path=tmp_path)
    assert_one_line(result, "specctl-bench", starts)
    assert says in result.stderr


def test_a_hydra_config_mistake_exits_2(tmp_path):
    result = run_command("agents.bench", "workload=nosuch", tmp_path=tmp_path)
    assert result.returncode == USAGE_EXIT
    assert "Could not find 'workload/nosuch'" in result.stderr


def test_the_debug_switch_shows_the_traceback(tmp_path):
    result = run_command("agents.bench", "profile=nosuch", tmp_path=tmp_path, debug=True)
    assert result.returncode != 0
    assert "Traceback" in result.stderr and "ProfileError" in result.stderr


def _fail_in_worker(name: str) -> None:
    load_profile(name)


def test_a_worker_process_mistake_is_one_line(capsys):
    with (pytest.raises(SystemExit) as exit_, reported("specctl-x"),
          ProcessPoolExecutor(max_workers=1) as pool):
        pool.submit(_fail_in_worker, "nosuch").result()
    assert exit_.value.code == USAGE_EXIT
    err = capsys.readouterr().err
    assert err.startswith("specctl-x: error: unknown profile 'nosuch'") and err.count("\n") == 1


def test_a_bug_keeps_its_traceback():
    with pytest.raises(ZeroDivisionError), reported("specctl-x"):
        _ = 1 / 0


def test_checks_name_the_key_and_the_valid_values(tmp_path):
    with pytest.raises(UsageError, match=r"^profile=nosuch: unknown profile .*h200_llama31_8b"):
        checks.profile("profile", "nosuch")
    with pytest.raises(UsageError, match=r"^sweep_concurrency=\[1,-4\]: .*got -4"):
        checks.concurrency("sweep_concurrency", [1, -4])
    with pytest.raises(UsageError, match=r"^policy=.*bad\.npz: .*not a readable \.npz"):
        (tmp_path / "bad.npz").write_text("not a policy")
        checks.policy_file("policy", str(tmp_path / "bad.npz"))
    profile = checks.profile("profile", "h200_llama31_8b")
    with pytest.raises(UsageError, match=r"^policies=\[no_spec,static_x\]: .*static_<depth>"):
        checks.policies("policies", ["no_spec", "static_x"], profile=profile, max_depth=7)
    checks.policies("policies", ["no_spec", "static_3", "oracle"], profile=profile, max_depth=7)
