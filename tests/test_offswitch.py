"""The off switch (:mod:`sglang_hooks.offswitch`) on the CPU, with SGLang's pieces stood in.

What only the GPU can show (the plain decode graph, greedy outputs equal to a server
without speculation, the step costs) was measured on an H200: ``docs/OFFSWITCH.md``.
Here: which steps run off or warm up, what the hooks hand SGLang, that the model runner
is restored, and that the TP group agrees on the path.
"""

from __future__ import annotations

import dataclasses
import enum
import sys
import types
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sglang_hooks.offswitch import OffSwitch, all_ranks_agree


class ForwardMode(enum.Enum):
    DECODE = 1
    TARGET_VERIFY = 2
    IDLE = 3
    EXTEND = 4

    def is_idle(self) -> bool:
        return self is ForwardMode.IDLE

    def is_extend(self) -> bool:
        return self is ForwardMode.EXTEND


class CaptureHiddenMode(enum.IntEnum):
    NULL = 0
    FULL = 2


class SpeculativeAlgorithm(enum.Enum):
    NONE = 0
    EAGLE3 = 1


@dataclasses.dataclass
class EagleDraftInput:
    """SGLang's dataclass, with the fields a prefill's draft input is built from."""

    bonus_tokens: object = None
    num_tokens_per_req: int = -1
    num_tokens_for_logprob_per_req: int = -1


@pytest.fixture
def sglang_stand_ins(monkeypatch):
    """The few SGLang names the off switch imports, as modules of stand-ins."""
    modules = {
        "sglang": {}, "sglang.srt": {}, "sglang.srt.model_executor": {},
        "sglang.srt.model_executor.forward_batch_info": {
            "ForwardMode": ForwardMode, "CaptureHiddenMode": CaptureHiddenMode},
        "sglang.srt.speculative": {},
        "sglang.srt.speculative.spec_info": {"SpeculativeAlgorithm": SpeculativeAlgorithm},
        "sglang.srt.speculative.eagle_info": {"EagleDraftInput": EagleDraftInput},
    }
    for name, attributes in modules.items():
        module = types.ModuleType(name)
        module.__dict__.update(attributes)
        monkeypatch.setitem(sys.modules, name, module)


def ready_switch() -> OffSwitch:
    switch = OffSwitch(Counter())
    switch.ready = True
    model_runner = SimpleNamespace(decode_cuda_graph_runner="verify graphs",
                                   attn_backend="verify backend")
    switch.worker = SimpleNamespace(target_worker=SimpleNamespace(model_runner=model_runner),
                                    stubbed=[])
    switch.worker._stub_skipped_draft_extend = (
        lambda batch, result: switch.worker.stubbed.append((batch, result)))
    switch.runner, switch.backend = "decode graphs", "decode backend"
    return switch


def verify_batch(mode: ForwardMode = ForwardMode.TARGET_VERIFY) -> SimpleNamespace:
    """A one-token verify batch: two requests with 5 and 9 tokens before this step's."""
    return SimpleNamespace(
        forward_mode=mode, global_forward_mode=mode, batch_size=2,
        positions=torch.tensor([5, 9]), seq_lens=torch.tensor([5, 9]),
        orig_seq_lens=torch.tensor([5, 9]), seq_lens_cpu=torch.tensor([5, 9]), seq_lens_sum=14,
        spec_info=object(), spec_algorithm=SpeculativeAlgorithm.EAGLE3,
        capture_hidden_mode=CaptureHiddenMode.FULL, forward_metadata_ready=True,
        input_ids=torch.tensor([11, 12]), out_cache_loc=torch.tensor([100, 200]))


def test_off_steps_and_the_warm_up_step_back_on():
    switch = ready_switch()
    asked = [3, 0, 0, 3, 3, 0, 5, 1]
    ran, off = [], []
    for steps in asked:
        ran.append(switch.choose(steps))
        off.append(switch.off_now)
    # The first step back on after an off period runs SGLang's steps=0 (the draft's
    # warm-up), which is not an off step.
    assert ran == [3, 0, 0, 0, 3, 0, 0, 1]
    assert off == [False, True, True, False, False, True, False, False]
    assert switch.counters["off_steps"] == 3 and switch.counters["off_warmups"] == 2


def test_without_the_plain_decode_path_steps_pass_through():
    switch = OffSwitch(Counter())
    assert [switch.choose(s) for s in (0, 0, 3, 0, 2)] == [0, 0, 3, 0, 2]
    assert not switch.off_now and not switch.counters


