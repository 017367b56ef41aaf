"""Per scheduler process state, and the hook functions that act on it.

One :class:`Runtime` lives in every SGLang scheduler process (one per TP rank).
Its bound methods are what :mod:`sglang_hooks.plugin` registers with SGLang's
``HookRegistry``:

=============================================  =========  ================================
target                                         type       what it does
=============================================  =========  ================================
SchedulerRequestReceiver._pull_raw_reqs        AFTER      source rank: announce the local
                                                          rule once, append the client's
                                                          newest decision marker
Scheduler.process_input_requests               BEFORE     every rank: strip markers, queue
                                                          the newest, adopt the announced
                                                          rule (first call: attach)
Scheduler.run_batch                            AROUND     every rank: apply the queued marker
                                                          when due, note the depth run;
                                                          source: capture the step's load
                                                          and launch time
Scheduler.process_batch_result                 AROUND     every rank: which depth the
                                                          verified step ran; source: send
                                                          the step's telemetry
=============================================  =========  ================================

A *follower* runtime (a scheduler process without ``SPECCTL_*`` variables, e.g.
another node of a multi-node TP group) is never the source. Until a source
announces its rule it leaves every choice to SGLang (the superclass, switch
timing included); from then on it runs what the source's markers say.

The policy object (:mod:`sglang_hooks.policy`) reads :attr:`Runtime.controller`
(the applied controller decision, or None for the local rule) and reports
per-request acceptance through :meth:`Runtime.on_verify`.

Why ranks agree: a decision changes what a rank does only through
:attr:`controller`, which only :meth:`around_run_batch` sets, from a marker
that came through the broadcast request list, at a step index
(``forward_ct``) that is the same on every rank. Nothing else (timeouts, the
controller's replies, faults) is acted on locally; the source turns them into
markers too.

Start-up warm-up (``--warmups specctl``, :mod:`sglang_hooks.warmup`): every rank reads
the same broadcast request list, so every rank opens the warm-up at the same iteration
(a warm-up request arrives) and closes it for good at the same iteration (any other
generate request arrives). While it is open, a batch holding a warm-up request is a
warm-up step on every rank (its requests are the same everywhere): the policy cycles
through the candidate depths by :attr:`Runtime.warm_steps`, and the source neither
sends nor records the step. Once closed, the hooks pay one attribute test per call.

Hook cost matters (they run on the scheduler thread every step): no logging,
no allocation beyond a few small objects, no pyarrow, no system call. What can
happen elsewhere does: the launch keeps SGLang's values as it reads them (one
tuple) and the result hands them over with its own (one tuple,
:mod:`sglang_hooks.raw_step`); the client's I/O thread makes the telemetry of
them, ages decisions, builds the markers (and the policy's table of each one's
steps per batch size), packs the frames and feeds SGLang's rule
(:attr:`Runtime.defer_rule_feed`); the recorder's thread makes the same
telemetry and reads the request ids and the finished requests from the batch's
request lists, handed over with their lengths (not copied: SGLang only appends to
a batch's list in place). Every hook body is wrapped so that an exception is
counted, logged once, and never reaches SGLang.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from controller.wire import Hello
from sglang_hooks.client import ControllerClient, client_name
from sglang_hooks.compat import Ranks, read_ranks
from sglang_hooks.config import PluginConfig
from sglang_hooks.marker import CONTROLLER, FALLBACK, DecisionMarker, RuleMarker, strip_markers
from sglang_hooks.offswitch import OffSwitch
from sglang_hooks.switching import OverridesLogTrimmer
from sglang_hooks.timing import HookClock
from sglang_hooks.warmup import arrivals as warmup_arrivals
from sglang_hooks.warmup import in_batch as warmup_in_batch
from sglang_hooks.warmup import is_warmup_rid

log = logging.getLogger(__name__)

_RING = 16  # launched steps whose telemetry may still be pending
_MAX_FAULTS = 1000  # then the source stops talking to the controller (fallback everywhere)
_SUMMARY_EVERY_S = 60.0


class Runtime:
    """The plugin's state in one scheduler process (see the module docstring).

    Args:
        cfg: Plugin configuration.
        version: Installed SGLang version (one of ``compat.SUPPORTED_VERSIONS``).
        ranks: This process's ranks, when known up front (tests); otherwise read
            from the scheduler on the first ``process_input_requests`` call.
        follower: No ``SPECCTL_*`` variables here: never the source, and SGLang's
            own behaviour until a source announces its rule.
        monotonic: The clock of step times and of the controller timeout (tests drive
            a manual one, so that no assertion depends on how loaded the machine is).
    """

    def __init__(self, cfg: PluginConfig, version: str, ranks: Ranks | None = None,
                 follower: bool = False,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.monotonic = monotonic
        self.version = version
        self.follower = follower
        #: The local rule every rank runs when the controller is not in charge (None:
        #: SGLang's own, untouched; a follower until the source's announcement).
        self.local: RuleMarker | None = None if follower else RuleMarker(
            cfg.rule, cfg.table, cfg.explore_dwell, cfg.min_switch_steps)
        #: Depth the batch whose result is being processed ran (-1: unknown).
        self.verify_steps = -1
        #: Keeps SGLang 0.5.23's overrides log bounded (set at attach; None in 0.5.15).
        self.trimmer: OverridesLogTrimmer | None = None
        self.counters: Counter[str] = Counter()
        #: The applied controller decision (None: run the local rule).
        self.controller: DecisionMarker | None = None
        #: Step index (``forward_ct``) of the batch being launched.
        self.launch_step = 0
        #: Steps the policy returned for the batch being launched (-1: not asked).
        self.last_steps = -1
        self.policy: Any = None
        #: SGLang's rule is fed by the client's I/O thread (and before it is asked), not
        #: at every verify on the scheduler thread: set once that thread does it.
        self.defer_rule_feed = False
        #: What steps=0 runs (every rank has one: the TP group agrees at start-up).
        self.offswitch = OffSwitch(self.counters, build=cfg.off_path == "decode",
                                   skip_prefill=cfg.off_prefill == "skip")
        self.is_source = False
        self.client: ControllerClient | None = None
        self.recorder: Any = None
        self.server = cfg.server or socket.gethostname()
        self.rank = 0
        self._ranks = ranks
        self._attached = False
        self._announced = False
        self._ran = [-1] * _RING  # depth run per launched step (every rank)
        self._pending: DecisionMarker | None = None
        self._last_seq = -1
        #: The marker the source attached last (None: none yet). Not ``_attached``:
        #: that flag says whether :meth:`attach` ran.
        self._last_marker: DecisionMarker | None = None
        self._broken = False
        #: Per ring slot: the launch tuple of a step not sent yet (``raw_step``), or None.
        self._launches: list[tuple | None] = [None] * _RING
        #: Per ring slot: the step index last captured there (-1: none).
        self._launched = [-1] * _RING
        #: SGLang's per-request accepted drafts of the batch being processed (the policy
        #: stores them: one attribute store per verify).
        self.accepted: list[int] | None = None
        #: When the previous step's result was processed (its completion, as seen here).
        self._last_result_end: float | None = None
        self._next_summary = 0.0
        #: The plugin's own time per step, when SPECCTL_HOOK_TIMING asks for it.
        self.clock = (HookClock(f"{cfg.hook_timing}.{os.getpid()}.json",
                                cpu=cfg.hook_timing_cpu)
                      if cfg.hook_timing else None)
        #: Received request lists are still looked at for warm-up requests (until the
        #: first other generate request: SGLang sends its warm-ups before it serves).
        self._warm_watch = True
        #: A warm-up is open (warm-up requests arrived, no other generate request yet).
        self.warming = False
        #: The batch being launched holds a warm-up request: a warm-up step.
        self.warm_now = False
        #: Warm-up decode steps launched so far (the warm-up cycle's position).
        self.warm_steps = 0
        #: The batch whose result is being processed was a warm-up step.
        self.verify_warm = False
        self._warm = [False] * _RING  # per launched step: a warm-up step (every rank)
        #: Per ring slot: the step index last launched as the off switch's re-entry warm-up
        #: (SGLang's steps=0 on the first step back on; -1: none). Not the start-up warm-up.
        self._reentry_at = [-1] * _RING
        #: The step index of the latest prefill (extend) batch the source launched (-1:
        #: none yet). Under overlap scheduling, step N+1 is launched before N's result is
        #: processed: N's latency then carries that launch (``StepRecord.before_prefill``).
        self._prefill_launched = -1

    # -- wiring ---------------------------------------------------------------------

    def hook_table(self) -> dict[str, tuple[Any, str]]:
        """Hooked method name -> (this runtime's hook, ``HookType`` member name)."""
        table = {
            "_pull_raw_reqs": (self.after_pull_raw_reqs, "AFTER"),
            "process_input_requests": (self.before_process_input_requests, "BEFORE"),
            "run_batch": (self.around_run_batch, "AROUND"),
            "process_batch_result": (self.around_process_batch_result, "AROUND"),
        }
        clock = self.clock
        if clock is not None:
            # The input hook runs once per loop iteration: it tells idle iterations apart.
            table = {name: (clock.around(hook, name) if kind == "AROUND" else
                            clock.plain(hook, name, name == "process_input_requests"), kind)
                     for name, (hook, kind) in table.items()}
        return table

    def attach_policy(self, policy: Any) -> None:
        """Called by the policy object when SGLang constructs it."""
        self.policy = policy

    def attach(self, scheduler: Any) -> None:
        """Learn this process's ranks; the source rank connects and starts recording."""
        self._attached = True
        try:
            ranks = self._ranks or read_ranks(scheduler, self.version)
            self._ranks = ranks
            self.rank = ranks.world_rank
            if self.policy is not None:
                self.trimmer = OverridesLogTrimmer.for_this_process()
            if self.follower:
                return
            if self.policy is None:
                if ranks.tp_rank == 0:
                    log.warning("specctl: this server does not run --speculative-adaptive "
                                "(no adaptive policy was built); specctl does nothing")
                return
            if ranks.pp_size > 1 or ranks.attn_dp:
                if ranks.tp_rank == 0:
                    log.warning("specctl: pipeline parallelism / attention DP is not supported; "
                                "every rank runs the local %r rule, no controller, no recording",
                                self.cfg.rule)
                return
            if ranks.tp_rank != 0:
                return
            if self.cfg.server is None:
                port = getattr(getattr(scheduler, "server_args", None), "port", None)
                self.server = f"{socket.gethostname()}-{port}" if port else self.server
            self.start_source()
        except Exception as exc:
            self.fault("attach", exc)
            self.is_source = False

    def start_source(self) -> None:
        """Make this runtime the source rank: open the client and the recorder."""
        cfg = self.cfg
        candidates = tuple(self.policy.candidate_steps) if self.policy is not None else ()
        if (cfg.controller or cfg.policy) and not cfg.record_explore:
            local = None
            if cfg.policy:
                from sglang_hooks.local import LocalDecisions

                local = LocalDecisions(cfg.policy, candidates, cfg.profile, cfg.probe,
                                       cfg.guard)
            hello = Hello(self.server, self.rank, candidates, client_name(self.version))
            self.client = ControllerClient(cfg.controller, hello, cfg.timeout_s,
                                           cfg.curve_server_key, cfg.curve_client_cert, local,
                                           monotonic=self.monotonic, poll_s=cfg.io_poll_s,
                                           plain_looks=cfg.io_plain_looks,
                                           held_send=cfg.io_held_send)
            feed = getattr(self.policy, "specctl_feed_rule", None)
            if feed is not None:  # the rule's feeding moves to the client's thread
                self.client.add_chore(feed)
                self.defer_rule_feed = True
            prepare = getattr(self.policy, "specctl_prepare", None)
            if prepare is not None:  # a marker's steps per batch size: tabled there too
                self.client.add_marker_chore(prepare)
        if cfg.record_dir:
            from sglang_hooks.recorder import start_recorder

            self.recorder = start_recorder(
                cfg.record_dir, self.server, self.rank, cfg.record_flush_s,
                meta={"sglang_version": self.version, "rule": cfg.rule,
                      "explore_dwell": cfg.explore_dwell, "candidate_steps": list(candidates),
                      "controller": cfg.controller},
            )
        self.is_source = True
        log.info("specctl: source rank of server %r: controller=%s, local policy=%s, rule=%s, "
                 "recording=%s", self.server, cfg.controller if self.client else None,
                 cfg.policy if self.client else None, cfg.rule, cfg.record_dir)

    def close(self) -> None:
        """Stop the client, the recorder and the hook timing's writer (tests, clean shutdown)."""
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.recorder is not None:
            self.recorder.close()
        if self.clock is not None:
            self.clock.close()
        self.is_source = False

    def fault(self, where: str, exc: BaseException) -> None:
        """Count an exception from plugin code; log the first one of each site."""
        self.counters[f"fault_{where}"] += 1
        total = self.counters["faults"] = self.counters["faults"] + 1
        if self.counters[f"fault_{where}"] == 1:
            log.error("specctl: error in %s (counted, SGLang unaffected)", where, exc_info=exc)
        if total >= _MAX_FAULTS and not self._broken:
            self._broken = True
            log.error("specctl: %d errors; the controller is ignored from now on "
                      "(every rank falls back to the %r rule)", total, self.cfg.rule)

    # -- hooks ------------------------------------------------------------------------

    def after_pull_raw_reqs(self, result: Any, *args: Any, **kwargs: Any) -> None:
        """AFTER ``SchedulerRequestReceiver._pull_raw_reqs``: append a marker (source)."""
        if result is None or not self.is_source:
            return None
        try:
            if not self._announced:  # the first thing every rank hears from the source
                self._announced = True
                result.append(self.local)
            client = self.client
            marker = client.marker if client is not None else None
            # The common case, nothing new to say, without a method call.
            if not self._broken and (marker is None or marker is self._last_marker):
                return None
            marker = self._source_marker(marker)
            if marker is not None:
                result.append(marker)
        except Exception as exc:
            self.fault("pull", exc)
        return None

    def before_process_input_requests(self, scheduler: Any, *args: Any, **kwargs: Any):
        """BEFORE ``Scheduler.process_input_requests``: take the markers out, keep the newest."""
        if not self._attached:
            self.attach(scheduler)
        recv_reqs = args[0] if args else kwargs.get("recv_reqs")
        if not recv_reqs:
            return None
        kept, decision, rule = strip_markers(recv_reqs)
        if decision is not None and decision.seq > self._last_seq:
            self._last_seq = decision.seq
            self._pending = decision
        if rule is not None:
            self.local = rule  # the same iteration on every rank
        watching = self._warm_watch
        if watching:  # the same list on every rank: the same answer
            try:
                seen = warmup_arrivals(kept)
            except Exception as exc:
                self.fault("warmup", exc)
                seen = False
            if seen is not None:
                self.warming = seen
                self._warm_watch = seen
        if kept is not recv_reqs:
            if isinstance(recv_reqs, list):
                recv_reqs[:] = kept  # so nothing downstream (PP relay, dispatch) sees a marker
            elif args:
                return (scheduler, kept, *args[1:]), kwargs
            else:
                return (scheduler,), {**kwargs, "recv_reqs": kept}
        if self.recorder is not None and self.is_source:
            try:
                self._record_arrivals(recv_reqs, watching)
            except Exception as exc:
                self.fault("arrivals", exc)
        return None

    def around_run_batch(self, original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
        """AROUND ``Scheduler.run_batch``: apply a due marker, capture the launch."""
        try:
            step = scheduler.forward_ct + 1  # run_batch's first act: forward_ct += 1
        except Exception as exc:  # same on every rank: none of them applies anything
            self.fault("run_batch", exc)
            return original(scheduler, *args, **kwargs)
        self.launch_step = step
        index = step % _RING  # this step's slot in every ring (one modulo, not four)
        if self.clock is not None:
            self.clock.end_step()
        pending = self._pending
        if pending is not None and step >= pending.apply_from_step:
            self._pending = None
            self.controller = pending if pending.mode == CONTROLLER else None
        self.last_steps = -1
        warm = False
        if self.warming:  # the same batch on every rank: the same answer
            try:
                batch = args[0] if args else kwargs["batch"]
                warm = warmup_in_batch(batch.reqs)
                if warm and batch.forward_mode.is_decode():
                    self.warm_steps += 1
            except Exception as exc:
                self.fault("warmup", exc)
                warm = False
        self.warm_now = warm
        self._warm[index] = warm
        if self.is_source and not self._broken and not warm:
            # What SGLang will have changed by the result, read now and kept as read (one
            # tuple; what derives from it is computed off this thread: raw_step).
            try:
                batch = args[0] if args else kwargs["batch"]
                mode = batch.forward_mode
                is_decode = mode.is_decode()
                # Idle, or a prebuilt (PD-disaggregation) placeholder: no step to report.
                if is_decode or mode.is_extend():
                    if not is_decode:
                        self._prefill_launched = step
                    if self._launches[index] is not None:
                        self.counters["telemetry_overwritten"] += 1
                    reqs = batch.reqs
                    running_batch = scheduler.running_batch
                    recording = self.recorder is not None
                    # An extend step's cached prefix and new tokens per request, for the
                    # trace (the attention pairs are reckoned on its thread). Named before
                    # the tuple: a starred part would build it through a list.
                    prefix = extend = None
                    if (recording and not is_decode and batch.extend_lens is not None
                            and batch.prefix_lens is not None):
                        prefix, extend = batch.prefix_lens[:], batch.extend_lens[:]
                    self._launched[index] = step
                    self._launches[index] = (
                        step, self.monotonic(), is_decode, len(reqs), len(scheduler.waiting_queue),
                        len(running_batch.reqs) if running_batch is not None else 0,
                        scheduler.max_total_num_tokens,
                        scheduler.token_to_kv_pool_allocator.available_size(),
                        scheduler.tree_cache.evictable_size(),
                        None if is_decode else batch.extend_num_tokens,
                        # The list itself, not a copy (a copy touches every request's
                        # reference count: with 64 cold requests, most of the recording's
                        # p99 in a server-like loop, docs/ONLINE.md's tenth pass): the
                        # recorder's thread reads its first batch-size entries. SGLang
                        # changes a batch's list in place only by appending (0.5.15's
                        # merge_batch; contract.APPEND_ONLY, tested on both pinned trees),
                        # so those are the requests launched.
                        reqs if recording else None, prefix, extend)
            except Exception as exc:
                self.fault("launch", exc)
        previous = self._ran[index - 1]  # (index 0: -1, the ring's last slot, step - 1's)
        result = original(scheduler, *args, **kwargs)
        steps = self.last_steps
        self._ran[index] = steps
        if steps == 0:  # an off step, or the re-entry warm-up (only these: one compare)
            offswitch = self.offswitch
            if offswitch.reentry_now:
                offswitch.reentry_now = False
                self._reentry_at[index] = step
        if steps != previous and steps >= 0 and self.trimmer is not None:
            try:
                self.trimmer.trim()
            except Exception as exc:
                self.fault("trim", exc)
        return result

    def around_process_batch_result(self, original: Any, scheduler: Any, *args: Any,
                                    **kwargs: Any) -> Any:
        """AROUND ``Scheduler.process_batch_result``: send the step's telemetry (source)."""
        try:
            batch = args[0] if args else kwargs["batch"]
            step = batch.forward_iter
            index = step % _RING
            ran = self.verify_steps = self._ran[index]
            warm = self.verify_warm = self._warm[index]
        except Exception as exc:  # same on every rank
            self.verify_steps = -1
            self.verify_warm = False
            self.fault("result", exc)
            return original(scheduler, *args, **kwargs)
        if not self.is_source:
            return original(scheduler, *args, **kwargs)
        if warm:  # a warm-up step: neither sent nor recorded
            result = original(scheduler, *args, **kwargs)
            self.counters["warmup_results"] += 1
            self._last_result_end = self.monotonic()
            return result
        self.accepted = None  # what the policy reports while this result is processed
        result = original(scheduler, *args, **kwargs)
        try:
            now = self.monotonic()
            recorder = self.recorder
            if recorder is not None:
                # The processed batch's list and its length, not a copy (as at the
                # launch): the recorder's thread finds the finished requests among them.
                finished = batch.reqs
                count = len(finished)
            launch = None
            if self._launched[index] != step:
                self.counters["unmatched_results"] += 1  # launched before attach, or lost
            else:
                launch = self._launches[index]
            if launch is not None:
                self._launches[index] = None  # sent
                # The step as read (raw_step.STEP_FIELDS): the client's I/O thread and the
                # recorder's thread make its telemetry; one tuple for both. Whether it was
                # the re-entry warm-up is known where the off path is in use (else None:
                # steps=0 is SGLang's own, every depth-0 step verifies and extends).
                # Whether a prefill was launched after it is known always: step + 1 is
                # launched before this result only under overlap scheduling.
                raw = (launch, ran, self.accepted, now, self._last_result_end,
                       self._reentry_at[index] == step if self.offswitch.ready else None,
                       self._prefill_launched == step + 1)
                client = self.client
                if client is not None:
                    client.send_step(raw)
                if recorder is not None:
                    recorder.add_step_values(raw, finished, count)
            elif recorder is not None:
                recorder.add_finished(finished, count)
            self._last_result_end = now
            if now >= self._next_summary:  # (here, where the time is read anyway)
                self._summary(now)
        except Exception as exc:
            self.fault("result", exc)
        return result

    def on_verify(self, num_correct_drafts_per_req: list[int]) -> None:
        """Per-request accepted drafts of the batch being processed (the policy stores
        :attr:`accepted` itself; drafts given outside a result are not sent)."""
        self.accepted = num_correct_drafts_per_req

    # -- source rank internals -----------------------------------------------------------

    def _source_marker(self, marker: DecisionMarker | None) -> DecisionMarker | None:
        """The marker to attach for every rank: ``marker``, the client's newest (the
        caller has checked that it is new), or once the plugin is broken one last
        fallback marker if the controller was in charge.

        The client's I/O thread ages decisions and builds the markers.
        """
        if self._broken:
            last = self._last_marker
            if last is None or last.mode != CONTROLLER:
                return None
            marker = DecisionMarker(last.seq + 1, FALLBACK, 0)
        self._last_marker = marker
        self.counters[f"markers_{marker.mode}"] += 1
        if marker.mode == FALLBACK and not marker.policy:
            self.counters["timeouts"] += 1
        return marker

    def _record_arrivals(self, recv_reqs: Any, watching: bool = False) -> None:
        now = self.monotonic()
        for item in recv_reqs:
            for req in getattr(item, "batch", None) or (item,):
                rid = getattr(req, "rid", None)
                ids = getattr(req, "input_ids", None)
                if isinstance(rid, str) and ids is not None:
                    if watching and is_warmup_rid(rid):
                        continue  # a warm-up request: not traffic
                    self.recorder.add_arrival(rid, now, len(ids))

    def _summary(self, now: float) -> None:
        first = self._next_summary == 0.0
        self._next_summary = now + _SUMMARY_EVERY_S
        if first:
            return
        counters = dict(self.counters)
        if self.client is not None:
            counters.update(self.client.counters)
        if self.recorder is not None:
            counters.update({f"recorder_{k}": v for k, v in self.recorder.counters.items()})
        log.info("specctl: %s; applied=%s", counters,
                 "controller" if self.controller is not None else self.cfg.rule)
