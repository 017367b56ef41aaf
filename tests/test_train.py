"""Training learns, the kick-start imitates its teacher, and the CLIs run end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from stable_baselines3 import PPO

from agents import pretrain
from agents.export import export_ppo, load_exported
from agents.pretrain import Demonstrations, collect, dagger, kickstart, merge
from agents.train import EXPORT_TIE_TOLERANCE, export_mismatches, load_initial_policy
from controller.policy_file import ExportedPolicy
from env.features import FeatureSpec
from env.spec_env import SpecDecodeEnv

# One server, one closed-loop load: the best depth is clear (3 to 5), random is poor.
TINY_ENV = {
    "horizon_s": 2.0,
    "profiles": ["h200_llama31_8b"],
    "workloads": [{"name": "fixed", "kind": "closed", "concurrency": [16]}],
}


def _mean_return(env: SpecDecodeEnv, act, episodes: int = 3) -> float:
    total = 0.0
    for seed in range(episodes):
        obs, _ = env.reset(seed=1000 + seed)
        done = False
        while not done:
            obs, reward, terminated, truncated, _ = env.step(act(obs))
            total += reward
            done = terminated or truncated
    return total / episodes


# Speculation is expensive on this server: every depth loses, only off pays.
COSTLY_ENV = {**TINY_ENV, "horizon_s": 4.0, "profiles": ["blackwell_tp8"]}


@pytest.mark.parametrize("config", [TINY_ENV, COSTLY_ENV], ids=["pays", "costly"])
def test_ppo_from_scratch_nears_the_best_fixed_depth(config, tmp_path, monkeypatch):
    """Within a quarter of the way from random play to the best fixed depth (depth 3 on
    the first server, off on the second): a policy that never speculates fails on the
    first, one that always does on the second, and random play on both."""
    torch.set_num_threads(1)
    # SB3's logger makes a folder for every learn(), in /tmp unless told where.
    monkeypatch.setenv("SB3_LOGDIR", str(tmp_path))
    env = SpecDecodeEnv(config)
    # 1e-3: with the 48-entry observation (feature spec 2) 3e-4 no longer learns to
    # turn speculation off within this small budget.
    model = PPO("MlpPolicy", env, seed=0, device="cpu", n_steps=256, batch_size=64,
                learning_rate=1e-3, gamma=0.9, policy_kwargs={"net_arch": [32, 32]})
    rng = np.random.default_rng(0)
    random_return = _mean_return(SpecDecodeEnv(config), lambda obs: int(rng.integers(0, 8)))
    fixed = [_mean_return(SpecDecodeEnv(config), lambda obs, d=d: d) for d in range(8)]
    best = max(fixed)
    # The return is (H/tau)(throughput/no-spec throughput - 1): no speculation scores 0.
    assert fixed[0] == pytest.approx(0.0, abs=1e-9)
    assert best - random_return > 3.0  # the gap is wide enough to tell learning apart
    assert (best == fixed[0]) == (config is COSTLY_ENV)
    # With the plugin's re-entry warm-up simulated (SchedulerConfig.reentry_warmup, off by
    # default) 6000 steps reached the bar at 1 of PPO seeds 0-2 on the first server, 12000
    # at 2 of 3 (docs/results/warm17/README.md): re-entering is learned more slowly.
    model.learn(total_timesteps=6000)
    trained_return = _mean_return(SpecDecodeEnv(config),
                                  lambda obs: int(model.predict(obs, deterministic=True)[0]))
    assert trained_return > best - 0.25 * (best - random_return)


def test_dagger_kickstart_imitates_the_teacher():
    torch.set_num_threads(1)
    env = SpecDecodeEnv(TINY_ENV)
    model = PPO("MlpPolicy", env, seed=0, device="cpu", policy_kwargs={"net_arch": [32, 32]})
    stats = dagger(model, TINY_ENV, "goodput_greedy", steps=3000, rounds=2, gamma=0.99,
                   seed=0, epochs=10)
    assert stats["agreement"] > 0.9
    student = _mean_return(SpecDecodeEnv(TINY_ENV),
                           lambda obs: int(model.predict(obs, deterministic=True)[0]))
    assert student > 0.9 * _mean_return(SpecDecodeEnv(TINY_ENV), lambda obs: 3)


def test_kickstart_teacher_is_built_with_its_options():
    # The options reach the teacher's constructor: a wrong one fails there, by name.
    with pytest.raises(ValueError, match=r"bad options.*nosuch"):
        collect(TINY_ENV, "goodput_explore", 10, 0.99, 0, teacher_options={"nosuch": 1})
    demos = collect(TINY_ENV, "goodput_explore", 50, 0.99, 0,
                    teacher_options={"accept_prior_strength": 1.0})
    assert len(demos.actions) == 50


def _one_state_labelled_twice(**fields):
    """A kick-start's choice for one state labelled 1 (100 times) and 2 (60 times), the
    demonstrations' other ``fields`` saying which labels count more."""
    torch.set_num_threads(1)
    env = SpecDecodeEnv(TINY_ENV)
    obs = np.zeros((160, env.observation_space.shape[0]), np.float32)
    demos = Demonstrations(obs, np.array([1] * 100 + [2] * 60), np.zeros(160, np.float32),
                           **fields)

    def choice(**weights) -> int:
        model = PPO("MlpPolicy", env, seed=0, device="cpu", policy_kwargs={"net_arch": [8]})
        kickstart(model, demos, epochs=30, seed=0, **weights)
        return int(model.predict(obs[0], deterministic=True)[0])

    return choice


