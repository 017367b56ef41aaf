"""The plugin's configuration, read once from environment variables.

The plugin is active only when at least one of ``SPECCTL_CONTROLLER``,
``SPECCTL_RECORD`` or ``SPECCTL_FALLBACK`` is set. Otherwise a scheduler process
only follows a source rank elsewhere in its TP group (see
:mod:`sglang_hooks.plugin`), and is SGLang unchanged when there is none.

==========================  ===================================================
variable                    meaning
==========================  ===================================================
SPECCTL_CONTROLLER          controller endpoint, e.g. ``ipc:///tmp/specctl-serve.sock``
                            or ``tcp://127.0.0.1:5557``
SPECCTL_FALLBACK            rule used when no fresh controller decision exists:
                            ``sglang`` (default: SGLang's own adaptive rule) or
                            ``table:<json or path>``, e.g. ``table:{"1": 3, "32": 1, "64": 0}``
                            (batch size -> steps, largest key <= batch size wins)
SPECCTL_TIMEOUT_MS          a telemetry message unanswered this long means the
                            controller is gone: fall back (default 100, at least 10)
SPECCTL_IO_POLL_US          how often the plugin's I/O thread looks for telemetry to
                            send and decisions to read while telemetry flows (default
                            5000, local mode 100; 10-20000): each look takes the GIL
                            from the scheduler thread, a longer one delays decisions
SPECCTL_IO_PLAIN_LOOKS      1: the I/O thread looks as before 2 December midday (asks
                            ZeroMQ's EVENTS every look, pyzmq's send and receive, which
                            let go of the GIL per frame, every decision decoded in full),
                            for A/B runs (default 0)
SPECCTL_IO_HELD_SEND        1: the I/O thread's sends keep the GIL too, as its receives
                            do (default 0: pyzmq's send, which lets go of it), for A/B
                            runs
SPECCTL_OFF_PATH            what a step decided 0 runs: ``decode`` (default: the
                            target's plain decode CUDA graph, no draft work; see
                            :mod:`sglang_hooks.offswitch`) or ``sglang`` (SGLang's
                            own steps=0: verify forward plus draft extend)
SPECCTL_OFF_PREFILL         what a prefill while off runs: ``skip`` (default: the
                            target alone, as without speculation; the draft holds no
                            KV for that prompt) or ``draft`` (EAGLE's prefill work too);
                            read on every TP rank, skipped only if all say ``skip``
SPECCTL_PROBE               local mode (``SPECCTL_POLICY``): ``1`` / ``0`` turns the
                            policy's acceptance probe (:mod:`env.probe`) on / off
                            whatever its file says (default: as the file says)
SPECCTL_GUARD               local mode (``SPECCTL_POLICY``): ``1`` / ``0`` turns the
                            policy's goodput guard (:mod:`env.guard`) on / off
                            whatever its file says (default: as the file says)
SPECCTL_RECORD              directory: record every step to a Parquet trace
SPECCTL_RECORD_EXPLORE      ``1``: instead of a controller, cycle through every
                            candidate depth (all ranks in lock-step) while recording
SPECCTL_EXPLORE_DWELL       steps spent at each depth when exploring (default 4)
SPECCTL_MIN_SWITCH_STEPS    fewest steps between two depth switches outside exploration
                            (default 4; 1 = switch whenever asked)
SPECCTL_RECORD_FLUSH_S      write a trace file at least this often (default 30)
SPECCTL_HOOK_TIMING         file prefix: measure the plugin's time on the scheduler
                            thread per step and write its percentiles there (JSON)
SPECCTL_HOOK_TIMING_CPU     ``1``: with SPECCTL_HOOK_TIMING, split that time into time
                            on the CPU and off it (a diagnosis: costs a system call
                            per clock reading, subtracted)
SPECCTL_SERVER              server name in telemetry and traces (default
                            ``<hostname>-<port>``)
SPECCTL_CURVE_SERVER_KEY    the controller's CURVE public key (Z85); enables CURVE
SPECCTL_CURVE_CLIENT_CERT   this server's CURVE certificate file (default: a fresh
                            key pair per process)
SPECCTL_ALLOW_UNTESTED_SGLANG  ``1``: register on an SGLang version other than the
                            tested ones if its source passes a tested version's
                            contract (read even when the plugin is not enabled)
SPECCTL_WARMUP_MAX_BS       the largest batch of the start-up warm-up (``--warmups
                            specctl``, :mod:`sglang_hooks.warmup`; read in the HTTP
                            server process when it runs): one batch per power-of-two
                            bucket up to this one (default ``--max-running-requests``,
                            else 64)
SPECCTL_WARMUP_TOKENS       output tokens per warm-up request (default 64, 8-1024):
                            enough for every candidate depth to run at each batch size
==========================  ===================================================

The warm-up variables do not enable the plugin: ``--warmups specctl`` does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sglang_hooks.offswitch import OFF_PATHS, OFF_PREFILLS

ACTIVATING = ("SPECCTL_CONTROLLER", "SPECCTL_POLICY", "SPECCTL_RECORD", "SPECCTL_FALLBACK")


class ConfigError(ValueError):
    """An environment variable has a value the plugin cannot use; says which."""


@dataclass(frozen=True)
class PluginConfig:
    """Everything the plugin reads from the environment."""

    controller: str | None = None
    #: "sglang", "table" or "explore" (cycle through every candidate depth).
    fallback: str = "sglang"
    #: Sorted (batch size, steps) pairs of the table rule.
    table: tuple[tuple[int, int], ...] = ()
    timeout_s: float = 0.1
    #: The I/O thread's look interval while telemetry flows (None: the client's default).
    io_poll_s: float | None = None
    #: The I/O thread's looks as before the lean ones (SPECCTL_IO_PLAIN_LOOKS): A/B runs.
    io_plain_looks: bool = False
    #: The I/O thread's sends keep the GIL (SPECCTL_IO_HELD_SEND): A/B runs.
    io_held_send: bool = False
    record_dir: str | None = None
    record_explore: bool = False
    explore_dwell: int = 4
    #: Fewest scheduler steps between two depth switches (1: no dwell).
    min_switch_steps: int = 4
    record_flush_s: float = 30.0
    #: Where to write the plugin's per-step time on the scheduler thread (None: off).
    hook_timing: str | None = None
    hook_timing_cpu: bool = False
    server: str | None = None
    curve_server_key: str | None = None
    curve_client_cert: str | None = None
    #: What a step decided 0 runs (one of ``offswitch.OFF_PATHS``).
    off_path: str = "decode"
    #: What a prefill while off runs (one of ``offswitch.OFF_PREFILLS``).
    off_prefill: str = "skip"
    #: Local decision mode: this exported policy, evaluated in this process (None: the
    #: controller decides); ``profile`` is the features' cost prior, as ``specctl-serve``'s.
    policy: str | None = None
    profile: str | None = None
    #: Local mode: the acceptance probe forced on or off (None: as the policy file says).
    probe: bool | None = None
    #: Local mode: the goodput guard forced on or off (None: as the policy file says).
    guard: bool | None = None

    @property
    def rule(self) -> str:
        """The local rule every rank runs when the controller is not in charge."""
        return "explore" if self.record_explore else self.fallback


def from_env(env: Mapping[str, str] | None = None) -> PluginConfig | None:
    """The configuration, or None when the plugin is not enabled; raises ConfigError."""
    env = os.environ if env is None else env
    if not any(env.get(name) for name in ACTIVATING):
        return None
    controller = env.get("SPECCTL_CONTROLLER") or None
    if controller is not None and not controller.startswith(("ipc://", "tcp://", "inproc://")):
        raise ConfigError(
            f"SPECCTL_CONTROLLER={controller!r}: expected ipc://PATH or tcp://HOST:PORT"
        )
    policy = env.get("SPECCTL_POLICY") or None
    if policy is not None and not Path(policy).is_file():
        raise ConfigError(f"SPECCTL_POLICY={policy!r}: no such policy file")
    profile = env.get("SPECCTL_PROFILE") or None
    if profile is not None and policy is None:
        raise ConfigError("SPECCTL_PROFILE is the local mode's cost prior: it needs "
                          "SPECCTL_POLICY=<policy.npz> as well")
    probe = _local_rule(env, "SPECCTL_PROBE", "acceptance probe", "probe", policy)
    guard = _local_rule(env, "SPECCTL_GUARD", "goodput guard", "guard", policy)
    fallback, table = _fallback(env.get("SPECCTL_FALLBACK") or "sglang")
    explore = _flag(env, "SPECCTL_RECORD_EXPLORE")
    record_dir = env.get("SPECCTL_RECORD") or None
    if explore and record_dir is None:
        raise ConfigError("SPECCTL_RECORD_EXPLORE=1 needs SPECCTL_RECORD=<dir> as well")
    hook_timing = env.get("SPECCTL_HOOK_TIMING") or None
    hook_timing_cpu = _flag(env, "SPECCTL_HOOK_TIMING_CPU")
    if hook_timing_cpu and hook_timing is None:
        raise ConfigError("SPECCTL_HOOK_TIMING_CPU=1 splits the hook timing's clock: it "
                          "needs SPECCTL_HOOK_TIMING=<file prefix> as well")
    return PluginConfig(
        controller=controller,
        fallback=fallback,
        table=table,
        # Below ~10 ms, scheduling jitter of the client's I/O thread alone could look
        # like silence.
        timeout_s=_number(env, "SPECCTL_TIMEOUT_MS", 100.0, lo=10.0) / 1e3,
        io_poll_s=(_number(env, "SPECCTL_IO_POLL_US", 5000.0, lo=10.0, hi=20_000.0) / 1e6
                   if env.get("SPECCTL_IO_POLL_US") else None),
        io_plain_looks=_flag(env, "SPECCTL_IO_PLAIN_LOOKS"),
        io_held_send=_flag(env, "SPECCTL_IO_HELD_SEND"),
        record_dir=record_dir,
        record_explore=explore,
        explore_dwell=int(_number(env, "SPECCTL_EXPLORE_DWELL", 4, lo=1)),
        min_switch_steps=int(_number(env, "SPECCTL_MIN_SWITCH_STEPS", 4, lo=1)),
        record_flush_s=_number(env, "SPECCTL_RECORD_FLUSH_S", 30.0, lo=0.1),
        hook_timing=hook_timing,
        hook_timing_cpu=hook_timing_cpu,
        server=env.get("SPECCTL_SERVER") or None,
        curve_server_key=env.get("SPECCTL_CURVE_SERVER_KEY") or None,
        curve_client_cert=env.get("SPECCTL_CURVE_CLIENT_CERT") or None,
        off_path=_off_path(env.get("SPECCTL_OFF_PATH") or "decode"),
        off_prefill=off_prefill(env),
        policy=policy,
        profile=profile,
        probe=probe,
        guard=guard,
    )


def _local_rule(env: Mapping[str, str], name: str, what: str, block: str,
                policy: str | None) -> bool | None:
    """``name`` (``1`` / ``0``): the local mode's rule ``what`` forced on / off; None where
    unset. Only local mode reads it: a ConfigError without ``SPECCTL_POLICY``."""
    if not env.get(name):
        return None
    forced = _flag(env, name)
    if policy is None:
        raise ConfigError(f"{name} sets the local mode's {what}: it needs "
                          f"SPECCTL_POLICY=<policy.npz> as well (specctl-serve takes "
                          f"{block}.enabled=...)")
    return forced


@dataclass(frozen=True)
class WarmupSettings:
    """The start-up warm-up's settings (:mod:`sglang_hooks.warmup`)."""

    #: Largest batch of the ramp (None: the server's ``--max-running-requests``, else 64).
    max_bs: int | None = None
    #: Output tokens per warm-up request.
    tokens: int = 64


