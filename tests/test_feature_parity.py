"""Training and serving build identical observations from one telemetry stream.

The environment's path: the simulator's step records, released to the feature
module with the feedback lag by :class:`env.rollout.DecisionLoop`. The serving
path: the same records encoded on the wire, sent over a real ZeroMQ socket to the
real :class:`controller.server.ControllerServer`, decoded and folded into its
per-stream feature module. After each decision, the controller's observation for
the decided batch size must equal the environment's bit for bit, and so must the
decision the policy takes on it.
"""

from __future__ import annotations

import numpy as np
import zmq

from controller.policy_file import ExportedPolicy
from controller.reload import PolicyHolder
from controller.server import ControllerServer, ServeOptions
from controller.wire import decode, encode_step
from env.rollout import DecisionLoop
from env.sim.acceptance import SGLangSimulatedAcceptance
from env.sim.cost_model import load_profile
from env.sim.simulator import Simulator
from env.traces.workloads import ClosedLoop
from sglang_hooks.testing import socket_dir


def test_env_and_controller_observations_are_identical(tmp_path):
    profile = load_profile("h200_llama31_8b")
    policy = ExportedPolicy.random(seed=10, name="parity")  # one whose choices vary here
    policy.save(tmp_path / "policy.npz")
    spec = policy.feature_spec
    sim = Simulator(profile, SGLangSimulatedAcceptance(3.5), ClosedLoop(24, 300, 90), seed=4)
    loop = DecisionLoop(sim, spec, feedback_lag=3, horizon_s=1.5, cost_prior=profile)
    released = []  # what the environment's feature module was fed, in order
    feed = loop.features.update
    loop.features.update = lambda record: (released.append(record), feed(record))[1]

    endpoint = f"ipc://{socket_dir()}/c.sock"
    server = ControllerServer(PolicyHolder(tmp_path / "policy.npz"),
                              ServeOptions(endpoint=endpoint), cost_prior=profile)
    client = zmq.Context.instance().socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    client.connect(server.endpoint)
    sent = 0
    decisions = 0
    try:
        obs = loop.reset(seed=4)
        while obs is not None:
            for record in released[sent:]:
                client.send(encode_step(record))
            if len(released) > sent:
                last = released[-1].step_index
                for _ in range(100):  # until the controller has folded in every record
                    server.poll_once(100)
                    stream = next((s for s in server.streams if s.key[1:] == (sim.server, 0)),
                                  None)
                    if stream is not None and stream.last_step == last:
                        break
                assert stream.last_step == last
                while client.poll(100):  # its decisions (one per poll with new records)
                    decode(client.recv())
                sent = len(released)
                grid = np.asarray(stream.builder.observation_grid())
                row = spec.batch_grid.index(spec.grid_floor(obs.batch_size))
                assert np.array_equal(grid[row], obs.vector), f"decision {decisions}"
                assert policy.act(grid)[row] == policy.act(obs.vector)
                decisions += 1
            obs, _ = loop.step(policy.act(obs.vector))
    finally:
        client.close(0)
        server.close()
    assert decisions > 50
    assert len({r.steps_used for r in released if r.is_decode}) > 1  # the policy varied
    assert any(not r.is_decode for r in released)  # prefill records crossed the wire too
