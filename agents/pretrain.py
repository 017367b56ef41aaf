"""Kick-starting PPO from a teacher: behaviour cloning of the actor, warm-up of the critic.

PPO from scratch has to discover, from noisy per-step rewards, a mapping that a
cost-model-aware rule already knows approximately. So before PPO we:

1. run a teacher policy (by default ``goodput_greedy``, which knows the true
   cost profile of each training scenario: privileged information the student
   must learn to infer from telemetry) in the training environments and record
   (observation vector, teacher action, reward, episode end, the latency of the
   decode step the decision governed);
2. fit the PPO actor to the teacher's actions (cross-entropy weighted by that
   time: episodes are fixed spans of time, so a slow server yields few decisions
   that each decide much, and unweighted imitation would all but ignore it) and the critic
   to the discounted returns, so PPO's first advantage estimates do not undo
   the actor;
3. repeat with the student acting (DAgger: the teacher still labels every
   state), so the student also learns what to do in the states its own
   mistakes lead to — e.g. speculating on a server where that is expensive,
   which the teacher itself never visits.

PPO then fine-tunes from there on its own reward: it can keep, or improve on,
what the teacher does.

**Warm start** (``agent.init_policy``, :func:`dagger`'s ``initial``): the student
starts from a trained policy's weights instead of at random, so every round is
student-driven (the states *it* visits get the teacher's labels) and, with a small
``learning_rate`` and few ``epochs``, it keeps what it already does and learns
where the teacher says otherwise. ``anchor_weight`` makes the states where the
initial policy already chose the teacher's label count more, so that learning the
others does not move it where it was right. ``initial_modes`` goes further: in the
training scenarios whose cost profile is handed in one of these modes (e.g. ``exact``)
the label is the initial policy's own action, not the teacher's, so a retrain for
what the features changed elsewhere (``latency_model: 3`` computes the exact profile's
features as before, to within the residual's noise) is taught its decisions there, the
near-ties at break-even included, which the teacher's labels tip (docs/POLICY.md; that
does not stop the retrained network from moving decisions it generalises to, e.g. on
held-out servers: docs/results/latency_model_3/candidates.md).
``initial_decisions`` does the same for each episode's first decisions, in every mode:
taken before telemetry says much, on a slow server at batch 64 one of them can decide a
few per cent of a short window.
:func:`blend` keeps only part of the way from the initial weights to the retrained ones
(weight-space interpolation, as WiSE-FT does for fine-tuned models).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from stable_baselines3 import PPO
from tqdm.auto import tqdm

from agents.export import export_ppo, load_exported
from agents.policies import make_policy
from controller.policy_file import ExportedPolicy
from env.scenarios import PRIOR_MODES
from env.spec_env import SpecDecodeEnv

log = logging.getLogger(__name__)


@dataclass
class Demonstrations:
    """Teacher rollouts, flattened over episodes."""

    observations: np.ndarray  # (N, obs_size) float32
    actions: np.ndarray  # (N,) int64
    returns: np.ndarray  # (N,) discounted return from each step
    #: (N,) simulated seconds each decision governed (its weight in the imitation loss).
    durations: np.ndarray | None = None
    #: (N,) whether the acting student chose otherwise than the teacher's label (False
    #: where the teacher acted).
    disagree: np.ndarray | None = None
    #: (N,) the decision's index in its episode (0: the first, with no telemetry yet).
    positions: np.ndarray | None = None
    #: (N,) whether the warm start's initial policy chose the teacher's label there.
    anchored: np.ndarray | None = None


def collect(env_cfg: dict[str, Any], teacher: str, steps: int, gamma: float, seed: int,
            student: PPO | None = None, desc: str = "teacher steps",
            teacher_options: dict[str, Any] | None = None,
            initial_act: Callable[[np.ndarray], Any] | None = None,
            initial_modes: Collection[str] = (),
            initial_decisions: int = 0) -> Demonstrations:
    """``steps`` decisions in training scenarios, labelled by ``teacher`` (built with
    ``teacher_options``, see :func:`agents.policies.make_policy`).

    The teacher acts, or the ``student`` (its deterministic action, through the
    numpy export, which is much faster than ``model.predict`` per step) when given.
    In scenarios whose cost profile is handed in one of ``initial_modes`` the label is
    ``initial_act``'s action instead (the teacher still sees every step: its probing
    budget runs on as if it labelled them); so it is in each episode's first
    ``initial_decisions`` decisions.
    """
    if (initial_modes or initial_decisions) and initial_act is None:
        raise ValueError("initial_modes and initial_decisions label states with the initial "
                         "policy's action: they need initial_act")
    env = SpecDecodeEnv(env_cfg, split="train")
    student_act = None if student is None else export_ppo(student, env.feature_spec).act
    observations, actions, rewards, ends, durations, disagree = [], [], [], [], [], []
    positions: list[int] = []
    position = 0
    obs, _ = env.reset(seed=seed)
    policy = _teacher_for(env, teacher, teacher_options)
    bar = tqdm(total=steps, desc=desc, unit="step", disable=None, leave=False)
    while len(actions) < steps:
        bar.update()
        label = policy.act(env.last_observation)
        if position < initial_decisions or (initial_modes
                                             and env.scenario.prior_mode in initial_modes):
            label = int(np.asarray(initial_act(obs)).reshape(-1)[0])
        observations.append(obs)
        actions.append(label)
        positions.append(position)
        position += 1
        action = label if student_act is None else int(student_act(obs))
        disagree.append(action != label)
        obs, reward, terminated, truncated, info = env.step(action)
        durations.append(info["step_latency_s"])
        rewards.append(reward)
        ends.append(terminated or truncated)
        if terminated or truncated:
            obs, _ = env.reset()
            position = 0
            policy = _teacher_for(env, teacher, teacher_options)
    bar.close()
    returns = np.zeros(len(rewards))
    running = 0.0
    for i in range(len(rewards) - 1, -1, -1):
        running = rewards[i] + gamma * running * (not ends[i])
        returns[i] = running
    return Demonstrations(np.asarray(observations, np.float32), np.asarray(actions, np.int64),
                          returns.astype(np.float32), np.asarray(durations, np.float32),
                          np.asarray(disagree, bool), np.asarray(positions, np.int64))


def merge(a: Demonstrations, b: Demonstrations) -> Demonstrations:
    """Both sets of demonstrations."""
    def both(x: np.ndarray | None, y: np.ndarray | None) -> np.ndarray | None:
        return None if x is None or y is None else np.concatenate([x, y])

    return Demonstrations(np.concatenate([a.observations, b.observations]),
                          np.concatenate([a.actions, b.actions]),
                          np.concatenate([a.returns, b.returns]),
                          both(a.durations, b.durations), both(a.disagree, b.disagree),
                          both(a.positions, b.positions), both(a.anchored, b.anchored))


def dagger(model: PPO, env_cfg: dict[str, Any], teacher: str, steps: int, rounds: int,
           gamma: float, seed: int, epochs: int = 20,
           teacher_options: dict[str, Any] | None = None,
           disagreement_weight: float = 1.0, start_weight: float = 1.0,
           start_decisions: int = 0, learning_rate: float = 1e-3,
           initial: ExportedPolicy | None = None,
           anchor_weight: float = 1.0,
           initial_modes: Collection[str] = (),
           initial_decisions: int = 0) -> dict[str, float]:
    """Teacher-driven round, then ``rounds - 1`` student-driven rounds, refitting each time
    (``teacher_options``: see :func:`collect`; ``disagreement_weight``, ``start_weight``,
    ``start_decisions``, ``learning_rate`` and ``anchor_weight``: see :func:`kickstart`).

    ``initial``: ``model`` already holds this policy's weights (a warm start): every round,
    the first too, is student-driven, and each state records whether ``initial`` chose
    the teacher's label (what ``anchor_weight`` weighs). ``initial_modes``: the cost-prior
    modes (``env.scenarios.PRIOR_MODES``) whose states ``initial`` labels instead of the
    teacher (:func:`collect`; they count as anchored); so does each episode's first
    ``initial_decisions`` decisions.
    """
    if anchor_weight != 1.0 and initial is None:
        raise ValueError("anchor_weight weighs the states where the initial policy agrees "
                         "with the teacher: it needs an initial policy (agent.init_policy)")
    unknown = sorted(set(initial_modes) - set(PRIOR_MODES))
    if unknown:
        raise ValueError(f"initial_modes: unknown cost-prior mode {unknown[0]!r}; use "
                         f"{list(PRIOR_MODES)}")
    if initial_decisions < 0:
        raise ValueError(f"initial_decisions must be >= 0, got {initial_decisions}")
    if (initial_modes or initial_decisions) and initial is None:
        raise ValueError("initial_modes and initial_decisions label states with the initial "
                         "policy's action: they need an initial policy (agent.init_policy)")
    weighting = {"disagreement_weight": disagreement_weight, "start_weight": start_weight,
                 "start_decisions": start_decisions, "learning_rate": learning_rate,
                 "anchor_weight": anchor_weight}
    demos: Demonstrations | None = None
    stats: dict[str, float] = {}
    for r in range(rounds):
        found = collect(env_cfg, teacher, steps, gamma, seed + r,
                        student=model if r or initial is not None else None,
                        desc=f"kick-start {r + 1}/{rounds}", teacher_options=teacher_options,
                        initial_act=None if initial is None else initial.act,
                        initial_modes=frozenset(initial_modes),
                        initial_decisions=initial_decisions)
        if initial is not None:
            found.anchored = np.asarray(initial.act(found.observations)) == found.actions
        demos = found if demos is None else merge(demos, found)
        stats = kickstart(model, demos, epochs=epochs, seed=seed + r, **weighting)
    return stats


def _teacher_for(env: SpecDecodeEnv, name: str, options: dict[str, Any] | None = None):
    scenario = env.scenario
    policy = make_policy(name, profile=scenario.profile, max_depth=env.max_depth,
                         sim_config=scenario.config, options=options)
    policy.reset(env.simulator)
    return policy


def kickstart(model: PPO, demos: Demonstrations, epochs: int = 20, batch_size: int = 512,
              learning_rate: float = 1e-3, seed: int = 0,
              disagreement_weight: float = 1.0, start_weight: float = 1.0,
              start_decisions: int = 0, anchor_weight: float = 1.0) -> dict[str, float]:
    """Fit the actor to the teacher's actions and the critic to its returns.

    The states where the acting student chose otherwise than the teacher count
    ``disagreement_weight`` times in the imitation loss: they are the student's own
    mistakes (e.g. speculating on a server where it never pays), few among many states
    where both agree. The first ``start_decisions`` decisions of each episode count
    ``start_weight`` times: decided before telemetry says much, they are one or two in
    a thousand states, yet in a short window on a slow server a speculative step there
    costs a few per cent of the window. With a warm start, the states where the initial
    policy chose the teacher's label (``demos.anchored``) count ``anchor_weight`` times.
    """
    if disagreement_weight < 1.0:
        raise ValueError(f"disagreement_weight must be >= 1, got {disagreement_weight}")
    if start_weight < 1.0:
        raise ValueError(f"start_weight must be >= 1, got {start_weight}")
    if start_decisions < 0:
        raise ValueError(f"start_decisions must be >= 0, got {start_decisions}")
    if anchor_weight < 1.0:
        raise ValueError(f"anchor_weight must be >= 1, got {anchor_weight}")
    if not learning_rate > 0:
        raise ValueError(f"learning_rate must be > 0, got {learning_rate}")
    policy = model.policy
    device = policy.device
    obs = torch.as_tensor(demos.observations, device=device)
    actions = torch.as_tensor(demos.actions, device=device)
    returns = torch.as_tensor(demos.returns, device=device)
    if demos.durations is not None and demos.durations.sum() > 0:
        # Capped: one pathological step must not drown the rest of the batch.
        weights = np.minimum(demos.durations / demos.durations.mean(), 50.0)
    else:
        weights = np.ones(len(demos.actions), np.float32)
    if demos.disagree is not None and disagreement_weight != 1.0:
        weights = np.where(demos.disagree, weights * disagreement_weight, weights)
    if demos.positions is not None and start_weight != 1.0 and start_decisions > 0:
        weights = np.where(demos.positions < start_decisions, weights * start_weight, weights)
    if demos.anchored is not None and anchor_weight != 1.0:
        weights = np.where(demos.anchored, weights * anchor_weight, weights)
    weights = torch.as_tensor(weights, dtype=torch.float32, device=device)
    optimizer = torch.optim.Adam(policy.parameters(), lr=learning_rate)
    generator = torch.Generator().manual_seed(seed)
    n = len(actions)
    for _ in range(epochs):
        for index in torch.randperm(n, generator=generator).split(batch_size):
            values, log_prob, _ = policy.evaluate_actions(obs[index], actions[index])
            value_loss = torch.nn.functional.mse_loss(values.flatten(), returns[index])
            loss = -(weights[index] * log_prob).mean() + 0.5 * value_loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    with torch.no_grad():
        values, log_prob, _ = policy.evaluate_actions(obs, actions)
        predicted = policy.get_distribution(obs).mode()
    stats = {
        "demonstrations": float(n),
        "agreement": float((predicted == actions).float().mean()),
        "nll": float(-log_prob.mean()),
        "value_r2": float(1 - torch.var(returns - values.flatten()) / torch.var(returns)),
    }
    log.info("kick-start on %d teacher steps: agreement %.3f, value R^2 %.3f",
             n, stats["agreement"], stats["value_r2"])
    return stats


def blend(model: PPO, initial: ExportedPolicy, fraction: float) -> None:
    """Set ``model``'s actor to ``initial``'s weights plus ``fraction`` of the way to its own:
    ``w = w0 + fraction * (w - w0)`` per array (1: the model as it is; the critic is left
    alone). A warm-started retrain moves decisions the initial policy got right as well as
    the ones it learns (each seed of the twelfth session's lost another near-tie cell);
    part of the step keeps more of the former (``agent.pretrain.blend``)."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"blend fraction must lie in (0, 1], got {fraction}")
    if fraction == 1.0:
        return
    own = export_ppo(model, initial.feature_spec)
    if [w.shape for w in own.weights] != [w.shape for w in initial.weights]:
        raise ValueError(f"blend: the initial policy's layers are "
                         f"{[w.shape for w in initial.weights]}, the model's "
                         f"{[w.shape for w in own.weights]}")
    mixed = ExportedPolicy(
        weights=[w0 + fraction * (w - w0) for w0, w in zip(initial.weights, own.weights,
                                                            strict=True)],
        biases=[b0 + fraction * (b - b0) for b0, b in zip(initial.biases, own.biases,
                                                           strict=True)],
        actions=own.actions, feature_spec=own.feature_spec, activation=own.activation)
    load_exported(model, mixed, source="blend")
