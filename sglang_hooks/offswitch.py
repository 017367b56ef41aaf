"""A real "off": a step decided 0 runs the target model's plain decode, with no draft work.

SGLang's adaptive ``steps=0`` is not a server without speculation. It still runs the
target in ``TARGET_VERIFY`` mode (one token per request, through the extend-attention
kernel and the verify CUDA graph, capturing every hidden state) and then a draft-model
extend over the new token. On an H200 that step cost 1.3-2.9x a plain decode step
(``docs/OFFSWITCH.md``). :class:`OffSwitch` keeps SGLang's own steps=0 bookkeeping
(trivial verify input, sampling, bonus tokens, the overlap scheduler's result layout)
and swaps the expensive parts, through five ``HookRegistry`` hooks:

==============================================  ======  ===========================================
target                                          type    what it does
==============================================  ======  ===========================================
EAGLEWorkerV2.init_cuda_graphs                  AFTER   build a target attention backend and a
                                                        DECODE-mode CUDA graph runner for it
EAGLEWorkerV2.verify                            AROUND  on an off step, hide the verify graph
                                                        runner, so no verify graph is planned
                                                        and loaded only to go unused
TpModelWorker.forward_batch_generation          AROUND  on an off step, run the verify forward as
                                                        a plain decode forward on that runner
EagleDraftWorker._draft_extend_for_decode       AROUND  on an off step, skip the draft extend (the
                                                        stubs SGLang's own skip flag writes)
EagleDraftWorker._draft_extend_for_prefill      AROUND  a prefill while off: skip the draft's
                                                        extend over the prompt (the same stubs)
==============================================  ======  ===========================================

A prefill *while off* (the last decode step ran the off path, and ``SPECCTL_OFF_PREFILL``
is ``skip``, the default) skips the draft's extend over the prompt, so that it costs
what a server without speculation pays, within the hidden-state capture. The
price: the draft holds no KV for that prompt, so if speculation comes back while the
request runs, its drafts attend to stale slots there (lower acceptance for that request,
never wrong tokens: the target verifies every draft). ``SPECCTL_OFF_PREFILL=draft`` keeps
EAGLE's prefill work while off (the draft ready for every request, the prefill slower).

Coming back on: the draft's state after an off step is a stub, so the first step that
asks for depth > 0 after an off period runs SGLang's own steps=0 path once (a verify
forward plus the draft extend over the newest token), which gives the draft a real
starting state; drafting resumes on the step after. Positions decoded while off keep no
draft KV (their slots hold stale values): the draft attends to them when it resumes.
Filling them would need the target's hidden states for every token decoded while off,
kept on the GPU until the draft catches up; SGLang keeps no such buffer, and this
version does not add one (``docs/OFFSWITCH.md`` says what that costs in acceptance).

Every rank makes the same choice, or ranks would run different collectives and hang:

* at start-up, every TP rank builds the path if asked to (``SPECCTL_OFF_PATH=decode``,
  the default where the plugin's variables are set; a follower rank without them builds
  nothing unless that one variable is set) and the group takes the minimum of "built"
  over its CPU group (:func:`all_ranks_agree`). The path is used only if every rank has it;
  otherwise steps=0 is SGLang's on every rank, with one warning;
* per step, the step count comes from the same decision marker on every rank
  (:mod:`sglang_hooks.runtime`), and :meth:`OffSwitch.choose` is a pure function of it
  and of this rank's previous choices, which are the same everywhere.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

log = logging.getLogger(__name__)

EAGLE = "sglang.srt.speculative.eagle_worker_v2"
TP_WORKER = "sglang.srt.managers.tp_worker"

#: Off-path modes (``SPECCTL_OFF_PATH``).
OFF_PATHS = ("decode", "sglang")
#: What a prefill while off runs (``SPECCTL_OFF_PREFILL``): the target alone, or EAGLE's too.
OFF_PREFILLS = ("skip", "draft")


class OffSwitch:
    """Per scheduler process: the plain-decode path and the off/warm-up bookkeeping.

    Args:
        counters: Where to count off steps, warm-ups and faults (the runtime's counters).
        build: Build the plain decode path at start-up (this rank's ``SPECCTL_OFF_PATH``
            is ``decode``); the TP group then agrees whether to use it.
        skip_prefill: A prefill while off runs the target alone (``SPECCTL_OFF_PREFILL``
            is ``skip``); the TP group agrees on this too.
    """

    def __init__(self, counters: Any, build: bool = True, skip_prefill: bool = True) -> None:
        self.counters = counters
        self.build = build
        self.skip_prefill = skip_prefill
        #: True once the plain decode runner exists (False: steps=0 stays SGLang's).
        self.ready = False
        #: The step being launched was decided 0 and runs the plain decode path.
        self.off_now = False
        #: The draft's state is a stub (an off step ran since the last draft extend).
        self.stale = False
        self.worker: Any = None
        self.backend: Any = None
        self.runner: Any = None
        #: Whether the last off step's decode forward replayed a CUDA graph.
        self.off_graph = False
        #: :meth:`choose` just made the step the re-entry warm-up; the runtime reads this
        #: (only after a choice of 0) for the step's telemetry, and clears it.
        self.reentry_now = False

    # -- decisions (scheduler thread, every decode step) --------------------------------

    def choose(self, steps: int) -> int:
        """The steps SGLang should run for a decode step whose policy chose ``steps``.

        Sets :attr:`off_now` for the forward hooks. Returns ``steps``, except for the
        first step back on after an off period, which runs SGLang's steps=0 once (the
        re-entry warm-up: :attr:`reentry_now` set, for telemetry's ``warmup`` flag).
        """
        if not self.ready:
            self.off_now = False
            return steps
        if steps == 0:
            self.off_now = True
            self.stale = True
            self.counters["off_steps"] += 1
            return 0
        self.off_now = False
        if self.stale:
            self.stale = False
            self.reentry_now = True
            self.counters["off_warmups"] += 1
            return 0
        return steps

    @property
    def prefill_off(self) -> bool:
        """A prefill launched now runs the target alone: skipping is on and the last
        decode step ran the off path (the same on every rank: a function of the choices)."""
        return self.ready and self.skip_prefill and self.stale

    # -- hooks ---------------------------------------------------------------------------

    def hook_table(self) -> dict[str, tuple[Any, str]]:
        """``HookRegistry`` target -> (this switch's hook, ``HookType`` member name)."""
        return {
            f"{EAGLE}.EAGLEWorkerV2.init_cuda_graphs": (self.after_init_cuda_graphs, "AFTER"),
            f"{EAGLE}.EAGLEWorkerV2.verify": (self.around_verify, "AROUND"),
            f"{TP_WORKER}.TpModelWorker.forward_batch_generation": (
                self.around_target_forward, "AROUND"),
            f"{EAGLE}.EagleDraftWorker._draft_extend_for_decode": (
                self.around_draft_extend, "AROUND"),
            f"{EAGLE}.EagleDraftWorker._draft_extend_for_prefill": (
                self.around_draft_prefill, "AROUND"),
        }

    def after_init_cuda_graphs(self, result: Any, worker: Any, *args: Any, **kwargs: Any):
        """AFTER ``EAGLEWorkerV2.init_cuda_graphs``: build the plain decode path, agree."""
        built = False
        if self.build:
            try:
                self._build(worker)
                built = True
            except Exception:
                self.counters["fault_offswitch_build"] += 1
                log.exception("specctl: could not build the plain decode path")
        try:
            from sglang.srt.distributed import get_tp_group

            group = get_tp_group()
            agreed = all_ranks_agree(built, group)
            # A rank that skipped the draft's prefill while another ran it would run
            # different collectives: skip only if every rank was asked to.
            self.skip_prefill = all_ranks_agree(self.skip_prefill, group)
        except Exception:
            self.counters["fault_offswitch_agree"] += 1
            log.exception("specctl: the TP group could not agree on the off path")
            agreed = False
        self.ready = built and agreed
        if built and not agreed:
            log.warning("specctl: another TP rank has no plain decode path (its "
                        "SPECCTL_OFF_PATH is not decode, or building failed); steps=0 is "
                        "SGLang's verify forward + draft extend on every rank")
        return None

    def around_verify(self, original: Any, worker: Any, batch: Any, *args: Any,
                      **kwargs: Any) -> Any:
        """AROUND ``EAGLEWorkerV2.verify``: an off step plans no verify graph.

        SGLang's verify prepares its CUDA graph on the plan stream (``load_batch``: the
        verify attention metadata over every request's whole prefix) before the target
        forward; on an off step that forward runs the decode graph instead, so the
        preparation would be paid for nothing. With the verify runner hidden, SGLang
        takes its own non-graph route through the preparation (no ``load_batch``) and
        the forward hook below plans the decode graph alone.
        """
        if (not self.off_now or worker is not self.worker
                or batch.forward_mode.is_idle()):
            return original(worker, batch, *args, **kwargs)
        model_runner = worker.target_worker.model_runner
        saved = model_runner.decode_cuda_graph_runner
        model_runner.decode_cuda_graph_runner = None
        try:
            result = original(worker, batch, *args, **kwargs)
        finally:
            model_runner.decode_cuda_graph_runner = saved
        # SGLang reports whether the (hidden) verify graph ran; report the decode one.
        result.can_run_cuda_graph = self.off_graph
        return result

    def around_target_forward(self, original: Any, tp_worker: Any, *args: Any,
                              **kwargs: Any) -> Any:
        """AROUND ``TpModelWorker.forward_batch_generation``: off steps decode plainly."""
        forward_batch = kwargs.get("forward_batch")
        if (not self.off_now or not kwargs.get("is_verify") or forward_batch is None
                or forward_batch.forward_mode.is_idle()
                or tp_worker is not self.worker.target_worker):
            return original(tp_worker, *args, **kwargs)
        runner = tp_worker.model_runner
        saved = runner.decode_cuda_graph_runner, runner.attn_backend
        runner.decode_cuda_graph_runner, runner.attn_backend = self.runner, self.backend
        try:
            result = original(tp_worker, *args,
                              **{**kwargs, "forward_batch": self._as_decode(forward_batch)})
            self.off_graph = bool(getattr(result, "can_run_cuda_graph", False))
            return result
        finally:
            runner.decode_cuda_graph_runner, runner.attn_backend = saved

    def around_draft_extend(self, original: Any, draft_worker: Any, batch: Any,
                            batch_result: Any, *args: Any, **kwargs: Any) -> Any:
        """AROUND the draft extend after verify: skipped on off steps."""
        if not self.off_now:
            return original(draft_worker, batch, batch_result, *args, **kwargs)
        # SGLang's own stubs for a skipped draft extend (its SKIP_ZERO_STEP flag path):
        # shape-valid zeros the overlap scheduler's future map stashes, never read
        # while off; the warm-up step replaces them before drafting resumes.
        self.worker._stub_skipped_draft_extend(batch, batch_result)
        return None

    def around_draft_prefill(self, original: Any, draft_worker: Any, batch: Any,
                             target_hidden_states: Any, next_token_ids: Any, *args: Any,
                             **kwargs: Any) -> Any:
        """AROUND the draft's extend over a prefill: skipped while off; returns the draft
        input SGLang's would, with the stubs of a skipped draft extend.

        The target's prefill still captures the EAGLE-3 layers' hidden states: its
        prefill CUDA graphs were captured that way, and a prefill without capture missed
        them and ran eagerly (+45 ms per prefill on the H200 MoE, run 5)."""
        if not self.prefill_off or batch.forward_mode.is_idle():
            return original(draft_worker, batch, target_hidden_states, next_token_ids,
                            *args, **kwargs)
        from sglang.srt.speculative.eagle_info import EagleDraftInput

        draft_input = EagleDraftInput(bonus_tokens=next_token_ids, num_tokens_per_req=1,
                                      num_tokens_for_logprob_per_req=1)
        # SGLang's own stubs (shape-valid zeros for the overlap scheduler's future map);
        # the warm-up step replaces them before drafting resumes.
        self.worker._stub_skipped_draft_extend(batch, _Result(draft_input))
        self.counters["off_prefills"] += 1
        return draft_input

    # -- internals -----------------------------------------------------------------------

    def _build(self, worker: Any) -> None:
        from sglang.srt.model_executor.runner.decode_cuda_graph_runner import (
            DecodeCudaGraphRunner,
        )
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        model_runner = worker.target_worker.model_runner
        saved_workspace = model_runner.init_new_workspace
        try:  # a backend of its own, as SGLang builds one per adaptive runtime state
            backend = model_runner._get_attention_backend(init_new_workspace=True)
        finally:
            model_runner.init_new_workspace = saved_workspace
        graphs = type(model_runner.decode_cuda_graph_runner).__name__ != "EagerRunner" and (
            model_runner.decode_cuda_graph_runner is not None)
        runner = None
        if graphs:
            # The runner captures TARGET_VERIFY graphs whenever the model runner is
            # speculative; for the length of the capture it is not.
            saved_algorithm = model_runner.spec_algorithm
            model_runner.spec_algorithm = SpeculativeAlgorithm.NONE
            try:
                runner = DecodeCudaGraphRunner(model_runner, attn_backend=backend,
                                               speculative_num_steps=0,
                                               speculative_num_draft_tokens=1)
            finally:
                model_runner.spec_algorithm = saved_algorithm
        self.worker, self.backend, self.runner = worker, backend, runner
        log.info("specctl: plain decode path for steps=0 built (CUDA graphs: %s)",
                 "batch sizes " + str(runner.capture_bs) if runner is not None else "off")

    def _as_decode(self, verify: Any) -> Any:
        """The one-token verify forward batch as the equivalent plain decode batch.

        In SGLang's speculative layout ``seq_lens`` counts the tokens before this
        step's input token, which sits at position ``seq_lens`` in the slot
        ``out_cache_loc``; a decode batch counts the input token too.
        """
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        decode = copy.copy(verify)
        decode.forward_mode = ForwardMode.DECODE
        decode.global_forward_mode = ForwardMode.DECODE
        decode.positions = verify.seq_lens.to(verify.positions.dtype)
        decode.seq_lens = verify.seq_lens + 1
        decode.orig_seq_lens = decode.seq_lens
        if verify.seq_lens_cpu is not None:
            decode.seq_lens_cpu = verify.seq_lens_cpu + 1
        if verify.seq_lens_sum is not None:
            decode.seq_lens_sum = verify.seq_lens_sum + verify.batch_size
        decode.spec_info = None
        decode.spec_algorithm = SpeculativeAlgorithm.NONE
        decode.capture_hidden_mode = CaptureHiddenMode.NULL
        decode.forward_metadata_ready = False  # planned for the verify graph, not this one
        self.counters["off_forwards"] += 1
        return decode


class _Result:
    """The one field of a batch result that ``_stub_skipped_draft_extend`` fills."""

    def __init__(self, next_draft_input: Any) -> None:
        self.next_draft_input = next_draft_input


def all_ranks_agree(ok: bool, group: Any) -> bool:
    """Whether ``ok`` holds on every rank of ``group`` (an SGLang ``GroupCoordinator``).

    A collective: every rank of the group must call it, at the same point. It runs on
    the group's CPU (gloo) group, once, at start-up.
    """
    if group.world_size <= 1:
        return ok
    import torch

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group.cpu_group)
    return bool(flag.item())
