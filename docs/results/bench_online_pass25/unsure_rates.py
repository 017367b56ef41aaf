"""How many streams each tolerance sends to the exact forward (twenty-fifth pass).

Grids recorded from a ControllerServer fed bench_online's telemetry (8 streams x 600
polls, the h200_llama31_8b profile, as ab_daemon.py feeds it), decided by the random
policy of ab_daemon/bench_online (seed 1) and by the shipped one. Per tolerance: the
rows and the streams (20 rows each) whose best two exact logits are within it.

    PYTHONPATH=. python docs/results/bench_online_pass25/unsure_rates.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from benchmarks.bench_online import telemetry
from controller import fast_tanh
from controller import server as server_module
from controller.default_policy import default_policy_path
from controller.policy_file import ExportedPolicy
from controller.reload import PolicyHolder
from env.sim.cost_model import load_profile


def record_grids(policy: ExportedPolicy, streams: int = 8, polls: int = 600) -> np.ndarray:
    folder = Path(tempfile.mkdtemp())
    path = folder / "policy.npz"
    policy.save(path)
    grids = []
    evaluate = server_module.evaluate

    def recording(policy, observations, *args, **kwargs):
        grids.append(np.array(observations))
        return evaluate(policy, observations, *args, **kwargs)

    server_module.evaluate = recording
    try:
        server = server_module.ControllerServer(
            PolicyHolder(path), server_module.ServeOptions(endpoint=f"ipc://{folder}/s.sock"),
            cost_prior=load_profile("h200_llama31_8b"))
        for k in range(polls):
            pending: dict = {}
            for i in range(streams):
                server.handle_frame((b"peer%d" % i, ""), telemetry(f"s{i}", k + 1, 32),
                                    pending, 0.0)
            server.decide(pending)
        server.close()
    finally:
        server_module.evaluate = evaluate
    return np.concatenate(grids)


def all_products_bound(policy: ExportedPolicy, largest: np.ndarray) -> np.ndarray:
    """The bound a forward with every product compiled needs (the patch next to this
    file): products_tolerance plus the first layer's rounding, 2 gamma(n+1)(s sum|w| +
    |b|) for a row whose largest |observation| is s, carried through the later layers."""
    u = 2.0 ** -24
    w0 = np.abs(policy.weights[0].astype(np.float64))
    m = w0.shape[0] + 1
    slope = 2 * m * u / (1 - m * u) * w0.sum(axis=0)
    offset = 2 * m * u / (1 - m * u) * np.abs(policy.biases[0].astype(np.float64))
    for w in policy.weights[1:]:
        slope = slope @ np.abs(w.astype(np.float64))
        offset = offset @ np.abs(w.astype(np.float64))
    return policy.products_tolerance + 2 * (largest * slope.max() + offset.max())


def main() -> None:
    for name, policy in (("random", ExportedPolicy.random(seed=1)),
                         ("shipped", ExportedPolicy.load(default_policy_path()))):
        grids = record_grids(policy)
        x = np.ascontiguousarray(grids.reshape(-1, grids.shape[-1]))
        best_two = np.sort(policy.logits(x), axis=1)[:, -2:]
        gap = (best_two[:, 1] - best_two[:, 0]).reshape(len(grids), -1)
        largest = np.abs(x).max(axis=1).reshape(gap.shape)
        for label, tol in (("tanh only (fast_tanh.tolerance)", policy.tanh_tolerance),
                           ("products_tolerance (kept)", policy.products_tolerance),
                           ("every product compiled (not kept)",
                            all_products_bound(policy, largest))):
            unsure = gap <= tol
            print(f"{name}: {label}: tol {np.max(tol):.3g}: rows {unsure.mean():.4f}, "
                  f"streams {unsure.any(axis=1).mean():.4f}")
    assert fast_tanh.forward_available()


if __name__ == "__main__":
    main()
