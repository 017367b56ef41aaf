"""The policy map: the depth a policy chooses, by load and acceptance, in the simulator.

Each cell is one closed-loop run of the ``specctl-bench`` code path
(:func:`agents.bench.run_cell`): C clients sending requests back to back to the
profile's simulated server, drafts accepted with a fixed per-position rate, and the
policy seeing exactly what it sees in every rollout and in ``specctl-serve`` (lagged
telemetry through the feature module, the cost profile as the latency prior). The
cell shows the depth chosen on most decode steps and on what share of them.

An earlier map fed the feature module synthetic telemetry that visited every depth
and no cost prior; the policy then saw inputs it never sees in a rollout, and the map
showed depths 3-7 where the sweep's rollouts chose 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

from agents.bench import run_cell
from agents.progress import run_all

matplotlib.use("Agg")  # files only
import matplotlib.pyplot as plt

CONCURRENCY = (1, 4, 16, 64, 128, 256)
ACCEPT_RATES = (0.3, 0.5, 0.7, 0.8, 0.9)


@dataclass(frozen=True)
class PolicyMap:
    """Depth chosen most often (``depth``) and its share of decode steps (``share``),
    indexed ``[acceptance rate, concurrency]``."""

    policy: str
    profile: str
    concurrency: tuple[int, ...]
    accept_rates: tuple[float, ...]
    depth: np.ndarray
    share: np.ndarray

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form (for ``results.json``)."""
        return {"policy": self.policy, "profile": self.profile,
                "concurrency": list(self.concurrency), "accept_rates": list(self.accept_rates),
                "depth": self.depth.tolist(), "share": np.round(self.share, 3).tolist()}


def policy_map(settings: Mapping[str, Any], policy: str = "ppo",
               concurrency: Sequence[int] = CONCURRENCY,
               accept_rates: Sequence[float] = ACCEPT_RATES) -> PolicyMap:
    """Run every (acceptance rate, concurrency) cell; ``settings`` is a bench config."""
    max_depth = int(settings["max_depth"])
    tasks = [({**settings, "acceptance": {"model": "parametric", "alphas": [a] * max_depth}},
              policy, int(c)) for a in accept_rates for c in concurrency]
    runs = run_all(run_cell, tasks, workers=int(settings.get("workers", 1)),
                   desc=f"policy map {settings['profile']}")
    depth = np.zeros((len(accept_rates), len(concurrency)), dtype=int)
    share = np.zeros(depth.shape)
    for k, run in enumerate(runs):
        counts = np.asarray(run.steps_chosen, dtype=float)
        i, j = divmod(k, len(concurrency))
        depth[i, j] = int(np.argmax(counts))
        share[i, j] = counts.max() / counts.sum() if counts.sum() else 0.0
    return PolicyMap(policy, str(settings["profile"]), tuple(int(c) for c in concurrency),
                     tuple(float(a) for a in accept_rates), depth, share)


def plot_policy_map(result: PolicyMap, path: Path, max_depth: int = 7) -> None:
    """A heat map of the depth chosen, each cell labelled "depth (share)"."""
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    image = ax.imshow(result.depth, origin="lower", aspect="auto", cmap="viridis",
                      vmin=0, vmax=max_depth)
    ax.set_xticks(range(len(result.concurrency)), [str(c) for c in result.concurrency])
    ax.set_yticks(range(len(result.accept_rates)), [f"{a:.1f}" for a in result.accept_rates])
    for (i, j), depth in np.ndenumerate(result.depth):
        color = "black" if depth > 0.6 * max_depth else "white"  # readable on viridis
        ax.text(j, i, f"{depth}\n{result.share[i, j]:.0%}", ha="center", va="center",
                color=color, fontsize=8)
    ax.set_xlabel("concurrent clients C (closed loop, requests back to back)")
    ax.set_ylabel("per-position acceptance rate\n(P(draft i accepted | draft i-1 was))")
    ax.set_title(f"{result.policy} on {result.profile} (simulated): depth chosen on most "
                 "decode steps\n(share of steps below it; depth 0 = speculation off)",
                 fontsize=10)
    fig.colorbar(image, ax=ax, label="speculation depth (draft steps)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