def warmup_settings(env: Mapping[str, str] | None = None) -> WarmupSettings:
    """``SPECCTL_WARMUP_MAX_BS`` and ``SPECCTL_WARMUP_TOKENS``; raises ConfigError."""
    env = os.environ if env is None else env
    max_bs = (int(_number(env, "SPECCTL_WARMUP_MAX_BS", 64, lo=1, hi=65536))
              if env.get("SPECCTL_WARMUP_MAX_BS") else None)
    return WarmupSettings(max_bs=max_bs,
                          tokens=int(_number(env, "SPECCTL_WARMUP_TOKENS", 64, lo=8, hi=1024)))


def follower_off_path(env: Mapping[str, str] | None = None) -> str:
    """The off path of a rank without other ``SPECCTL_*`` variables: ``sglang`` (SGLang
    untouched, no extra CUDA graphs) unless ``SPECCTL_OFF_PATH=decode`` is set here too."""
    env = os.environ if env is None else env
    return _off_path(env.get("SPECCTL_OFF_PATH") or "sglang")


def off_prefill(env: Mapping[str, str] | None = None) -> str:
    """``SPECCTL_OFF_PREFILL`` (``skip`` unless set), on any rank: the TP group agrees."""
    env = os.environ if env is None else env
    value = env.get("SPECCTL_OFF_PREFILL") or "skip"
    if value not in OFF_PREFILLS:
        raise ConfigError(f"SPECCTL_OFF_PREFILL={value!r}: expected one of "
                          f"{', '.join(OFF_PREFILLS)}")
    return value