def test_disagreement_weight_makes_the_students_mistakes_count_more():
    # the 60 labels of 2 where the student disagreed
    chosen = _one_state_labelled_twice(disagree=np.array([False] * 100 + [True] * 60))

    def choice(weight: float) -> int:
        return chosen(disagreement_weight=weight)

    assert choice(1.0) == 1
    assert choice(3.0) == 2
    with pytest.raises(ValueError, match="disagreement_weight"):
        choice(0.5)


def test_start_weight_makes_an_episodes_first_decisions_count_more():
    # 1 late in episodes, 2 in their first six decisions (10 at each place)
    chosen = _one_state_labelled_twice(positions=np.array([50] * 100 + list(range(6)) * 10))

    def choice(weight: float, first: int = 3) -> int:
        return chosen(start_weight=weight, start_decisions=first)

    assert choice(1.0) == 1
    assert choice(3.0) == 2
    assert choice(3.0, first=1) == 1  # 10 of the 60 weighed (80 against 100): outweighed
    with pytest.raises(ValueError, match="start_weight"):
        choice(0.5)
    with pytest.raises(ValueError, match="start_decisions"):
        choice(2.0, first=-1)


def test_collect_counts_each_decisions_place_in_its_episode():
    demos = collect(TINY_ENV, "goodput_greedy", 400, 0.99, 0)
    positions = demos.positions
    assert positions[0] == 0
    # Consecutive within an episode, back to 0 after each end.
    starts = np.flatnonzero(positions == 0)
    assert len(starts) >= 2, "TINY_ENV episodes should end within 400 decisions"
    steps = np.diff(positions)
    assert np.all((steps == 1) | (positions[1:] == 0))
    assert merge(demos, demos).positions.tolist() == positions.tolist() * 2


def test_collect_marks_where_the_student_chose_otherwise():
    torch.set_num_threads(1)
    teacher_run = collect(TINY_ENV, "goodput_greedy", 60, 0.99, 0)
    assert not teacher_run.disagree.any()  # the teacher acted: nothing to disagree with
    env = SpecDecodeEnv(TINY_ENV)
    model = PPO("MlpPolicy", env, seed=0, device="cpu", policy_kwargs={"net_arch": [8]})
    student_run = collect(TINY_ENV, "goodput_greedy", 60, 0.99, 0, student=model)
    chosen = np.asarray([model.predict(o, deterministic=True)[0] for o in
                         student_run.observations])
    assert student_run.disagree.any()  # an untrained student: some of its choices differ
    assert (student_run.disagree == (chosen != student_run.actions)).all()
    both = merge(teacher_run, student_run)
    assert len(both.disagree) == 120 and (both.disagree[60:] == student_run.disagree).all()


def test_anchor_weight_makes_the_initial_policys_right_choices_count_more():
    # the 60 labels of 2 where the warm start's initial policy already chose 2
    chosen = _one_state_labelled_twice(anchored=np.array([False] * 100 + [True] * 60))

    def choice(weight: float) -> int:
        return chosen(anchor_weight=weight)

    assert choice(1.0) == 1
    assert choice(3.0) == 2
    with pytest.raises(ValueError, match="anchor_weight"):
        choice(0.5)


