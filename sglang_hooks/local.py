"""The plugin's local decision mode (``SPECCTL_POLICY=<policy.npz>``).

The exported policy and the feature code ``specctl-serve`` runs
(:class:`controller.decider.StreamDecider`), evaluated in the scheduler process
on the controller client's I/O thread (never on the scheduler thread): each
step's telemetry is decoded exactly as the daemon decodes it and answered at
once, without a network round trip. The decision then goes the usual way
(:class:`~sglang_hooks.client.DecisionAge`, a marker through the broadcast), so
every rank still applies it at the same step. The policy file is reloaded when
it changes (a file that fails to load leaves the old policy deciding).

With ``SPECCTL_CONTROLLER`` set as well, telemetry still goes to that
``specctl-serve`` (its metrics and logs see the server); its answers are counted
and ignored.
"""

from __future__ import annotations

from collections.abc import Sequence

from controller.decider import StreamDecider
from controller.reload import PolicyHolder
from controller.wire import Decision, decode


class LocalDecisions:
    """Decisions made in this process.

    Args:
        policy_path: The exported policy (loaded now; a bad file raises PolicyFileError).
        candidates: The steps this server offers.
        profile: The server's cost profile (a name or YAML path), or None.
    """

    def __init__(self, policy_path: str, candidates: Sequence[int],
                 profile: str | None = None) -> None:
        self.holder = PolicyHolder(policy_path)
        cost_prior = None
        if profile is not None:
            from env.sim.cost_model import load_profile

            cost_prior = load_profile(profile)
        self.decider = StreamDecider(self.holder.policy, candidates, cost_prior)

    def decide(self, frame: bytes) -> Decision:
        """The decision answering one TELEMETRY frame; raises WireError on a bad frame."""
        if self.holder.poll():
            self.decider.set_policy(self.holder.policy)
        return self.decider.decide(decode(frame))