def allow_untested(env: Mapping[str, str] | None = None) -> bool:
    """``SPECCTL_ALLOW_UNTESTED_SGLANG``: may the plugin run on an untested SGLang version?"""
    return _flag(os.environ if env is None else env, "SPECCTL_ALLOW_UNTESTED_SGLANG")


def parse_table(text: str) -> tuple[tuple[int, int], ...]:
    """``{"1": 3, "32": 1}`` -> ((1, 3), (32, 1)); raises ConfigError."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"SPECCTL_FALLBACK table is not JSON ({exc})") from None
    if not isinstance(data, dict) or not data:
        raise ConfigError('SPECCTL_FALLBACK table must be a non-empty object {"batch": steps}')
    pairs = []
    for key, steps in data.items():
        if not str(key).isdigit() or int(key) < 1 or type(steps) is not int or steps < 0:
            raise ConfigError(
                f"SPECCTL_FALLBACK table entry {key!r}: {steps!r}: keys must be batch sizes "
                "(\"1\", \"8\", ...) and values steps >= 0"
            )
        pairs.append((int(key), steps))
    return tuple(sorted(pairs))


def _off_path(value: str) -> str:
    if value not in OFF_PATHS:
        raise ConfigError(f"SPECCTL_OFF_PATH={value!r}: expected one of {', '.join(OFF_PATHS)}")
    return value


def _fallback(value: str) -> tuple[str, tuple[tuple[int, int], ...]]:
    if value in ("sglang", "explore"):  # explore: every depth in turn (switching tests)
        return value, ()
    if value.startswith("table:"):
        spec = value[len("table:"):].strip()
        if not spec.startswith("{"):
            path = Path(spec)
            try:
                spec = path.read_text()
            except OSError as exc:
                raise ConfigError(f"SPECCTL_FALLBACK table file {path}: {exc}") from None
        return "table", parse_table(spec)
    raise ConfigError(f"SPECCTL_FALLBACK={value!r}: expected 'sglang', 'explore' or "
                      "'table:<json or path>'")


def _flag(env: Mapping[str, str], name: str) -> bool:
    value = (env.get(name) or "0").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"{name}={value!r}: expected 0 or 1")


def _number(env: Mapping[str, str], name: str, default: float, lo: float,
            hi: float = float("inf")) -> float:
    text = env.get(name)
    if not text:
        return float(default)
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r}: not a number") from None
    if not value >= lo:
        raise ConfigError(f"{name}={text!r}: must be >= {lo}")
    if not value <= hi:
        raise ConfigError(f"{name}={text!r}: must be <= {hi}")
    return value