def _model(seed: int, net_arch=(16, 16)) -> PPO:
    return PPO("MlpPolicy", SpecDecodeEnv(TINY_ENV), seed=seed, device="cpu",
               policy_kwargs={"net_arch": list(net_arch)})


def test_an_exported_policy_loads_back_into_a_model():
    torch.set_num_threads(1)
    spec = FeatureSpec()
    first = export_ppo(_model(0), spec)
    second = _model(1)
    observations = collect(TINY_ENV, "goodput_greedy", 200, 0.99, 0).observations
    assert (export_ppo(second, spec).act(observations) != first.act(observations)).any()
    load_exported(second, first, source="first.npz")
    copied = export_ppo(second, spec)
    for mine, theirs in zip(copied.weights + copied.biases, first.weights + first.biases,
                            strict=True):
        assert np.array_equal(mine, theirs)
    assert (second.predict(observations, deterministic=True)[0]
            == first.act(observations)).all()
    with pytest.raises(ValueError, match=r"first\.npz.*agent\.net_arch"):
        load_exported(_model(0, net_arch=(8, 8)), first, source="first.npz")


def test_a_warm_start_keeps_the_initial_policy_and_lets_it_act_from_the_first_round(
        monkeypatch, tmp_path):
    torch.set_num_threads(1)
    initial = export_ppo(_model(0), FeatureSpec())
    path = tmp_path / "initial.npz"
    initial.save(path)
    model = _model(1)
    assert load_initial_policy(model, path, FeatureSpec()).weights[0].shape == (48, 16)
    actors = []
    real_collect = pretrain.collect

    def spy(*args, student=None, **kwargs):
        actors.append(student)
        return real_collect(*args, student=student, **kwargs)

    monkeypatch.setattr(pretrain, "collect", spy)
    # No epochs: the rounds only collect, so the weights must stay the initial policy's.
    dagger(model, TINY_ENV, "goodput_greedy", steps=100, rounds=2, gamma=0.99, seed=0,
           epochs=0, initial=initial, anchor_weight=2.0)
    assert actors == [model, model]  # student-driven from the first round
    assert all(np.array_equal(a, b) for a, b in zip(export_ppo(model, FeatureSpec()).weights,
                                                    initial.weights, strict=True))
    with pytest.raises(ValueError, match=r"anchor_weight.*initial policy"):
        dagger(model, TINY_ENV, "goodput_greedy", steps=10, rounds=1, gamma=0.99, seed=0,
               anchor_weight=2.0)
    with pytest.raises(ValueError, match="observations"):
        load_initial_policy(model, path, FeatureSpec(max_depth=5))
    # The same vector from other estimators (e.g. the latency model): a starting point.
    other = FeatureSpec(latency_model=2)
    assert load_initial_policy(model, path, other).feature_spec == other


def test_init_policy_is_checked_against_the_network_before_training(tmp_path):
    from omegaconf import OmegaConf

    from agents.checks import init_policy
    from agents.cli import UsageError

    path = tmp_path / "initial.npz"
    export_ppo(_model(0), FeatureSpec()).save(path)
    init_policy("agent.init_policy", OmegaConf.create(
        {"init_policy": str(path), "net_arch": [16, 16], "activation": "tanh"}))
    with pytest.raises(UsageError, match=r"hidden layers are \[16, 16\].*net_arch"):
        init_policy("agent.init_policy", OmegaConf.create(
            {"init_policy": str(path), "net_arch": [64, 64], "activation": "tanh"}))
    with pytest.raises(UsageError, match="no such file"):
        init_policy("agent.init_policy", OmegaConf.create(
            {"init_policy": str(tmp_path / "none.npz"), "net_arch": [16, 16],
             "activation": "tanh"}))