def test_an_off_step_runs_the_verify_forward_as_a_plain_decode(sglang_stand_ins):
    switch = ready_switch()
    switch.choose(0)
    tp_worker = switch.worker.target_worker
    verify = verify_batch()
    seen = {}

    def original(worker, *args, **kwargs):
        runner = worker.model_runner
        seen.update(graphs=runner.decode_cuda_graph_runner, backend=runner.attn_backend,
                    batch=kwargs["forward_batch"], is_verify=kwargs["is_verify"])
        return "logits"

    out = switch.around_target_forward(original, tp_worker, batch=None, forward_batch=verify,
                                       is_verify=True)
    assert out == "logits"
    assert (seen["graphs"], seen["backend"]) == ("decode graphs", "decode backend")
    decode = seen["batch"]
    assert decode.forward_mode is ForwardMode.DECODE
    assert decode.global_forward_mode is ForwardMode.DECODE
    # The input token sits at position seq_lens and a decode batch counts it.
    assert decode.positions.tolist() == [5, 9]
    assert decode.seq_lens.tolist() == [6, 10] and decode.seq_lens_cpu.tolist() == [6, 10]
    assert decode.orig_seq_lens.tolist() == [6, 10] and decode.seq_lens_sum == 16
    assert decode.spec_info is None and decode.spec_algorithm is SpeculativeAlgorithm.NONE
    assert decode.capture_hidden_mode is CaptureHiddenMode.NULL
    assert decode.forward_metadata_ready is False  # planned for the verify graph only
    assert decode.input_ids is verify.input_ids and decode.out_cache_loc is verify.out_cache_loc
    # SGLang's verify batch is left as it was, and so is the model runner.
    assert verify.forward_mode is ForwardMode.TARGET_VERIFY and verify.seq_lens.tolist() == [5, 9]
    assert verify.forward_metadata_ready is True
    runner = tp_worker.model_runner
    assert (runner.decode_cuda_graph_runner, runner.attn_backend) == (
        "verify graphs", "verify backend")


def test_the_model_runner_is_restored_when_the_forward_raises(sglang_stand_ins):
    switch = ready_switch()
    switch.choose(0)
    tp_worker = switch.worker.target_worker

    def original(worker, *args, **kwargs):
        raise RuntimeError("CUDA error")

    with pytest.raises(RuntimeError, match="CUDA error"):
        switch.around_target_forward(original, tp_worker, batch=None,
                                     forward_batch=verify_batch(), is_verify=True)
    runner = tp_worker.model_runner
    assert (runner.decode_cuda_graph_runner, runner.attn_backend) == (
        "verify graphs", "verify backend")


@pytest.mark.parametrize("case", ["on_step", "not_verify", "idle", "draft_worker"])
def test_other_forwards_are_untouched(case):
    switch = ready_switch()
    switch.choose(3 if case == "on_step" else 0)
    batch = verify_batch(ForwardMode.IDLE if case == "idle" else ForwardMode.TARGET_VERIFY)
    worker = (SimpleNamespace(model_runner=None) if case == "draft_worker"
              else switch.worker.target_worker)
    kwargs = {"batch": None, "forward_batch": batch, "is_verify": case != "not_verify"}
    calls = []

    def original(tp_worker, *args, **kw):
        calls.append((tp_worker, kw))
        return "out"

    assert switch.around_target_forward(original, worker, **kwargs) == "out"
    assert calls == [(worker, kwargs)] and calls[0][1]["forward_batch"] is batch
    assert switch.counters["off_forwards"] == 0


def test_an_off_step_plans_no_verify_graph_and_reports_the_decode_graph(sglang_stand_ins):
    """SGLang's verify sees no graph runner (its non-graph route: no verify ``load_batch``);
    the forward inside it still gets the decode runner; afterwards all is restored."""
    switch = ready_switch()
    switch.choose(0)
    model_runner = switch.worker.target_worker.model_runner
    seen = {}

    def target_forward(tp_worker, *args, **kwargs):
        seen["forward"] = tp_worker.model_runner.decode_cuda_graph_runner
        return SimpleNamespace(can_run_cuda_graph=True)

    def verify(worker, batch):
        seen["prepare"] = worker.target_worker.model_runner.decode_cuda_graph_runner
        switch.around_target_forward(target_forward, worker.target_worker, batch=None,
                                     forward_batch=verify_batch(), is_verify=True)
        seen["after_forward"] = worker.target_worker.model_runner.decode_cuda_graph_runner
        return SimpleNamespace(can_run_cuda_graph=False)  # the hidden verify graph's

    result = switch.around_verify(verify, switch.worker, verify_batch())
    assert seen == {"prepare": None, "forward": "decode graphs", "after_forward": None}
    assert result.can_run_cuda_graph is True
    assert model_runner.decode_cuda_graph_runner == "verify graphs"


