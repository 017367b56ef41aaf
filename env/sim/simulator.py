"""A continuous-batching simulator of an SGLang server running EAGLE chain speculation.

One call to :meth:`Simulator.decode` is one decode scheduler step; prefill steps
and idle gaps between arrivals are simulated by :meth:`Simulator.advance`. The
model follows SGLang's default scheduler:

* **Admission.** Requests wait in a FIFO queue. A prefill (extend) step admits
  requests from its head while the running-request limit, the chunked-prefill
  token budget and the KV capacity allow; a prompt longer than the budget is
  prefilled in chunks over several steps. Prefill steps take priority over
  decode steps and do not decode (no mixed chunks). The prefill step that
  finishes a prompt emits the request's first output token.
* **Decode.** Every decoding request verifies ``depth`` draft tokens; with
  ``A[p]`` the drafts its acceptance table accepts at position ``p`` (see
  :mod:`env.sim.acceptance`), it commits ``min(A[p], depth) + 1`` tokens, never more
  than it still has to produce.
* **KV cache.** A request holds ``prompt + generated`` slots; a decode step
  reserves ``depth + 1`` slots per request while it runs. If that does not fit,
  the most recently admitted requests are retracted (their slots freed, put
  back at the head of the queue, re-prefilled with their output so far later),
  as SGLang does. KV use never exceeds the capacity.
* **steps = 0.** ``zero_step`` says what a depth-0 decode step is:

  - ``off`` (default): speculation really off, as the plugin's off path does it
    (the target's plain decode graph, no draft work): the step costs what it
    costs a server without speculation (``CostProfile`` with
    ``speculative_path=False``). The draft model sees none of these tokens. So,
    as the plugin's ``OffSwitch.choose`` does (with ``reentry_warmup``, off by default),
    the first decode step asked for depth > 0 after an off step is the *warm-up*:
    SGLang's own steps=0 with the draft extend over the newest token (one token
    per request, no drafts, ``steps_used`` 0 in its record and ``warmup`` True, the
    ``sglang_steps0`` cost; every other record of this mode says ``warmup`` False, as
    the plugin with its off path reports; ``sglang_steps0``'s records None), after
    which the draft is warm; drafting resumes on the next step asked
    for depth > 0 (a step asked for 0 right after the warm-up is off again, and
    the next one back warms up again). Without ``reentry_warmup`` that first step
    drafts at once from a cold state instead (its accepted drafts scaled by
    ``cold_recovery_accept_fraction``). Either way the requests that decoded
    while off keep stale draft KV entries: their acceptance stays scaled by
    ``1 - stale_accept_loss`` until they finish or are re-prefilled. A prefill
    after an off step (before the warm-up) skips the draft's extend over the
    prompt, as the plugin does (``SPECCTL_OFF_PREFILL=skip``): it costs what it
    costs without speculation, and its requests start with stale draft KV
    (``skip_prefill_while_off``).
  - ``sglang_steps0``: SGLang's own ``steps=0``, still on the speculative path
    (``c_steps0`` terms) and, by default, running the draft extend (its cost is
    paid, speculation resumes warm). With ``skip_zero_step_draft_extend`` the
    extend is skipped and the first speculative step after it is cold
    (``cold_recovery_accept_fraction``; no warm-up: that is the plugin's).
* **Time.** Each step lasts ``profile.step_latency_s(...)``; time only moves
  forward, and jumps to the next arrival when the server is idle.
* **The prefill's launch** (``profile.prefill_launch_s`` > 0). SGLang's overlap scheduler
  launches the next batch before it processes a step's result, and the plugin times a step
  from the previous result to its own, so a decode step whose next step is a prefill
  carries the prefill's launch, less what its own GPU work hides
  (``CostProfile.prefill_launch_booked_s`` of its own latency; measured on the H200, runs
  46-69, ``docs/results/gpu22``). After a decode step the simulator decides, as it always
  has, whether a prefill is due next (the arrivals up to the step's end, its finished
  requests still riding with ``finish_lag_steps``); if so the step's record and the clock
  take the booked time, the answers of the requests it finished come at its new end (the
  result is processed after the launch), and the prefill that follows, composed of the
  requests waiting at the step's own end (it was launched then), is that much shorter
  (never below 0): the time is moved, not added, so the sum of the step latencies and the
  clock are what they were without it (a prefill cheaper than the booking keeps 0 and the
  rest stays added). What is scheduled is the same as without it (a closed loop's client
  still sends its next request from the step's own end). Its records say
  ``before_prefill``, as the plugin's do: True on a decode step whose next step is a
  prefill launched meanwhile (booked or hidden), False on every other record (a prefill
  books no launch here). 0 books nothing and flags nothing (``before_prefill`` None: the
  features infer it from the next record): the simulator of before, step for step.

Workloads are open-loop (:class:`env.traces.workloads.Workload`: arrivals from a trace)
or closed-loop (:class:`env.traces.workloads.ClosedLoop`: C clients, each sending its
next request when the previous one finishes). A closed loop's
``client_overhead_s`` is time each request spends outside the server (request
transfer, HTTP handling, the response's way back): a request reaches the
server that long after its client sent it.

The hot path works on numpy arrays of the running batch only; per-request
Python work happens only when requests arrive, are admitted or finish.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from env.sim.cost_model import prefill_pairs
from env.traces.schema import StepRecord

_EMPTY_I8 = np.zeros(0, dtype=np.int8)

#: Values of ``SchedulerConfig.zero_step``.
ZERO_STEP_MODES = ("off", "sglang_steps0")
#: ``CostProfile.step_latency_s`` flags of the plugin's warm-up step
#: (``SchedulerConfig.reentry_warmup``): SGLang's steps=0, on the speculative path, with
#: the draft extend (``zero_step="sglang_steps0"``'s depth-0 step).
WARMUP_LATENCY_FLAGS = MappingProxyType({"draft_extend": True, "speculative_path": True})


@dataclass(frozen=True)
class SchedulerConfig:
    """Server limits and speculation settings of the simulated SGLang server."""

    max_running_requests: int = 256
    kv_capacity_tokens: int = 500_000
    chunked_prefill_tokens: int = 8192
    max_depth: int = 7
    #: What a depth-0 decode step is: ``off`` (a server without speculation) or
    #: ``sglang_steps0`` (SGLang's steps=0 on the speculative path).
    zero_step: str = "off"
    skip_zero_step_draft_extend: bool = False
    #: Share of the accepted drafts kept by the first speculative step after a cold
    #: interval (steps=0 without the draft extend, or off without ``reentry_warmup``);
    #: 1 = no re-entry penalty.
    cold_recovery_accept_fraction: float = 0.5
    #: ``zero_step="off"`` only: the first decode step asked for depth > 0 after an off
    #: step runs SGLang's steps=0 once with the draft extend instead (the plugin's
    #: warm-up, ``sglang_hooks.offswitch.OffSwitch.choose``: ``steps_used`` 0, one token
    #: per request), and the draft is warm after it. False: that step drafts at the
    #: asked depth from a cold state (``cold_recovery_accept_fraction``), as the
    #: simulator did before the seventeenth session. False by default for now: the shipped
    #: policy was trained and evaluated without it (with it, the shipped file meets 89 of
    #: 96 cells at evaluation seed 0 against 95, mostly through the oracle's re-entry
    #: price), and on the shipped file's H200 cells it moved the simulated TPOT further
    #: from the measured (runs 46-50: mean error 3.70% against 0.88%), closer on run 44 at
    #: 8 req/s (docs/results/warm17/README.md). Those replays let the policy run depth 2,
    #: which those servers did not offer; with the server's steps and the plugin's switch
    #: hold the warm-up moves the simulated decisions toward the GPU's
    #: (docs/results/fid18/README.md). Turn it on to train a policy whose
    #: features leave the warm-up out (FeatureSpec.drop_warmup_latency).
    reentry_warmup: bool = False
    #: Lasting acceptance loss of requests that decoded while speculation was off.
    stale_accept_loss: float = 0.0
    #: ``zero_step="off"`` only: a prefill after an off step runs without the draft's
    #: extend over the prompt (the plugin's ``SPECCTL_OFF_PREFILL=skip``, its default), so
    #: its requests keep stale draft KV like those that decoded while off.
    skip_prefill_while_off: bool = True
    #: Decode steps a finished request still rides in the batch. SGLang's overlap
    #: scheduler (its default) launches step k+1 before it processes step k's results, so
    #: a request that finished in step k is in step k+1's batch too: in every recorded
    #: H200 trace (runs 8-9, depths 0-3, both models) each request rode exactly one decode
    #: step more than its tokens needed. The client has its answer after step k; the slot
    #: and the KV cache are freed after step k+1. 0 frees them at once (no overlap).
    finish_lag_steps: int = 0
    #: SGLang's radix (prefix) cache, on by default in SGLang: a prompt's leading blocks
    #: that a finished request left in the KV pool, or that a running request holds, are
    #: not computed again (blocks in use are shared, not evicted). Needs a
    #: workload that knows its prompts' blocks (``Workload.prefix_blocks``: Mooncake's
    #: ``hash_ids``; 64% of the shipped Mooncake trace's blocks repeat an earlier
    #: prompt's prefix); without it every prefill is whole, as ``--disable-radix-cache``.
    prefix_cache: bool = False
    #: Fewest scheduler steps (prefill and decode, SGLang's ``forward_ct``) between two
    #: depth switches: a decode step asked for another depth within that many steps of the
    #: last switch runs the current one (the plugin's ``SPECCTL_MIN_SWITCH_STEPS``, 4 by
    #: default, ``sglang_hooks/policy.py``; the warm-up replaces the first step back on
    #: after the hold, as ``OffSwitch.choose`` runs after it). 0 or 1: no hold, every
    #: decision runs at once (what training and evaluation simulate).
    min_switch_steps: int = 0

    def __post_init__(self) -> None:
        if self.zero_step not in ZERO_STEP_MODES:
            raise ValueError(f"zero_step must be one of {ZERO_STEP_MODES}, got {self.zero_step!r}")
        if not 0.0 <= self.stale_accept_loss <= 1.0:
            raise ValueError("stale_accept_loss must lie in [0, 1]")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.chunked_prefill_tokens < 1:
            raise ValueError("chunked_prefill_tokens must be >= 1")
        if self.kv_capacity_tokens < 2:
            raise ValueError("kv_capacity_tokens must be >= 2")
        if not 0.0 <= self.cold_recovery_accept_fraction <= 1.0:
            raise ValueError("cold_recovery_accept_fraction must lie in [0, 1]")
        if self.finish_lag_steps < 0:
            raise ValueError("finish_lag_steps must be >= 0")
        if self.min_switch_steps < 0:
            raise ValueError("min_switch_steps must be >= 0")

    @classmethod
    def from_profile(cls, profile, **overrides) -> SchedulerConfig:
        """Server limits from a cost profile's ``server`` section, with overrides."""
        limits = {
            "max_running_requests": profile.server.max_running_requests,
            "kv_capacity_tokens": profile.server.kv_capacity_tokens,
            "chunked_prefill_tokens": profile.server.chunked_prefill_tokens,
        }
        limits.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**limits)

    def latency_flags(self, depth: int) -> dict[str, bool]:
        """``draft_extend`` / ``speculative_path`` of a decode step at ``depth``
        (the keyword arguments of ``CostProfile.step_latency_s``)."""
        if depth > 0:
            return {"draft_extend": True, "speculative_path": True}
        if self.zero_step == "off":
            return {"draft_extend": False, "speculative_path": False}
        return {"draft_extend": not self.skip_zero_step_draft_extend, "speculative_path": True}

    @property
    def warms_up(self) -> bool:
        """Whether the first step back on after an off step is the plugin's warm-up."""
        return self.zero_step == "off" and self.reentry_warmup

    @property
    def zero_step_is_cold(self) -> bool:
        """Whether a depth-0 step leaves the draft model behind (no draft extend)."""
        return self.zero_step == "off" or self.skip_zero_step_draft_extend


