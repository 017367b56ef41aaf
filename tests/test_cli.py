"""User mistakes end in one line on stderr and exit status 2, in every console script."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from agents import checks
from agents.cli import USAGE_EXIT, UsageError, reported
from env.sim.cost_model import load_profile

REPO = Path(__file__).resolve().parents[1]


def run_command(module: str, *args: str, tmp_path: Path, debug: bool = False
                ) -> subprocess.CompletedProcess:
    """The command as a user runs it, in its own process."""
    env = {k: v for k, v in os.environ.items() if k not in ("SPECCTL_DEBUG", "HYDRA_FULL_ERROR")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    if debug:
        env["SPECCTL_DEBUG"] = "1"
    return subprocess.run([sys.executable, "-m", module, *args, f"hydra.run.dir={tmp_path}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def invoke(module: str, *args: str, tmp_path: Path, capsys, monkeypatch
           ) -> subprocess.CompletedProcess:
    """The command's entry point called in this process (the same code path as
    :func:`run_command`, without a new interpreter importing torch for each case)."""
    main = importlib.import_module(module).main
    monkeypatch.delenv("SPECCTL_DEBUG", raising=False)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    # Hydra's logging set-up would disable every logger already created (other tests').
    monkeypatch.setattr(sys, "argv", [module, *args, f"hydra.run.dir={tmp_path}",
                                      "hydra/job_logging=none", "hydra/hydra_logging=none"])
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, captured.out, captured.err)


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
def test_bench_mistakes_are_one_line(tmp_path, capsys, monkeypatch, args, starts, says):
    result = invoke("agents.bench", *args, "plot=false", tmp_path=tmp_path, capsys=capsys,
                    monkeypatch=monkeypatch)
    assert_one_line(result, "specctl-bench", starts)
    assert says in result.stderr


@pytest.mark.parametrize(("args", "starts", "says"), [
    (["profile=nosuch"], "profile=nosuch: ", "blackwell_tp8"),
    (["eval.policies=[no_spec,nosuch]"], "eval.policies=[no_spec,nosuch]: ", "goodput_greedy"),
    (["workload.path=/nonexistent"], "workload.path=/nonexistent: ", "no such file"),
    (["eval.sweep_concurrency=[0]"], "eval.sweep_concurrency=[0]: ", ">= 1"),
    (["policy=/nonexistent.npz"], "policy=/nonexistent.npz: ", "no such file"),
    (["workload.path=README.md"], "workload.path=README.md: ", "unrecognised workload format"),
])
def test_eval_mistakes_are_one_line(tmp_path, capsys, monkeypatch, args, starts, says):
    result = invoke("agents.evaluate", *args, tmp_path=tmp_path, capsys=capsys,
                    monkeypatch=monkeypatch)
    assert_one_line(result, "specctl-eval", starts)
    assert says in result.stderr


@pytest.mark.parametrize(("args", "starts"), [
    (["profile=nosuch"], "profile=nosuch: "),
    (["workload.path=/nonexistent"], "workload.path=/nonexistent: "),
    (["agent.pretrain.teacher=nosuch"], "agent.pretrain.teacher=nosuch: "),
    (["+agent.pretrain.teacher_options.nosuch=1"], "agent.pretrain.teacher_options={nosuch:1}: "),
    (["agent.pretrain.teacher=goodput_greedy",
      "+agent.pretrain.teacher_options.accept_prior_strength=1"],
     "agent.pretrain.teacher_options={accept_prior_strength:1}: "),
    (["env.low_acceptance.share=2"], "env.low_acceptance={share:2,"),
    (["agent.pretrain.disagreement_weight=0.5"], "agent.pretrain.disagreement_weight=0.5: "),
    (["agent.pretrain.start_weight=0"], "agent.pretrain.start_weight=0: "),
    (["agent.pretrain.start_decisions=-1"], "agent.pretrain.start_decisions=-1: "),
    (["agent.pretrain.initial_label_modes=[exakt]"],
     "agent.pretrain.initial_label_modes=[exakt]: "),
    (["agent.pretrain.initial_label_modes=[exact]"],
     "agent.pretrain.initial_label_modes=[exact] needs agent.init_policy"),
    (["agent.pretrain.initial_label_decisions=-1"], "agent.pretrain.initial_label_decisions=-1: "),
    (["agent.pretrain.initial_label_decisions=8"],
     "agent.pretrain.initial_label_decisions=8 needs agent.init_policy"),
    (["agent.pretrain.blend=0"], "agent.pretrain.blend=0: "),
    (["agent.pretrain.blend=0.5"], "agent.pretrain.blend=0.5 needs agent.init_policy"),
])
def test_train_mistakes_are_one_line(tmp_path, capsys, monkeypatch, args, starts):
    result = invoke("agents.train", *args, tmp_path=tmp_path, capsys=capsys,
                    monkeypatch=monkeypatch)
    assert_one_line(result, "specctl-train", starts)


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


def test_a_mistake_is_one_line_in_a_real_process(tmp_path):
    result = run_command("agents.bench", "profile=nosuch", tmp_path=tmp_path)
    assert_one_line(result, "specctl-bench", "profile=nosuch: ")


def test_a_worker_process_mistake_is_one_line(capsys):
    with (pytest.raises(SystemExit) as exit_, reported("specctl-x"),
          ProcessPoolExecutor(max_workers=1) as pool):
        pool.submit(_fail_in_worker, "nosuch").result()
    assert exit_.value.code == USAGE_EXIT
    err = capsys.readouterr().err
    assert err.startswith("specctl-x: error: unknown profile 'nosuch'") and err.count("\n") == 1


def test_a_bug_keeps_its_traceback():
    with pytest.raises(ZeroDivisionError, match="division by zero"), reported("specctl-x"):
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


@pytest.mark.parametrize(("module", "prog"), [
    ("agents.bench", "specctl-bench"), ("agents.evaluate", "specctl-eval"),
    ("agents.train", "specctl-train"), ("controller.cli", "specctl-serve"),
])
def test_help_is_the_commands_own(tmp_path, capsys, monkeypatch, module, prog):
    from env.sim.cost_model import shipped_profiles

    result = invoke(module, "--help", tmp_path=tmp_path, capsys=capsys, monkeypatch=monkeypatch)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert text.startswith(f"{prog}: ")
    assert "powered by Hydra" not in text and "== Configuration groups ==" not in text
    for name in shipped_profiles():
        assert name in text
    if prog != "specctl-serve":
        assert "goodput_greedy" in text and "azure_conv" in text


@pytest.mark.parametrize("config", ["serve", "eval"])
def test_every_probe_and_guard_field_can_be_overridden(config):
    """``specctl-serve`` and ``specctl-eval`` take ``probe.<field>=`` and ``guard.<field>=``
    for every field of the policy file's rules (Hydra refuses a key the config lacks)."""
    import dataclasses

    from omegaconf import OmegaConf

    from env.guard import GuardSpec
    from env.probe import ProbeSpec

    cfg = OmegaConf.load(Path(__file__).parents[1] / "configs" / f"{config}.yaml")
    for block, spec in (("probe", ProbeSpec), ("guard", GuardSpec)):
        fields = {f.name for f in dataclasses.fields(spec)}
        assert set(cfg[block]) == fields, (block, fields ^ set(cfg[block]))