def test_specctl_train_starts_from_a_policy_file_or_a_saved_model(tmp_path):
    """``agent.init_policy``: with no imitation epochs and no PPO steps the exported
    policy is the initial one, from a policy file and from the ``model.zip`` of a run."""
    tiny = [
        "env.horizon_s=1", "profile=h200_llama31_8b", "workload=fixed",
        "env.workloads=[{name: fixed, kind: closed, concurrency: [4]}]",
        "env.random_server_share=0", "agent.total_timesteps=0", "agent.n_envs=1",
        "agent.vec_env=dummy", "agent.eval_every_steps=0", "agent.checkpoint_every_steps=0",
        "agent.pretrain.steps_per_round=50", "agent.pretrain.rounds=1",
        "agent.pretrain.epochs=0", "agent.validation_scenarios=1", "evaluate=false",
    ]
    initial = export_ppo(_model(0, net_arch=(64, 64)), FeatureSpec())
    initial.save(tmp_path / "initial.npz")
    source = tmp_path / "initial.npz"
    for run in ("from_npz", "from_zip"):
        done = subprocess.run([sys.executable, "-m", "agents.train", *tiny,
                               f"agent.init_policy={source}",
                               f"hydra.run.dir={tmp_path / run}"],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        policy = ExportedPolicy.load(tmp_path / run / "policy.npz")
        assert policy.provenance["init_policy"]["path"] == str(source)
        for mine, theirs in zip(policy.weights, initial.weights, strict=True):
            assert np.array_equal(mine, theirs), run
        source = tmp_path / run / "model.zip"
    wrong = subprocess.run([sys.executable, "-m", "agents.train", *tiny, "agent.net_arch=[8]",
                            f"agent.init_policy={tmp_path / 'initial.npz'}",
                            f"hydra.run.dir={tmp_path / 'wrong'}"],
                           capture_output=True, text=True, timeout=600)
    assert wrong.returncode == 2 and "agent.init_policy" in wrong.stderr


def test_train_and_eval_commands_end_to_end(tmp_path):
    tiny = [
        "env.horizon_s=2", "profile=h200_llama31_8b", "workload=fixed",
        "env.workloads=[{name: fixed, kind: closed, concurrency: [4, 32]}]",
        "agent.total_timesteps=1024", "agent.n_steps=256", "agent.batch_size=64",
        "agent.n_envs=2", "agent.eval_every_steps=512", "agent.eval_episodes=1",
        "agent.checkpoint_every_steps=512", "agent.pretrain.steps_per_round=500",
        "agent.pretrain.rounds=2", "agent.pretrain.epochs=2",
        "eval.windows=1", "eval.workers=1", "eval.horizon_s=2", "eval.prior_modes=[exact,none]",
        "eval.sweep_concurrency=[1,8]", "eval.sweep_horizon_s=2",
        "eval.policies=[no_spec,static_3,goodput_greedy,goodput_online,oracle,ppo]",
        "eval.sweep_policies=[no_spec,static_3,ppo]", "eval.policy_map=true",
    ]
    train_dir = tmp_path / "train"
    subprocess.run([sys.executable, "-m", "agents.train", *tiny, f"hydra.run.dir={train_dir}"],
                   check=True, capture_output=True, timeout=600)
    policy = ExportedPolicy.load(train_dir / "policy.npz")
    assert policy.provenance["total_timesteps"] == 1024
    # The exported network is the trained model's: the same action on real observations.
    model = PPO.load(train_dir / "model.zip", device="cpu")
    env = SpecDecodeEnv({"horizon_s": 2.0, "profiles": ["h200_llama31_8b"],
                         "workloads": [{"name": "fixed", "kind": "closed",
                                        "concurrency": [4, 32]}]})
    observations = [env.reset(seed=s)[0] for s in range(2)]
    observations += [env.step(a)[0] for a in range(8)]
    for obs in observations:
        assert int(policy.act(obs)) == int(model.predict(obs, deterministic=True)[0])
    for name in ("report.md", "results.json", "throughput_h200_llama31_8b.png",
                 "policy_map_h200_llama31_8b.png", "model.zip"):
        assert (train_dir / name).exists(), name
    assert any((train_dir / "tb").rglob("events.out.tfevents.*"))
    assert any((train_dir / "checkpoints").glob("ppo_*.zip"))

    eval_dir = tmp_path / "eval"
    # A profile given as a YAML path (plots are named by its stem), its eval settings.
    profile_yaml = Path(__file__).resolve().parents[1] / "env/sim/profiles/h200_llama31_8b.yaml"
    subprocess.run([sys.executable, "-m", "agents.evaluate", f"profile={profile_yaml}",
                    tiny[0], *tiny[2:4], *tiny[-9:], f"policy={train_dir / 'policy.npz'}",
                    f"hydra.run.dir={eval_dir}"], check=True, capture_output=True, timeout=600)
    document = json.loads((eval_dir / "results.json").read_text())
    assert (eval_dir / "throughput_h200_llama31_8b.png").exists()
    table = document["workloads"]["fixed"]
    assert set(table) == {"no_spec", "static_3", "goodput_greedy", "goodput_online", "oracle",
                          "ppo"}
    for row in table.values():
        assert set(row) >= {"throughput_tok_s", "mean_tpot_ms", "oracle_fraction", "off_share"}
    scenarios = document["scenarios"]
    assert {(d["workload"], d["prior_mode"]) for d in scenarios} == {("fixed", "exact"),
                                                                    ("fixed", "none")}
    for detail in scenarios:
        runs = detail["runs"]
        # The reference is the best of the per-step oracle and the fixed depths run: each
        # fraction is a throughput over it, and one of those runs is it.
        reference = max(runs[p]["throughput_tok_s"] for p in ("oracle", "no_spec", "static_3"))
        for name, run in runs.items():
            assert run["throughput_tok_s"] > 0, name
            assert run["oracle_fraction"] == pytest.approx(run["throughput_tok_s"] / reference,
                                                           rel=1e-12), name
        assert runs["no_spec"]["off_share"] == 1.0 and runs["static_3"]["off_share"] == 0.0
        assert runs["static_3"]["steps_chosen"][3] == sum(runs["static_3"]["steps_chosen"])
    # A workload's row is the mean over its scenarios (prior-free policies ran once).
    for name, row in table.items():
        values = [d["runs"][name]["throughput_tok_s"] for d in scenarios if name in d["runs"]]
        assert row["scenarios"] == len(values) >= 1, name
        assert row["throughput_tok_s"] == pytest.approx(np.mean(values), rel=1e-12), name
    assert set(document["cells"]) == {"h200_llama31_8b/fixed/exact",
                                      "h200_llama31_8b/fixed/none"}
    # No profile handed: goodput_greedy has nothing to run on and is left out there.
    assert "goodput_greedy" not in document["cells"]["h200_llama31_8b/fixed/none"]
    assert set(document["sweep"]) == {"no_spec", "static_3", "ppo"}
    assert set(document["sweep"]["ppo"]) == {"1", "8"}
    assert "Target checks" in (eval_dir / "report.md").read_text()


def test_training_sweep_runs_through_hydras_local_launcher(tmp_path):
    """``specctl-train -m``: the basic (local) launcher runs one job per value; the
    Slurm / Ray launchers and the Optuna sweeper plug into the same path."""
    tiny = [
        "env.horizon_s=1", "profile=h200_llama31_8b", "workload=fixed",
        "env.workloads=[{name: fixed, kind: closed, concurrency: [4]}]",
        "env.random_server_share=0", "agent.total_timesteps=128", "agent.n_steps=64",
        "agent.batch_size=32", "agent.n_envs=1", "agent.vec_env=dummy",
        "agent.eval_every_steps=0", "agent.checkpoint_every_steps=0",
        "agent.pretrain.teacher=null", "evaluate=false",
    ]
    sweep_dir = tmp_path / "sweep"
    done = subprocess.run([sys.executable, "-m", "agents.train", "-m", *tiny,
                           "agent.learning_rate=1e-4,3e-4", f"hydra.sweep.dir={sweep_dir}"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]  # a failed job's traceback
    rates = sorted(ExportedPolicy.load(sweep_dir / str(job) / "policy.npz")
                   .provenance["agent"]["learning_rate"] for job in (0, 1))
    assert rates == [1e-4, 3e-4]


def test_export_check_counts_disagreements_but_not_near_ties():
    """The export check compares actions: a near-tie that float32 rounding decides is not an
    export error; a clear disagreement and an action the export lacks are."""
    spec = FeatureSpec()
    weight = np.zeros((spec.size, 3), np.float32)
    policy = ExportedPolicy([weight], [np.array([1.0, 1.0 - EXPORT_TIE_TOLERANCE / 4, 0.0],
                                                np.float32)], [0, 1, 3], spec)
    observations = np.zeros((4, spec.size), np.float32)
    assert list(policy.act(observations)) == [0, 0, 0, 0]
    assert export_mismatches(policy, observations, np.array([0, 0, 0, 0])) == 0
    assert export_mismatches(policy, observations, np.array([1, 0, 0, 0])) == 0  # near-tie
    assert export_mismatches(policy, observations, np.array([3, 1, 0, 0])) == 1  # 1.0 apart
    assert export_mismatches(policy, observations, np.array([7, 0, 3, 0])) == 2  # 7: unknown


def test_initial_label_modes_label_those_states_with_the_initial_policys_action():
    torch.set_num_threads(1)
    initial = export_ppo(_model(0), FeatureSpec())  # untrained: often not the teacher's choice
    student = _model(2)  # acts in every run below, so they visit the same states
    teacher = collect(TINY_ENV, "goodput_greedy", 80, 0.99, 0, student=student)
    # TINY_ENV hands the exact profile in every scenario.
    kept = collect(TINY_ENV, "goodput_greedy", 80, 0.99, 0, student=student,
                   initial_act=initial.act, initial_modes={"exact"})
    assert np.array_equal(kept.observations, teacher.observations)
    assert np.array_equal(kept.actions, initial.act(kept.observations))
    assert (kept.actions != teacher.actions).any()
    acted = export_ppo(student, FeatureSpec()).act(kept.observations)
    assert np.array_equal(kept.disagree, acted != kept.actions)  # measured against the label
    other = collect(TINY_ENV, "goodput_greedy", 80, 0.99, 0, student=student,
                    initial_act=initial.act, initial_modes={"none"})
    assert np.array_equal(other.actions, teacher.actions)  # no scenario of that mode
    with pytest.raises(ValueError, match="initial_act"):
        collect(TINY_ENV, "goodput_greedy", 10, 0.99, 0, initial_modes={"exact"})
    model = _model(1)
    with pytest.raises(ValueError, match="initial policy"):
        dagger(model, TINY_ENV, "goodput_greedy", steps=10, rounds=1, gamma=0.99, seed=0,
               initial_modes=["exact"])
    with pytest.raises(ValueError, match="'exakt'"):
        dagger(model, TINY_ENV, "goodput_greedy", steps=10, rounds=1, gamma=0.99, seed=0,
               initial=initial, initial_modes=["exakt"])


def test_blend_keeps_that_fraction_of_the_way_from_the_initial_weights():
    torch.set_num_threads(1)
    initial = export_ppo(_model(0), FeatureSpec())
    model = _model(1)
    retrained = export_ppo(model, FeatureSpec())
    pretrain.blend(model, initial, 0.25)
    mixed = export_ppo(model, FeatureSpec())
    for w0, w1, w in zip(initial.weights + initial.biases, retrained.weights + retrained.biases,
                         mixed.weights + mixed.biases, strict=True):
        assert np.allclose(w, w0 + 0.25 * (w1 - w0), atol=1e-7)
    for w0, w1, w in zip(initial.weights, retrained.weights, mixed.weights, strict=True):
        assert not np.allclose(w, w1) and not np.allclose(w, w0)  # (biases start at 0)
    pretrain.blend(model, initial, 1.0)  # all the way: the model as it is
    assert all(np.array_equal(a, b) for a, b in zip(export_ppo(model, FeatureSpec()).weights,
                                                    mixed.weights, strict=True))
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        pretrain.blend(model, initial, 0.0)
    with pytest.raises(ValueError, match="layers"):
        pretrain.blend(_model(2, net_arch=(8, 8)), initial, 0.5)


def test_initial_label_decisions_label_each_episodes_first_decisions_with_the_initial_policy():
    torch.set_num_threads(1)
    initial = export_ppo(_model(0), FeatureSpec())
    student = _model(2)
    teacher = collect(TINY_ENV, "goodput_greedy", 400, 0.99, 0, student=student)
    first = collect(TINY_ENV, "goodput_greedy", 400, 0.99, 0, student=student,
                    initial_act=initial.act, initial_decisions=3)
    assert np.array_equal(first.observations, teacher.observations)
    early = first.positions < 3
    assert early.sum() > 3  # more than one episode
    assert np.array_equal(first.actions[early], initial.act(first.observations[early]))
    assert np.array_equal(first.actions[~early], teacher.actions[~early])
    assert (first.actions[early] != teacher.actions[early]).any()
    with pytest.raises(ValueError, match="initial_act"):
        collect(TINY_ENV, "goodput_greedy", 10, 0.99, 0, initial_decisions=2)
    with pytest.raises(ValueError, match="initial policy"):
        dagger(_model(1), TINY_ENV, "goodput_greedy", steps=10, rounds=1, gamma=0.99, seed=0,
               initial_decisions=2)