@dataclass(frozen=True)
class RequestStats:
    """Per-request outcome of a run (NaN where a request did not get that far)."""

    arrival_s: np.ndarray
    first_token_s: np.ndarray
    finish_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray

    @property
    def finished(self) -> np.ndarray:
        """Mask of the requests that finished."""
        return ~np.isnan(self.finish_s)

    @property
    def tpot_s(self) -> np.ndarray:
        """Time per output token after the first, for finished requests."""
        done = self.finished & (self.output_tokens > 1)
        return (self.finish_s[done] - self.first_token_s[done]) / (self.output_tokens[done] - 1)

    @property
    def e2e_s(self) -> np.ndarray:
        """End-to-end latency of finished requests."""
        done = self.finished
        return self.finish_s[done] - self.arrival_s[done]


class _RequestTable:
    """Growable columnar store of requests.

    Entries ``[0, size)`` have arrived; entries ``[size, drawn)`` are drawn ahead
    (lengths and acceptance) for a closed loop to hand out without per-request work.
    """

    def __init__(self, capacity: int) -> None:
        self.size = 0
        self.drawn = 0
        self.arrival = np.zeros(capacity)
        self.prompt = np.zeros(capacity, dtype=np.int64)
        self.output = np.zeros(capacity, dtype=np.int64)
        self.acc_base = np.zeros(capacity, dtype=np.int64)
        self.generated = np.zeros(capacity, dtype=np.int64)
        self.first_token = np.full(capacity, np.nan)
        self.finish = np.full(capacity, np.nan)
        self.client = np.full(capacity, -1, dtype=np.int64)
        self.acc_values = np.zeros(0, dtype=np.int8)
        self._acc_size = 0

    def draw_ahead(self, prompt, output, acc_offsets, acc_values) -> None:
        """Add requests that have not arrived yet."""
        n = len(prompt)
        need = self.drawn + n
        if need > len(self.arrival):
            self._grow(max(need, 2 * len(self.arrival)))
        sl = slice(self.drawn, need)
        self.prompt[sl] = prompt
        self.output[sl] = output
        self.acc_base[sl] = self._acc_size + np.asarray(acc_offsets[:-1])
        end = self._acc_size + len(acc_values)
        if end > len(self.acc_values):  # amortised doubling, not a copy per append
            grown = np.zeros(max(end, 2 * len(self.acc_values)), dtype=np.int8)
            grown[: self._acc_size] = self.acc_values[: self._acc_size]
            self.acc_values = grown
        self.acc_values[self._acc_size:end] = acc_values
        self._acc_size = end
        self.drawn = need

    def arrive(self, arrival, client=None) -> None:
        """The next ``len(arrival)`` drawn requests arrive."""
        sl = slice(self.size, self.size + len(arrival))
        self.arrival[sl] = arrival
        if client is not None:
            self.client[sl] = client
        self.size = sl.stop

    def _grow(self, capacity: int) -> None:
        for name, fill in (
            ("arrival", 0.0), ("prompt", 0), ("output", 0), ("acc_base", 0), ("generated", 0),
            ("first_token", np.nan), ("finish", np.nan), ("client", -1),
        ):
            old = getattr(self, name)
            new = np.full(capacity, fill, dtype=old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)