@pytest.mark.parametrize("case", ["on_step", "idle", "other_worker", "raises"])
def test_verify_keeps_its_graph_runner_unless_off(case):
    switch = ready_switch()
    switch.choose(3 if case == "on_step" else 0)
    worker = SimpleNamespace(target_worker=switch.worker.target_worker) if (
        case == "other_worker") else switch.worker
    batch = verify_batch(ForwardMode.IDLE if case == "idle" else ForwardMode.TARGET_VERIFY)
    seen = []

    def verify(w, b):
        seen.append(w.target_worker.model_runner.decode_cuda_graph_runner)
        if case == "raises":
            raise RuntimeError("CUDA error")
        return SimpleNamespace(can_run_cuda_graph="verify's own")

    if case == "raises":
        with pytest.raises(RuntimeError, match="CUDA error"):
            switch.around_verify(verify, worker, batch)
        assert seen == [None]
    else:
        assert switch.around_verify(verify, worker, batch).can_run_cuda_graph == "verify's own"
        assert seen == ["verify graphs"]
    assert switch.worker.target_worker.model_runner.decode_cuda_graph_runner == "verify graphs"


@pytest.mark.parametrize("off", [True, False])
def test_the_draft_extend_is_skipped_only_on_off_steps(off):
    switch = ready_switch()
    switch.choose(0 if off else 3)
    calls = []
    out = switch.around_draft_extend(lambda *a, **k: calls.append(a) or "extended",
                                     "draft worker", "batch", "result")
    if off:
        assert out is None and calls == [] and switch.worker.stubbed == [("batch", "result")]
    else:
        assert out == "extended" and calls == [("draft worker", "batch", "result")]
        assert switch.worker.stubbed == []


def _agree(rank: int, oks: list[bool], init_file: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=len(oks))
    try:
        group = SimpleNamespace(world_size=len(oks), cpu_group=dist.group.WORLD)
        results[rank] = all_ranks_agree(oks[rank], group)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("oks", [[True, True], [True, False], [False, True]])
def test_the_tp_group_uses_the_path_only_if_every_rank_built_it(oks, tmp_path):
    results = mp.Manager().dict()
    mp.spawn(_agree, args=(oks, str(tmp_path / "init"), results), nprocs=len(oks), join=True)
    assert [results[r] for r in range(len(oks))] == [all(oks)] * len(oks)


def test_a_single_rank_agrees_with_itself():
    group = SimpleNamespace(world_size=1, cpu_group=None)
    assert all_ranks_agree(True, group) is True and all_ranks_agree(False, group) is False


def test_a_rank_asked_not_to_build_still_takes_part_and_stays_off(monkeypatch):
    calls = []
    module = types.ModuleType("sglang.srt.distributed")
    module.get_tp_group = lambda: SimpleNamespace(world_size=1, cpu_group=None)
    monkeypatch.setitem(sys.modules, "sglang.srt.distributed", module)
    monkeypatch.setattr("sglang_hooks.offswitch.all_ranks_agree",
                        lambda ok, group: calls.append(ok) or ok)
    switch = OffSwitch(Counter(), build=False)
    switch.after_init_cuda_graphs(None, SimpleNamespace())
    # Two agreements, in the same order on every rank: the path, then the prefill skip.
    assert calls == [False, True] and not switch.ready and switch.choose(0) == 0
    assert not switch.off_now


def test_the_prefill_skip_holds_only_if_every_rank_asked_for_it(monkeypatch):
    module = types.ModuleType("sglang.srt.distributed")
    module.get_tp_group = lambda: SimpleNamespace(world_size=2, cpu_group=None)
    monkeypatch.setitem(sys.modules, "sglang.srt.distributed", module)
    # The other rank built the path but was asked for SPECCTL_OFF_PREFILL=draft.
    other_rank = {"built": True, "skip": False}
    answers = iter([other_rank["built"], other_rank["skip"]])
    monkeypatch.setattr("sglang_hooks.offswitch.all_ranks_agree",
                        lambda ok, group: ok and next(answers))
    switch = OffSwitch(Counter(), skip_prefill=True)
    monkeypatch.setattr(switch, "_build", lambda worker: None)
    switch.after_init_cuda_graphs(None, SimpleNamespace())
    assert switch.ready and not switch.skip_prefill
    switch.choose(0)
    assert switch.off_now and not switch.prefill_off


