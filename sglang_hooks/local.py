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
and ignored. That ``specctl-serve`` is then the fleet hub: it pushes the policy it
serves when it connects and whenever it reloads (a POLICY message), and the plugin
decides with it from then on (:meth:`LocalDecisions.install`), until the hub pushes
another or the local policy file changes (the newer wins). A pushed policy that does
not validate is refused and counted; the one deciding stays.
"""

from __future__ import annotations

from collections.abc import Sequence

from controller.decider import StreamDecider
from controller.policy_file import ExportedPolicy, PolicyFileError
from controller.reload import PolicyHolder
from controller.wire import Decision, PolicyPush, decode


class LocalDecisions:
    """Decisions made in this process.

    Args:
        policy_path: The exported policy (loaded now; a bad file raises PolicyFileError).
        candidates: The steps this server offers.
        profile: The server's cost profile (a name or YAML path), or None.
        probe: The acceptance probe forced on (True) or off (False), whatever the policy
            file (or a pushed one) says; None: as it says (``SPECCTL_PROBE``).
        guard: The goodput guard forced on or off, likewise (``SPECCTL_GUARD``).
    """

    def __init__(self, policy_path: str, candidates: Sequence[int],
                 profile: str | None = None, probe: bool | None = None,
                 guard: bool | None = None) -> None:
        self.holder = PolicyHolder(policy_path)
        cost_prior = None
        if profile is not None:
            from env.sim.cost_model import load_profile

            cost_prior = load_profile(profile)
        self.decider = StreamDecider(self.holder.policy, candidates, cost_prior,
                                     _forced(probe), _forced(guard))
        #: SHA-256 of the policy deciding (the file's, or the last one the hub pushed).
        self.digest = self.holder.digest
        self._refused = ""  # the last pushed policy that failed to load: not tried again

    def decide(self, frame: bytes) -> Decision:
        """The decision answering one TELEMETRY frame; raises WireError on a bad frame."""
        if self.holder.poll():
            self.decider.set_policy(self.holder.policy)
            self.digest = self.holder.digest
        return self.decider.decide(decode(frame))

    def restart(self) -> None:
        """Start the stream afresh after :meth:`decide` raised (not on a bad frame)."""
        self.decider.restart()

    def install(self, push: PolicyPush) -> bool:
        """Decide with a policy the hub pushed; False if it is the one deciding already
        (or one refused before).

        Raises:
            PolicyFileError: the pushed file is not a valid policy (the old one stays).
        """
        if push.digest in (self.digest, self._refused):
            return False
        try:
            policy = ExportedPolicy.loads(push.blob,
                                          f"policy {push.name!r} pushed by specctl-serve")
        except PolicyFileError:
            self._refused = push.digest
            raise
        self.decider.set_policy(policy)
        self.digest = push.digest
        return True


def _forced(enabled: bool | None) -> dict | None:
    """The override of a rule forced on or off (None: none)."""
    return None if enabled is None else {"enabled": enabled}