class Simulator:
    """Simulated SGLang server: call :meth:`advance`, then :meth:`decode`, until :attr:`done`.

    Args:
        profile: cost profile (``step_latency_s(batch, depth, kv, prefill, draft_extend)``).
        acceptance: acceptance model (``draw(output_tokens, request_class, rng)``).
        workload: an open-loop :class:`~env.traces.workloads.Workload` or a
            :class:`~env.traces.workloads.ClosedLoop`.
        config: server limits; defaults to the profile's.
        seed: seeds acceptance draws and closed-loop lengths.
        server: server name reported in the step records.
    """

    _CHUNK = 512  # closed-loop requests drawn at a time

    def __init__(self, profile, acceptance, workload, config: SchedulerConfig | None = None,
                 seed: int = 0, server: str = "sim") -> None:
        self.profile = profile
        self.acceptance = acceptance
        self._batch_wide_acceptance = bool(getattr(acceptance, "batch_wide", False))
        self.workload = workload
        self.config = config or SchedulerConfig.from_profile(profile)
        if acceptance.max_depth < self.config.max_depth:
            raise ValueError(
                f"acceptance model max_depth {acceptance.max_depth} < simulator max_depth "
                f"{self.config.max_depth}"
            )
        self.server = server
        self.seed = seed
        self._closed_loop = hasattr(workload, "concurrency")
        self.reset()

    # -- lifecycle -------------------------------------------------------------

    def reset(self, seed: int | None = None) -> None:
        """Start over with an empty server at time 0."""
        if seed is not None:
            self.seed = seed
        self.rng = np.random.default_rng(self.seed)
        cap = self.config.max_running_requests
        self.time_s = 0.0
        self.step_index = 0
        self.kv_used = 0
        self.output_tokens_total = 0
        self.retractions = 0
        # Running decode batch, in admission order (oldest first).
        self._run_rid = np.zeros(cap, dtype=np.int64)
        # pos: index of the request's next acceptance entry in requests.acc_values
        # (its table base + tokens generated); rem: tokens it still has to produce.
        self._run_pos = np.zeros(cap, dtype=np.int64)
        self._run_rem = np.zeros(cap, dtype=np.int64)
        # 1 where the request decoded while speculation was off (stale draft KV).
        self._run_stale = np.zeros(cap, dtype=np.int8)
        # Steps a finished request still rides (``finish_lag_steps``); -1 while decoding.
        self._run_linger = np.full(cap, -1, dtype=np.int16)
        self._ride_since = 0.0  # when the newest lingering requests finished
        # Radix cache: prompt blocks, least recently used first (block id -> tokens).
        # Blocks of running requests stay findable but locked (``_locks``: how many
        # requests hold each; ``_held``: which blocks a request holds): their tokens count
        # in each holder's KV (``kv_used``: every request's context, which its attention
        # reads) and not in ``_cache_tokens``, the evictable rest of the pool.
        blocks = getattr(self.workload, "prefix_blocks", None)
        self._prefix = blocks if self.config.prefix_cache and not self._closed_loop else None
        self._cache: OrderedDict[int, int] = OrderedDict()
        self._cache_tokens = 0
        self._locks: dict[int, int] = {}
        self._held: dict[int, list[int]] = {}
        self._n_run = 0
        # Request being prefilled in chunks: [rid, prompt tokens still to prefill].
        self._chunked: list[int] | None = None
        self._retracted: deque[int] = deque()
        self._queue_head = 0  # requests [queue_head, n_arrived) wait in FIFO order
        self._n_arrived = 0
        self._stale_draft = False
        # The depth held (``min_switch_steps``; -1: none yet) and the step it began at.
        self._held_depth = -1
        self._switched_at = 0
        #: Whether the last decode step ran as the re-entry warm-up.
        self.last_warmup = False
        # The prefill's launch booked on the decode step before it, still to be taken out
        # of that prefill (``profile.prefill_launch_s``); the requests a decode step
        # answered (their answer moves with the booking).
        # (getattr: a duck-typed profile without the field books nothing)
        self._books_launch = getattr(self.profile, "prefill_launch_s", 0.0) > 0.0
        self._launch_moved = 0.0
        self._answered: list[np.ndarray] = []
        # ``_prefill_due()`` as the last decode step left it, arrivals admitted (booking
        # on; None: not known, advance() asks): advance() reuses it.
        self._due_after_step: bool | None = None
        if self._closed_loop:
            self._init_closed_loop()
        else:
            self._init_open_loop()

    def _init_open_loop(self) -> None:
        wl = self.workload
        n = len(wl)
        self.requests = _RequestTable(max(n, 1))
        self._check_fits(wl.prompt_tokens, wl.output_tokens)
        if n:
            table = self.acceptance.draw(wl.output_tokens, wl.request_class, self.rng)
            self.requests.draw_ahead(wl.prompt_tokens, wl.output_tokens,
                                     table.offsets, table.values)
            self.requests.arrive(wl.arrival_s)

    def _init_closed_loop(self) -> None:
        wl = self.workload
        self.requests = _RequestTable(max(2 * wl.concurrency, self._CHUNK))
        self._client_sent = np.zeros(wl.concurrency, dtype=np.int64)
        # getattr: duck-typed closed loops without the (newer) overhead field mean none.
        self._client_overhead = float(getattr(wl, "client_overhead_s", 0.0))
        # A client's first request reaches the server one overhead after it starts;
        # clients that would start after the loop stops sending never start.
        sends = np.arange(wl.concurrency) * float(wl.start_interval_s)
        self._send_until = getattr(wl, "send_until_s", None)
        if self._send_until is not None:
            sends = sends[sends < self._send_until]
        self._client_start = self._client_overhead + sends
        self._clients_started = 0
        # Follow-up requests in flight to the server: (arrival time, clients), in
        # time order (each is sent when a request finishes, and time only grows).
        self._in_flight: deque[tuple[float, np.ndarray]] = deque()
        self._start_clients()

    def _start_clients(self) -> None:
        """Clients whose start time has come send their first request."""
        start = self._client_start
        first = self._clients_started
        last = int(np.searchsorted(start, self.time_s, side="right"))
        for client in range(first, last):  # each arrives at its own start time
            self._spawn(np.array([client]), at_s=float(start[client]))
        self._clients_started = last

    def _check_fits(self, prompt: np.ndarray, output: np.ndarray) -> None:
        """Every request must fit the KV cache alone, or the run could never finish."""
        need = np.asarray(prompt) + np.asarray(output) + self.config.max_depth + 1
        too_big = np.flatnonzero(need > self.config.kv_capacity_tokens)
        if too_big.size:
            i = int(too_big[0])
            raise ValueError(
                f"request {i} needs {int(need[i])} KV slots (prompt {int(prompt[i])} + output "
                f"{int(output[i])} + speculation) but the KV capacity is "
                f"{self.config.kv_capacity_tokens}; {too_big.size} such request(s)"
            )

    # -- closed-loop request generation -----------------------------------------

    def _spawn(self, clients: np.ndarray, at_s: float) -> None:
        """New requests from ``clients``, arriving at ``at_s``."""
        wl = self.workload
        if wl.requests_per_client is not None:
            clients = clients[self._client_sent[clients] < wl.requests_per_client]
        n = len(clients)
        if n == 0:
            return
        self._client_sent[clients] += 1
        requests = self.requests
        while requests.drawn < requests.size + n:
            k = max(self._CHUNK, n)
            prompt, output = wl.sample_lengths(self.rng, k)
            self._check_fits(prompt, output)
            table = self.acceptance.draw(np.asarray(output), None, self.rng)
            requests.draw_ahead(prompt, output, table.offsets, table.values)
        requests.arrive(np.full(n, at_s), client=clients)
        self._n_arrived = requests.size

    # -- queries -----------------------------------------------------------------

    @property
    def done(self) -> bool:
        """True once every request has finished and no more will come."""
        if self._n_run or self._chunked is not None or self._retracted:
            return False
        if self._closed_loop and (self._clients_started < len(self._client_start)
                                  or self._in_flight):
            return False
        return self._queue_head >= self.requests.size

    @property
    def running_requests(self) -> int:
        """Requests admitted: decoding plus the one being prefilled in chunks."""
        return self._n_run + (self._chunked is not None)

    @property
    def waiting_requests(self) -> int:
        """Requests that arrived and wait for admission."""
        return self._n_arrived - self._queue_head + len(self._retracted)

    @property
    def batch_size(self) -> int:
        """Requests in the next decode batch."""
        return self._n_run

    def remaining_tokens(self) -> np.ndarray:
        """Output tokens each running request still has to produce (for the oracle)."""
        n = self._n_run
        return self._run_rem[:n].copy()

    @property
    def warmup_due(self) -> bool:
        """Whether a decode step asked for depth > 0 now runs as the warm-up
        (``SchedulerConfig.reentry_warmup``: an off step ran since the draft's last
        extend, the plugin's ``OffSwitch.stale``)."""
        return self._stale_draft and self.config.warms_up

    def true_accepted(self, depth: int, after_warmup: bool = False) -> np.ndarray:
        """Drafts each running request would accept at ``depth`` next step (for the oracle).

        ``after_warmup``: in the drafting step after a due warm-up (:attr:`warmup_due`)
        instead, one position further along and from a warm draft (0 for a request the
        warm-up finishes). Without it, a due warm-up accepts nothing.
        """
        n = self._n_run
        if depth <= 0:
            return np.zeros(n, dtype=np.int8)
        if not after_warmup:
            if self.warmup_due:
                return np.zeros(n, dtype=np.int8)
            return self._accepted(depth)
        rem = self._run_rem[:n]
        # A request the warm-up leaves with nothing to produce reads its own last entry
        # (never past its table); it commits nothing there anyway.
        return self._accepted(depth, shift=(rem > 1).astype(np.int64), cold=False)

    def _accepted(self, depth: int, shift: np.ndarray | None = None,
                  cold: bool | None = None) -> np.ndarray:
        """Drafts each running request accepts at ``depth`` > 0 in the due step
        (``shift``: positions further along; ``cold``: from a cold draft, default: as it
        is now)."""
        n = self._n_run
        cfg = self.config
        if self._batch_wide_acceptance:  # one draw for the whole batch, as SGLang simulates
            accepted = np.full(n, min(self.acceptance.draw_step(self.rng), depth), np.int8)
        else:
            pos = self._run_pos[:n] if shift is None else self._run_pos[:n] + shift
            accepted = np.minimum(self.requests.acc_values[pos], depth)
        if cfg.stale_accept_loss > 0.0:
            stale = self._run_stale[:n].astype(bool)
            if stale.any():
                kept = np.floor(accepted[stale] * (1.0 - cfg.stale_accept_loss) + 0.5)
                accepted[stale] = kept.astype(np.int8)
        if self._stale_draft if cold is None else cold:
            accepted = np.floor(accepted * cfg.cold_recovery_accept_fraction).astype(np.int8)
        return accepted

    def stats(self) -> RequestStats:
        """Per-request outcomes so far."""
        r = self.requests
        n = r.size
        return RequestStats(
            arrival_s=r.arrival[:n].copy(),
            first_token_s=r.first_token[:n].copy(),
            finish_s=r.finish[:n].copy(),
            prompt_tokens=r.prompt[:n].copy(),
            output_tokens=r.output[:n].copy(),
        )

    # -- stepping ----------------------------------------------------------------

    def advance(self) -> list[StepRecord]:
        """Run prefill steps and idle gaps until a decode step is due (or the run is done).

        Returns the records of the prefill steps it ran, oldest first.
        """
        records = []
        # With the booking on, the decode step just run already admitted the arrivals up to
        # its own end and decided whether a prefill is due (``_book_prefill_launch``); the
        # state has not changed since, so that answer stands for the first pass (and a
        # booked launch is the prefill composed then, not with arrivals up to the booking's
        # end).
        due, self._due_after_step = self._due_after_step, None
        while True:
            if due is None:
                self._admit_arrivals()
                due = self._prefill_due()
            if due:
                records.append(self._prefill_step())
            elif self._n_run or not self._jump_to_next_arrival():
                return records
            due = None

    def decode(self, depth: int, unheld: bool = False) -> StepRecord:
        """Run the due decode step with ``depth`` draft tokens (0 = no speculation).

        Asked for depth > 0 while :attr:`warmup_due`, the step is the warm-up instead
        (depth 0 in its record; see the module docstring). ``unheld``: a decision the
        plugin neither holds nor holds after (the start rule, ``ProbeSpec.start_off``):
        the depth runs at once, and a later switch is not held by this one.
        """
        if not self._n_run:
            raise RuntimeError("no decode step is due: call advance() first")
        cfg = self.config
        depth = min(max(int(depth), 0), cfg.max_depth)
        if unheld:
            if cfg.min_switch_steps > 1:  # as the plugin: switched long enough ago
                self._held_depth = depth
                self._switched_at = self.step_index - cfg.min_switch_steps
        elif cfg.min_switch_steps > 1 and depth != self._held_depth:
            if (self._held_depth >= 0
                    and self.step_index - self._switched_at < cfg.min_switch_steps):
                depth = self._held_depth  # the plugin holds the depth it switched to
            else:
                self._held_depth, self._switched_at = depth, self.step_index
        # The plugin hands SGLang steps=0 for the warm-up (OffSwitch.choose), so SGLang
        # reserves and runs a steps=0 step.
        warmup = depth > 0 and self.warmup_due
        self.last_warmup = warmup
        if warmup:
            depth = 0
        # A batch of finished requests only (their ride, ``finish_lag_steps``) was launched
        # before they were known finished and keeps nothing it computes: no room to make.
        if (self.kv_used + self._n_run * (depth + 1) > cfg.kv_capacity_tokens
                and not (cfg.finish_lag_steps
                         and (self._run_linger[:self._n_run] >= 0).all())):
            self._make_room(depth)
        n = self._n_run
        pos = self._run_pos[:n]
        rem = self._run_rem[:n]

        if depth:
            accepted = self._accepted(depth)
            self._stale_draft = False
            tokens = np.minimum(accepted + 1, rem)  # a finished request's rem is 0
            committed = int(tokens.sum())
            pos += tokens
            rem -= tokens
        else:
            accepted = _EMPTY_I8
            if warmup:  # the draft extend over the newest token: the draft is warm again
                self._stale_draft = False
            elif cfg.zero_step_is_cold:
                self._stale_draft = True
                if cfg.zero_step == "off":
                    self._run_stale[:n] = 1
            if cfg.finish_lag_steps:
                live = (rem > 0).astype(np.int64)
                committed = int(live.sum())
                pos += live
                rem -= live
            else:
                committed = n
                pos += 1
                rem -= 1
        kv_before = self.kv_used
        flags = WARMUP_LATENCY_FLAGS if warmup else cfg.latency_flags(depth)
        latency = self.profile.step_latency_s(n, depth, kv_before, 0, **flags)
        record = StepRecord(
            server=self.server, rank=0, step_index=self.step_index, time_s=self.time_s,
            batch_size=n, waiting_requests=self.waiting_requests,
            running_requests=self.running_requests, kv_used_tokens=kv_before,
            kv_capacity_tokens=cfg.kv_capacity_tokens, prefill_tokens=0, steps_used=depth,
            accepted_drafts=accepted, step_latency_s=latency, warmup=self._warmup_flag(warmup),
        )
        self.kv_used += committed
        if self._cache_tokens:
            self._evict_cache()
        self.output_tokens_total += committed
        self.time_s += latency
        self.step_index += 1
        booking = self._books_launch
        if booking:
            self._answered.clear()
        if cfg.finish_lag_steps:
            self._linger(rem)
        elif rem.min() <= 0:
            self._finish(rem <= 0)
        if booking:
            self._book_prefill_launch(record, latency)
        return record

    def _book_prefill_launch(self, record: StepRecord, own_s: float) -> None:
        """If the next step is a prefill, book its launch on ``record``, the decode step
        that just ran ``own_s``, and flag it ``before_prefill`` (the module docstring's
        "The prefill's launch")."""
        self._admit_arrivals()
        record.before_prefill = self._due_after_step = self._prefill_due()
        if not record.before_prefill:
            return
        booked = self.profile.prefill_launch_booked_s(own_s)
        if booked <= 0.0:
            return
        record.step_latency_s = own_s + booked
        self.time_s += booked
        self._launch_moved = booked
        finish = self.requests.finish
        for rids in self._answered:  # answered when the result is processed: after it
            finish[rids] += booked

    # -- internals ---------------------------------------------------------------

    def _warmup_flag(self, warmup: bool) -> bool | None:
        """A record's ``StepRecord.warmup``: known on the off path (``zero_step="off"``,
        whose depth-0 steps are off steps or, with ``reentry_warmup``, the warm-up), as the
        plugin reports it with its off path in use; None on SGLang's own steps=0, as the
        plugin reports it without."""
        return warmup if self.config.zero_step == "off" else None

    def _admit_arrivals(self) -> None:
        if self._closed_loop:
            if self._clients_started < len(self._client_start):
                self._start_clients()
            in_flight = self._in_flight
            while in_flight and in_flight[0][0] <= self.time_s:
                at_s, clients = in_flight.popleft()
                self._spawn(clients, at_s=at_s)
        else:
            arrival = self.requests.arrival
            n = self.requests.size
            i = self._n_arrived
            if i < n and arrival[i] <= self.time_s:
                self._n_arrived = int(np.searchsorted(arrival[:n], self.time_s, side="right"))

    def _jump_to_next_arrival(self) -> bool:
        if self._closed_loop:
            due = [self._in_flight[0][0]] if self._in_flight else []
            if self._clients_started < len(self._client_start):
                due.append(float(self._client_start[self._clients_started]))
            if not due:
                return False
            self.time_s = max(self.time_s, min(due))
            return True
        if self._n_arrived >= self.requests.size:
            return False
        self.time_s = max(self.time_s, float(self.requests.arrival[self._n_arrived]))
        return True

    def _prefill_due(self) -> bool:
        if self._chunked is not None:
            return True
        if not (self._retracted or self._queue_head < self._n_arrived):
            return False
        if (self.config.finish_lag_steps and not self._retracted
                and self.requests.arrival[self._queue_head] >= self._ride_since
                and (self._run_linger[:self._n_run] > 0).any()):
            # The overlap scheduler launched the next decode step (with the finished
            # requests) before it sent their answers: a request that arrived since could
            # not be in it.
            return False
        if self._n_run >= self.config.max_running_requests:
            return False
        rid = self._retracted[0] if self._retracted else self._queue_head
        return self._fits(self._prefill_length(rid))

    def _prefill_length(self, rid: int) -> int:
        return int(self.requests.prompt[rid] + self.requests.generated[rid])

    def _fits(self, new_tokens: int) -> bool:
        # Room for the new tokens plus one maximal speculative step of the whole batch.
        reserve = (self._n_run + 1) * (self.config.max_depth + 1)
        return self.kv_used + new_tokens + reserve <= self.config.kv_capacity_tokens

    def _next_waiting(self) -> int | None:
        if self._retracted:
            return self._retracted[0]
        if self._queue_head < self._n_arrived:
            return self._queue_head
        return None

    def _pop_waiting(self) -> None:
        if self._retracted:
            self._retracted.popleft()
        else:
            self._queue_head += 1

    def _prefill_step(self) -> StepRecord:
        cfg = self.config
        budget = cfg.chunked_prefill_tokens
        prefill_tokens = 0
        batch = 0
        completed: list[int] = []
        kv_before = self.kv_used
        waiting_before = self.waiting_requests
        running_before = self.running_requests

        pairs = 0.0  # the prompts' attention token pairs (cost_model.prefill_pairs)
        cached = 0  # the prompts' tokens already in the KV cache (c_prefill_cached_token)

        def prefill(rid: int, length: int) -> None:
            """Compute up to the remaining budget of a prompt; chunk what is left over."""
            nonlocal budget, prefill_tokens, batch, pairs, cached
            take = min(length, budget)
            # Tokens of this prompt in the KV cache already: a cached prefix, earlier chunks.
            done = self._prefill_length(rid) - length
            pairs += prefill_pairs(take, done)
            cached += done
            budget -= take
            prefill_tokens += take
            batch += 1
            if take == length:
                completed.append(rid)
                self._chunked = None
            else:
                self._chunked = [rid, length - take]

        if self._chunked is not None:
            prefill(*self._chunked)
        while budget > 0 and self._chunked is None:
            rid = self._next_waiting()
            if rid is None or self._n_run + len(completed) >= cfg.max_running_requests:
                break
            length = self._prefill_length(rid)
            if not self._fits(length + prefill_tokens):
                break
            self._pop_waiting()
            if self._prefix is not None:
                length -= self._take_cached_prefix(rid, length)
            prefill(rid, length)
        skip_draft = (cfg.zero_step == "off" and cfg.skip_prefill_while_off
                      and self._stale_draft)
        latency = self.profile.step_latency_s(0, 0, kv_before, prefill_tokens,
                                              draft_extend=not skip_draft, prefill_pairs=pairs,
                                              prefill_cached_tokens=cached)
        if self._launch_moved:  # its launch was booked on the decode step before it
            latency = max(latency - self._launch_moved, 0.0)
            self._launch_moved = 0.0
        record = StepRecord(
            server=self.server, rank=0, step_index=self.step_index, time_s=self.time_s,
            batch_size=batch, waiting_requests=waiting_before, running_requests=running_before,
            kv_used_tokens=kv_before, kv_capacity_tokens=cfg.kv_capacity_tokens,
            prefill_tokens=prefill_tokens, steps_used=0, accepted_drafts=_EMPTY_I8,
            step_latency_s=latency, prefill_pairs=pairs, warmup=self._warmup_flag(False),
            # (the simulator books no launch on a prefill: its cost holds the next one's)
            before_prefill=False if self._books_launch else None,
        )
        self.kv_used += prefill_tokens
        if self._cache_tokens:
            self._evict_cache()
        self.time_s += latency
        self.step_index += 1
        if cfg.finish_lag_steps:
            self._age_lingering()
        if self._prefix is not None:
            self._insert_prompts(completed)
        self._start_decoding(completed, stale_draft=skip_draft)
        return record

    def _start_decoding(self, rids: list[int], stale_draft: bool = False) -> None:
        """Requests whose prefill finished: emit their first token and join the batch
        (``stale_draft``: the draft's extend over their prompt was skipped)."""
        if not rids:
            return
        r = self.requests
        ids = np.asarray(rids, dtype=np.int64)
        fresh = r.generated[ids] == 0
        r.first_token[ids[fresh]] = self.time_s
        r.generated[ids[fresh]] = 1
        self.kv_used += int(fresh.sum())
        self.output_tokens_total += int(fresh.sum())
        n, k = self._n_run, len(ids)
        self._run_rid[n:n + k] = ids
        self._run_pos[n:n + k] = r.acc_base[ids] + r.generated[ids]
        self._run_rem[n:n + k] = r.output[ids] - r.generated[ids]
        # A (re-)prefill writes fresh draft KV entries, unless its draft extend was skipped.
        self._run_stale[n:n + k] = 1 if stale_draft else 0
        self._run_linger[n:n + k] = -1
        self._n_run = n + k
        done = r.generated[ids] >= r.output[ids]
        if done.any():
            mask = np.zeros(self._n_run, dtype=bool)
            mask[n:n + k] = done
            self._finish(mask)

    def _finish(self, finished: np.ndarray) -> None:
        """Requests of the batch (mask) that produced their last token: answer, free."""
        self._complete(finished)
        self._remove(finished)

    def _linger(self, rem: np.ndarray) -> None:
        """After a decode step with ``finish_lag_steps``: answer the requests that just
        finished and keep them in the batch that many steps."""
        linger = self._run_linger[:self._n_run]
        finished = (rem <= 0) & (linger < 0)
        if finished.any():
            self._complete(finished)
            self._ride_since = self.time_s
            # (this step is not theirs to ride: _age_lingering takes one off at once)
            linger[finished] = self.config.finish_lag_steps + 1
            # its acceptance-table position may sit one past its own entries: keep it in
            # range (it produces nothing: rem is 0)
            self._run_pos[:self._n_run][finished] -= 1
        self._age_lingering()

    def _age_lingering(self) -> None:
        """After any step: finished requests count it as ridden; those whose ride ended
        are freed (after a prefill too: SGLang read the decode step's results meanwhile)."""
        linger = self._run_linger[:self._n_run]
        rode = linger > 0
        if rode.any():
            linger[rode] -= 1
            gone = linger == 0
            if gone.any():
                self._remove(gone)

    def _complete(self, finished: np.ndarray) -> None:
        """The answer: finish time, and a closed loop's client sends its next request."""
        n = self._n_run
        r = self.requests
        rids = self._run_rid[:n][finished]
        r.generated[rids] = r.output[rids]
        r.finish[rids] = self.time_s
        if self._books_launch:
            self._answered.append(rids)
        if self._closed_loop:
            if self._send_until is not None and self.time_s >= self._send_until:
                return  # the loop has stopped sending: its clients only wait
            clients = r.client[rids]
            if not self._client_overhead:
                self._spawn(clients, at_s=self.time_s)
                return
            limit = self.workload.requests_per_client
            if limit is not None:  # clients done sending never put a request in flight
                clients = clients[self._client_sent[clients] < limit]
            if clients.size:
                self._in_flight.append((self.time_s + self._client_overhead, clients))

    def _remove(self, gone: np.ndarray) -> None:
        """Free the batch slots and KV of finished requests (mask over the batch)."""
        n = self._n_run
        r = self.requests
        rids = self._run_rid[:n][gone]
        self.kv_used -= int((r.prompt[rids] + r.generated[rids]).sum())
        if self._prefix is not None:
            self._cache_prompts(rids)
        keep = ~gone
        m = int(keep.sum())
        for arr in (self._run_rid, self._run_pos, self._run_rem, self._run_stale,
                    self._run_linger):
            arr[:m] = arr[:n][keep]
        self._n_run = m

    def _take_cached_prefix(self, rid: int, length: int) -> int:
        """Prompt tokens of ``rid`` (about to be prefilled) already in the radix cache.

        Its leading blocks found there are locked while it runs (not evicted, and found by
        other requests too, as SGLang's radix tree shares a prefix between running
        requests) and count in its KV; at least one token is computed.
        """
        tokens = 0
        held = []
        for block in self._prefix[rid].tolist():
            size = self._cache.get(block)
            if size is None:
                break
            self._cache.move_to_end(block)
            if block not in self._locks:
                self._cache_tokens -= size  # in a request's KV now, not evictable
            self._locks[block] = self._locks.get(block, 0) + 1
            held.append(block)
            tokens += size
        if held:
            self._held[rid] = held
        hit = min(tokens, length - 1)
        self.kv_used += hit  # (a block's tokens beyond the hit go back to the pool)
        return hit

    def _release(self, rid: int) -> None:
        """``rid`` no longer runs: blocks it held that no other request holds become
        evictable cache again."""
        for block in self._held.pop(rid, ()):
            holders = self._locks[block] - 1
            if holders:
                self._locks[block] = holders
            else:
                del self._locks[block]
                self._cache_tokens += self._cache[block]

    def _insert_prompts(self, rids: list[int]) -> None:
        """Requests whose prefill just finished put their prompt's blocks in the radix
        cache, locked while they run (SGLang inserts a request's prefix into its radix
        tree after the prefill, so a request arriving meanwhile finds it)."""
        size = self.workload.prefix_block_tokens
        for rid in rids:
            prompt = int(self.requests.prompt[rid])
            held = self._held.setdefault(rid, [])
            mine = set(held)
            for i, block in enumerate(self._prefix[rid].tolist()[: -(-prompt // size)]):
                if block in mine:
                    continue
                if block not in self._cache:
                    self._cache[block] = min(size, prompt - i * size)
                elif block not in self._locks:
                    self._cache_tokens -= self._cache[block]
                self._locks[block] = self._locks.get(block, 0) + 1
                held.append(block)

    def _cache_prompts(self, rids: np.ndarray) -> None:
        """Finished requests leave their prompt blocks in the radix cache (most recent).

        A prompt's blocks become most recent last block first, so its leading blocks are
        the most recent: eviction takes a prefix from its tail, as SGLang's radix tree
        evicts leaves first, and what is left of it still matches.
        """
        for rid in rids.tolist():
            blocks = self._held.get(rid, [])
            self._release(rid)
            for block in reversed(blocks):
                self._cache.move_to_end(block)
        self._evict_cache()

    def _evict_cache(self) -> None:
        """Least recently used blocks go until the cache fits the pool beside the batch
        (blocks a running request holds stay)."""
        room = max(self.config.kv_capacity_tokens - self.kv_used, 0)
        if self._cache_tokens <= room:
            return
        for block in list(self._cache):  # least recently used first
            if self._cache_tokens <= room:
                break
            if block not in self._locks:
                self._cache_tokens -= self._cache.pop(block)

    def _make_room(self, depth: int) -> None:
        """Retract the newest requests until the speculative reservation fits."""
        cap = self.config.kv_capacity_tokens
        r = self.requests
        if self._chunked is not None:
            # The partial prefill is the newest work: abort it first; it restarts later.
            rid, remaining = self._chunked
            self.kv_used -= self._prefill_length(rid) - remaining
            self._release(rid)
            self._retracted.appendleft(rid)
            self._chunked = None
            self.retractions += 1
        lingering = self._run_linger[:self._n_run] >= 0
        if lingering.any():  # finished: SGLang has freed them before it retracts
            self._remove(lingering)
        while self._n_run > 1 and self.kv_used + self._n_run * (depth + 1) > cap:
            i = self._n_run - 1
            rid = int(self._run_rid[i])
            r.generated[rid] = r.output[rid] - self._run_rem[i]
            self.kv_used -= int(r.prompt[rid] + r.generated[rid])
            self._release(rid)
            self._retracted.appendleft(rid)
            self._n_run = i
            self.retractions += 1
        if self.kv_used + self._n_run * (depth + 1) > cap:
            raise RuntimeError(
                f"KV capacity {cap} cannot hold one request at depth {depth}; "
                "raise kv_capacity_tokens"
            )
