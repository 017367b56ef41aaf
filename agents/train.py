"""``specctl-train``: PPO on the simulated server, then evaluation and export.

Reads top to bottom like a CleanRL script, but the algorithm is
stable-baselines3's PPO:

1. build ``n_envs`` copies of ``specctl/SpecDecode-v0`` (training windows) in
   subprocesses, and one evaluation copy (held-out windows);
2. kick-start the actor and critic from a teacher policy with DAgger
   (:mod:`agents.pretrain`; ``agent.pretrain.teacher=null`` trains from scratch), from
   random weights or, with ``agent.init_policy=PATH``, from a trained policy's;
3. train PPO with a progress bar, TensorBoard logs (``<out>/tb``), periodic
   checkpoints (``<out>/checkpoints``) and an evaluation callback that keeps the
   best model (``<out>/best``);
4. keep the PPO-fine-tuned policy only if it does at least as well as the
   kick-started one on validation scenarios (drawn from the *training* part of
   the traces, so the held-out evaluation stays untouched), export it to
   ``<out>/policy.npz`` (numpy only; what ``specctl-serve`` loads) and check the
   export acts like the SB3 model;
5. run the ``specctl-eval`` report into ``<out>`` (``report.md``, ``results.json``, plots).

    specctl-train
    specctl-train workload=azure_conv profile=h100_llama31_8b \
        agent.total_timesteps=2e6 env.slo_tpot_ms=50
    specctl-train -m agent.learning_rate=1e-4,3e-4
"""

from __future__ import annotations

import copy
import logging
import time
import warnings
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import CallbackList, CheckpointCallback, EvalCallback
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv
from tqdm.auto import tqdm

from agents import checks
from agents.cli import hydra_app
from agents.config import env_config
from agents.evaluate import run_evaluation
from agents.export import export_ppo, load_exported
from agents.policies import ExportedPolicyAdapter
from agents.pretrain import blend, dagger
from controller.policy_file import ExportedPolicy
from env.features import FeatureSpec
from env.rollout import DecisionLoop, rollout
from env.scenarios import ScenarioSampler
from env.sim.simulator import Simulator
from env.spec_env import SpecDecodeEnv, env_feature_spec

log = logging.getLogger(__name__)

_ACTIVATION = {"tanh": torch.nn.Tanh, "relu": torch.nn.ReLU}
_PPO_KEYS = ("learning_rate", "n_steps", "batch_size", "n_epochs", "gamma", "gae_lambda",
             "clip_range", "ent_coef", "vf_coef", "max_grad_norm")


def build_model(env_cfg: dict[str, Any], agent: DictConfig, seed: int, out_dir: Path,
                device: str = "cpu") -> PPO:
    """The vectorised training environments and an untrained PPO model on them."""
    vec_cls = SubprocVecEnv if agent.vec_env == "subproc" and agent.n_envs > 1 else DummyVecEnv
    envs = make_vec_env(SpecDecodeEnv, n_envs=int(agent.n_envs), seed=seed,
                        env_kwargs={"config": env_cfg, "split": "train"}, vec_env_cls=vec_cls)
    policy_kwargs = {"net_arch": list(agent.net_arch),
                     "activation_fn": _ACTIVATION[agent.activation]}
    return PPO("MlpPolicy", envs, seed=seed, device=device, verbose=0,
               tensorboard_log=str(out_dir / "tb"), policy_kwargs=policy_kwargs,
               **{k: agent[k] for k in _PPO_KEYS})


def load_initial_policy(model: PPO, path: str | Path, spec: FeatureSpec) -> ExportedPolicy:
    """Start ``model`` from the trained policy at ``path`` (``agent.init_policy``).

    ``path`` is an exported policy file (``policy.npz``, e.g. the shipped
    ``controller/data/default_policy.npz``: the actor only, the critic stays as built)
    or a stable-baselines3 ``model.zip`` that ``specctl-train`` saved (actor and
    critic). Returns the actor as an exported policy (what a warm-started kick-start
    anchors to). The network must be built as the file's was (``agent.net_arch``,
    ``agent.activation``), and a policy file's observation vector laid out as ``spec``'s
    (its estimators may differ, e.g. ``env.features.latency_model``).
    """
    path = Path(path)
    if path.suffix == ".zip":
        try:
            model.set_parameters(str(path), exact_match=True, device=model.device)
        except (RuntimeError, KeyError, ValueError) as exc:
            raise ValueError(f"{path}: not a PPO model this network can load "
                             f"(agent.net_arch, agent.activation): {exc}") from exc
    else:
        exported = ExportedPolicy.load(path)
        if exported.feature_spec.names() != spec.names():
            raise ValueError(f"{path}: its observations are {exported.feature_spec}, "
                             f"training's are {spec}")
        if exported.feature_spec != spec:
            # The same vector, computed otherwise (e.g. another latency model): the
            # weights are a starting point the kick-start's rounds adapt.
            log.info("%s: observations computed as %s, training's as %s", path,
                     exported.feature_spec, spec)
        load_exported(model, exported, source=str(path))
    return export_ppo(model, spec)