def test_a_failed_build_is_counted_and_leaves_steps_zero_to_sglang(monkeypatch):
    module = types.ModuleType("sglang.srt.distributed")
    module.get_tp_group = lambda: SimpleNamespace(world_size=1, cpu_group=None)
    monkeypatch.setitem(sys.modules, "sglang.srt.distributed", module)
    switch = OffSwitch(Counter())

    def fail(worker):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(switch, "_build", fail)
    switch.after_init_cuda_graphs(None, SimpleNamespace())
    assert not switch.ready and switch.counters["fault_offswitch_build"] == 1
    switch.choose(0)
    assert not switch.off_now


# -- a prefill while off ----------------------------------------------------------------


def prefill_batch(mode: ForwardMode = ForwardMode.EXTEND) -> SimpleNamespace:
    return SimpleNamespace(forward_mode=mode)


def run_prefill(switch: OffSwitch, batch: SimpleNamespace) -> dict:
    """The draft's extend over a prefill as EAGLEWorkerV2 calls it (after the target's
    forward, which the switch leaves alone). Returns the draft calls and its result."""
    calls = []

    def draft(draft_worker, batch, hidden, next_ids, *args, **kwargs):
        calls.append((draft_worker, batch, hidden, next_ids, args, kwargs))
        return "draft's own input"

    out = switch.around_draft_prefill(draft, "draft worker", batch, "hidden", "next ids",
                                      None, kv_loc_plan="plan")
    return {"calls": calls, "draft_input": out}


def test_a_prefill_while_off_skips_the_drafts_extend(sglang_stand_ins):
    switch = ready_switch()
    switch.choose(0)
    batch = prefill_batch()
    seen = run_prefill(switch, batch)
    assert seen["calls"] == []
    draft_input = seen["draft_input"]
    assert isinstance(draft_input, EagleDraftInput)
    assert draft_input.bonus_tokens == "next ids"
    assert (draft_input.num_tokens_per_req, draft_input.num_tokens_for_logprob_per_req) == (1, 1)
    # SGLang's own stubs fill the rest of the draft input.
    [(stubbed_batch, result)] = switch.worker.stubbed
    assert stubbed_batch is batch and result.next_draft_input is draft_input
    assert switch.counters["off_prefills"] == 1
    # Coming back on still starts with the warm-up, which gives the draft a real state.
    assert switch.choose(3) == 0 and switch.choose(3) == 3


@pytest.mark.parametrize("case", ["on", "skip_not_asked", "not_ready", "idle", "warm_up_ran",
                                  "before_any_decode"])
def test_other_prefills_run_the_drafts_extend(sglang_stand_ins, case):
    switch = ready_switch()
    switch.skip_prefill = case != "skip_not_asked"
    switch.ready = case != "not_ready"
    if case != "before_any_decode":
        switch.choose(3 if case == "on" else 0)
    if case == "warm_up_ran":
        switch.choose(3)  # the warm-up: the draft's state is real again
    batch = prefill_batch(ForwardMode.IDLE if case == "idle" else ForwardMode.EXTEND)
    seen = run_prefill(switch, batch)
    assert seen["calls"] == [("draft worker", batch, "hidden", "next ids", (None,),
                              {"kv_loc_plan": "plan"})]
    assert seen["draft_input"] == "draft's own input"
    assert switch.worker.stubbed == [] and switch.counters["off_prefills"] == 0


def test_the_target_prefill_is_left_alone_while_off(sglang_stand_ins):
    """Its prefill CUDA graphs were captured with the hidden-state capture on: a prefill
    without it missed them and ran eagerly (+45 ms on the H200 MoE, run 5)."""
    switch = ready_switch()
    switch.choose(0)
    calls = []
    kwargs = {"capture_hidden_mode": CaptureHiddenMode.FULL}
    out = switch.around_target_forward(lambda w, *a, **k: calls.append((w, a, k)) or "out",
                                       switch.worker.target_worker, "batch", **kwargs)
    assert out == "out" and calls == [(switch.worker.target_worker, ("batch",), kwargs)]
    assert switch.counters["off_forwards"] == 0
