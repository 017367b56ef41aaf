"""``specctl-serve``: serve an exported policy to SGLang servers running the specctl plugin.

Configuration: ``configs/serve.yaml`` (Hydra; override as ``key=value``).
SIGTERM/SIGINT stop it cleanly; SIGHUP reloads the policy file. Numpy only:
nothing here imports torch.
"""

from __future__ import annotations

import os

# The daemon answers many tiny matrix products: BLAS worker threads only add
# synchronisation (and steal cores from the servers). Must precede numpy's import.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import gc  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402

from omegaconf import DictConfig, OmegaConf  # noqa: E402

from agents.cli import hydra_app  # noqa: E402
from controller.decider import served_rules  # noqa: E402
from controller.default_policy import default_policy_path  # noqa: E402
from controller.metrics import Metrics  # noqa: E402
from controller.policy_file import PolicyFileError  # noqa: E402
from controller.reload import PolicyHolder  # noqa: E402
from controller.security import CurveConfig, UnsafeEndpointError  # noqa: E402
from controller.server import ControllerServer, ServeOptions  # noqa: E402
from controller.streams import keep_freed_memory  # noqa: E402
from env.sim.cost_model import load_profile  # noqa: E402

log = logging.getLogger("specctl.serve")


def serve(cfg: DictConfig, stop: threading.Event | None = None,
          own_process: bool = False) -> int:
    """Run the daemon until ``stop`` is set or a signal arrives; returns the exit code.

    ``own_process``: the process is the daemon's alone (``specctl-serve``): its allocator
    keeps freed memory (:func:`controller.streams.keep_freed_memory`) and, once set up,
    the garbage collector leaves the start-up objects alone (see :func:`_settle`).
    """
    if own_process:
        keep_freed_memory()
    logging.getLogger().setLevel(cfg.log_level)
    path = Path(cfg.policy) if cfg.policy else default_policy_path()
    try:
        holder = PolicyHolder(path, poll_s=float(cfg.reload_poll_s))
    except PolicyFileError as exc:
        log.error("cannot serve: %s", exc)
        return 2
    curve = None
    if cfg.curve.secret_key_file:
        curve = CurveConfig(cfg.curve.secret_key_file, cfg.curve.authorized_clients_dir)
    options = ServeOptions(
        endpoint=cfg.endpoint, shadow=bool(cfg.shadow), push_policies=bool(cfg.push_policies),
        max_streams=int(cfg.max_streams),
        max_streams_per_peer=int(cfg.max_streams_per_peer),
        new_streams_per_s=float(cfg.new_streams_per_s),
        stream_idle_s=float(cfg.stream_idle_s), max_drain=int(cfg.max_drain),
        max_drain_s=float(cfg.max_drain_ms) / 1e3,
        max_records_per_poll=int(cfg.max_records_per_poll),
        overload_busy_s=float(cfg.overload_busy_ms) / 1e3,
        overload_records_per_poll=int(cfg.overload_records_per_poll),
        answers_per_poll=int(cfg.answers_per_poll),
        log_every_s=float(cfg.log_every_s), curve=curve,
        ipc_allowed_uids=tuple(int(u) for u in cfg.ipc_allowed_uids or ()),
        probe=_changes(cfg, "probe"), guard=_changes(cfg, "guard"),
    )
    try:
        probe, guard = served_rules(holder.policy, {"probe": options.probe,
                                                    "guard": options.guard})
    except ValueError as exc:
        log.error("cannot serve: %s", exc)
        return 2
    cost_prior = None
    if cfg.profile:
        try:
            cost_prior = load_profile(cfg.profile)
        except (OSError, ValueError) as exc:
            log.error("cannot serve: profile %s: %s", cfg.profile, exc)
            return 2
    elif holder.policy.provenance.get("env", {}).get("cost_prior", "profile") == "profile":
        log.warning("this policy was trained with a cost profile as the latency prior; "
                    "serving without one (profile=null) it sees unfamiliar features. "
                    "Fit one from a recorded trace (specctl-fit-profile) and pass profile=...")
    metrics = Metrics()
    if cfg.metrics_port:  # before the ZeroMQ socket: a port in use leaves nothing bound
        try:
            metrics.serve(int(cfg.metrics_port), cfg.metrics_host)
        except OSError as exc:
            log.error("cannot serve metrics on %s:%s: %s", cfg.metrics_host, cfg.metrics_port,
                      exc)
            return 2
    try:
        server = ControllerServer(holder, options, metrics, cost_prior=cost_prior)
    except UnsafeEndpointError as exc:
        log.error("refusing to listen: %s", exc)
        metrics.close()
        return 2
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        signal.signal(signal.SIGHUP, lambda *_: holder.request_reload())
    log.info("serving policy %r (%s), profile %s, acceptance probe %s, goodput guard %s, "
             "on %s%s%s", holder.policy.name, path, cfg.profile,
             probe.to_dict() if probe.enabled else "off",
             guard.to_dict() if guard.enabled else "off", server.endpoint,
             " [shadow mode]" if options.shadow else "",
             f", metrics on :{metrics.port}" if metrics.port else "")
    if own_process:
        _settle()
    try:
        server.run(stop)
    finally:
        server.close()
        metrics.close()
        log.info("stopped")
    return 0


def _changes(cfg: DictConfig, name: str) -> dict | None:
    """The ``<name>.*`` overrides (``probe``, ``guard``) set (non-null) on the command
    line, or None."""
    block = cfg.get(name)
    if not block:
        return None
    changes = {str(k): v for k, v in OmegaConf.to_container(block, resolve=True).items()
               if v is not None}
    return changes or None


#: Allocations (less deallocations) between youngest-generation collections: 10,000, not
#: Python's 700. A poll's records and decisions die by reference counting; what a
#: collection finds is almost only the poll's survivors, so fewer collections cost less.
_GC_YOUNG_THRESHOLD = 10_000


def _settle() -> None:
    """After start-up: the collector never scans the start-up objects again (modules,
    the policy, numba's dispatchers: 55k objects; a full collection of them took 70-240
    ms in the daemon under load), and collects the young generation less often."""
    gc.freeze()
    gc.set_threshold(_GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


@hydra_app("serve", prog="specctl-serve")
def main(cfg: DictConfig) -> None:
    """Console entry point (``specctl-serve``)."""
    code = serve(cfg, own_process=True)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