def train(cfg: DictConfig, out_dir: Path) -> tuple[Path, float | None]:
    """Train, export and (optionally) evaluate.

    Returns the exported policy's path and its score: the mean oracle fraction of the
    policy over the evaluation's cells (None without an evaluation).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    env_cfg = env_config(cfg)
    agent = cfg.agent
    seed = int(cfg.seed)
    torch.set_num_threads(1)  # small MLP: threads only fight the env processes for cores
    model = build_model(env_cfg, agent, seed, out_dir, cfg.device)

    callbacks = []
    n_envs = int(agent.n_envs)
    if agent.checkpoint_every_steps:
        callbacks.append(CheckpointCallback(max(1, int(agent.checkpoint_every_steps) // n_envs),
                                            str(out_dir / "checkpoints"), name_prefix="ppo"))
    if agent.eval_every_steps:
        # One in-process copy is enough; SB3 warns only because the types differ.
        warnings.filterwarnings("ignore", message="Training and eval env are not of the same")
        eval_env = make_vec_env(SpecDecodeEnv, n_envs=1, seed=seed + 10_000,
                                env_kwargs={"config": env_cfg, "split": "eval"})
        callbacks.append(EvalCallback(eval_env, n_eval_episodes=int(agent.eval_episodes),
                                      eval_freq=max(1, int(agent.eval_every_steps) // n_envs),
                                      best_model_save_path=str(out_dir / "best"),
                                      log_path=str(out_dir / "eval"), deterministic=True))
    started = time.perf_counter()
    score = None
    pretrain = agent.pretrain
    spec = env_feature_spec(env_cfg)
    kickstart_stats, kickstarted, kickstarted_state = None, None, None
    initial = None
    if agent.get("init_policy"):
        initial = load_initial_policy(model, agent.init_policy, spec)
        log.info("starting from the weights of %s", agent.init_policy)
    if pretrain.teacher:
        kickstart_stats = dagger(model, env_cfg, str(pretrain.teacher),
                                 int(pretrain.steps_per_round), int(pretrain.rounds),
                                 float(agent.gamma), seed, epochs=int(pretrain.epochs),
                                 teacher_options=dict(pretrain.get("teacher_options") or {}),
                                 disagreement_weight=float(pretrain.get("disagreement_weight",
                                                                        1.0)),
                                 start_weight=float(pretrain.get("start_weight", 1.0)),
                                 start_decisions=int(pretrain.get("start_decisions", 0)),
                                 learning_rate=float(pretrain.get("learning_rate", 1e-3)),
                                 initial=initial,
                                 anchor_weight=float(pretrain.get("anchor_weight", 1.0)),
                                 initial_modes=[str(m) for m in
                                                pretrain.get("initial_label_modes") or []],
                                 initial_decisions=int(pretrain.get("initial_label_decisions",
                                                                    0)))
        fraction = float(pretrain.get("blend", 1.0))
        if fraction != 1.0:
            if initial is None:
                raise ValueError("agent.pretrain.blend keeps part of the way from the initial "
                                 "weights: it needs agent.init_policy")
            blend(model, initial, fraction)
            log.info("kept %.2f of the way from the initial weights to the retrained ones",
                     fraction)
        kickstarted = export_ppo(model, spec)
        kickstarted_state = copy.deepcopy(model.policy.state_dict())
    model.learn(total_timesteps=int(float(agent.total_timesteps)),
                callback=CallbackList(callbacks), progress_bar=True, tb_log_name="ppo")
    train_s = time.perf_counter() - started

    selection = None
    if kickstarted is not None:
        scores = validation_scores({"kickstart": kickstarted, "ppo": export_ppo(model, spec)},
                                   env_cfg, int(agent.validation_scenarios), seed)
        # PPO must not lose anywhere it is checked: a mean over scenarios is dominated by
        # fast servers (many decisions), and fine-tuning that forgets how to turn
        # speculation off on a slow one would still raise it.
        keep = scores["ppo"] >= 1.0 and scores["ppo_worst"] >= 0.97
        selection = {"scores": scores, "kept": "ppo" if keep else "kickstart"}
        log.info("validation (throughput relative to the kick-start): %s; keeping %s",
                 scores, selection["kept"])
        if selection["kept"] == "kickstart":  # fine-tuning did not help: roll the weights back
            model.policy.load_state_dict(kickstarted_state)
    model.save(out_dir / "model")
    provenance = {
        "command": "specctl-train",
        "seed": seed,
        "total_timesteps": int(float(agent.total_timesteps)),
        "train_seconds": round(train_s, 1),
        "kickstart": kickstart_stats,
        "init_policy": _init_provenance(agent.get("init_policy")),
        "selection": selection,
        "env": env_cfg,
        "agent": OmegaConf.to_container(agent, resolve=True),
    }
    exported = export_ppo(model, spec, name=str(cfg.export_name), provenance=provenance)
    check_export(model, exported, SpecDecodeEnv(env_cfg, split="eval"), seed)
    policy_path = out_dir / "policy.npz"
    exported.save(policy_path)
    model.get_env().close()
    log.info("trained %d steps in %.0f s; exported %s", provenance["total_timesteps"], train_s,
             policy_path)
    if cfg.evaluate:
        document = run_evaluation(cfg, str(policy_path), out_dir)
        fractions = [c["oracle_fraction"] for c in document["checks"].get("cells", {}).values()]
        score = float(np.mean(fractions)) if fractions else None
        log.info("report: %s", out_dir / "report.md")
    log.info("outputs in %s: policy.npz (serve it: specctl-serve policy=%s), tb/ "
             "(tensorboard --logdir %s), checkpoints/", out_dir, policy_path, out_dir / "tb")
    return policy_path, score


def _init_provenance(path: str | None) -> dict | None:
    """The warm start's file and its sha256 (the file may change later; the hash says which)."""
    if not path:
        return None
    import hashlib

    return {"path": str(path), "sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest()}


def validation_scores(candidates: dict[str, ExportedPolicy], env_cfg: dict[str, Any],
                      scenarios: int, seed: int) -> dict[str, float]:
    """Mean throughput of each candidate relative to the first, on training-split scenarios,
    and (``<name>_worst``) its worst single-scenario ratio."""
    sampler = ScenarioSampler(env_cfg, split="train")
    rng = np.random.default_rng(seed + 424_242)  # not the training episodes' stream
    spec = next(iter(candidates.values())).feature_spec
    ratios: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in tqdm(range(scenarios), desc="validation", unit="scenario", disable=None,
                  leave=False):
        scenario = sampler.sample(rng)
        throughput = {}
        for name, exported in candidates.items():
            sim = Simulator(scenario.profile, scenario.acceptance, scenario.workload,
                            scenario.config, seed=scenario.seed)
            loop = DecisionLoop(sim, spec, int(env_cfg["feedback_lag"]), scenario.horizon_s,
                                cost_prior=scenario.prior)
            throughput[name] = rollout(loop, ExportedPolicyAdapter(exported, name)).throughput_tok_s
        first = next(iter(throughput.values()))
        if first > 0:
            for name, value in throughput.items():
                ratios[name].append(value / first)
    scores = {name: float(np.mean(values)) if values else 1.0 for name, values in ratios.items()}
    scores.update({f"{name}_worst": float(np.min(values)) if values else 1.0
                   for name, values in ratios.items()})
    return scores


#: Logit gap below which the exported policy and SB3 may pick different actions: a near-tie
#: that float32 rounding decides (numpy's BLAS and torch's sum in different orders), not an
#: export error (a barely trained policy in a test once split one of 500 this way).
EXPORT_TIE_TOLERANCE = 1e-4


def check_export(model: PPO, exported, env: SpecDecodeEnv, seed: int, steps: int = 500) -> None:
    """The exported policy must choose the SB3 model's deterministic action everywhere we look
    (up to near-ties: :data:`EXPORT_TIE_TOLERANCE`)."""
    obs, _ = env.reset(seed=seed)
    batch = []
    for _ in range(steps):
        batch.append(obs)
        obs, _, terminated, truncated, _ = env.step(env.action_space.sample())
        if terminated or truncated:
            obs, _ = env.reset()
    batch = np.asarray(batch, dtype=np.float32)
    sb3_actions, _ = model.predict(batch, deterministic=True)
    mismatches = export_mismatches(exported, batch, np.asarray(sb3_actions))
    if mismatches:
        raise RuntimeError(f"exported policy disagrees with the SB3 model on {mismatches} "
                           f"of {steps} observations (beyond near-ties)")


def export_mismatches(exported, observations: np.ndarray, expected: np.ndarray) -> int:
    """How many ``observations`` the exported policy answers other than ``expected`` (action
    values), not counting those where its logit of the expected action is within
    :data:`EXPORT_TIE_TOLERANCE` of its best."""
    logits = np.atleast_2d(exported.logits(observations))
    index = {action: i for i, action in enumerate(exported.actions)}
    # An action the export does not have is never a tie: its logit counts as -inf.
    expected_logit = np.array([logits[row, index[int(a)]] if int(a) in index else -np.inf
                               for row, a in enumerate(expected)])
    return int(np.sum(logits.max(axis=-1) - expected_logit > EXPORT_TIE_TOLERANCE))


@hydra_app("train", prog="specctl-train")
def main(cfg: DictConfig) -> float | None:
    """Hydra entry point of ``specctl-train``; returns the score a sweeper maximises."""
    checks.run_config(cfg)
    out_dir = Path(hydra.core.hydra_config.HydraConfig.get().runtime.output_dir)
    return train(cfg, out_dir)[1]


if __name__ == "__main__":
    main()
