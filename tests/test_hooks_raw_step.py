"""A step's values as the hooks read them (``sglang_hooks.raw_step``), and the telemetry
the client's and the recorder's threads make of them."""

from __future__ import annotations

from sglang_hooks.raw_step import IDLE_GAP_S, LAUNCH_FIELDS, request_copies, telemetry_of

T0 = 1000.0


def launch(step: int = 7, t: float = T0, is_decode: bool = True, batch: int = 4,
           extend_tokens: int | None = None, requests: list | None = None,
           lens: tuple | None = None) -> tuple:
    # 4 waiting, 3 running before, 10,000 KV tokens, 6,000 + 1,000 of them free.
    return (step, t, is_decode, batch, 4, 3, 10_000, 6_000, 1_000, extend_tokens, requests,
            *(lens or (None, None)))


def test_a_launch_tuple_has_its_named_fields():
    assert len(launch()) == len(LAUNCH_FIELDS) == 13


def test_a_decode_step_reports_its_depth_its_drafts_and_the_time_since_the_last_result():
    drafts = [1, 2, 0, 3]
    step = (launch(), 3, drafts, T0 + 0.25, T0 - 0.03125)  # previous result before launch
    assert telemetry_of("srv", 2, step) == ("srv", 2, 7, T0, 4, 4, 3, 3_000, 10_000, 0, 3,
                                            drafts, 0.28125, None, None)


def test_the_warmup_flag_is_passed_on_for_a_decode_step_and_false_or_unknown_for_an_extend():
    """The runtime's flag (True: the off switch's re-entry warm-up, False: not, None: not
    known) is the telemetry's last item; a tuple of five (before the flag) is unknown; an
    extend step is never a warm-up."""
    for flag in (None, False, True):
        decode = (launch(), 0, None, T0 + 0.25, None, flag)
        assert telemetry_of("srv", 0, decode)[13] is flag
        extend = (launch(is_decode=False, extend_tokens=5), -1, None, T0 + 0.25, None, flag)
        assert telemetry_of("srv", 0, extend)[13] is (None if flag is None else False)
    assert telemetry_of("srv", 0, (launch(), 0, None, T0 + 0.25, None))[13] is None


def test_the_before_prefill_flag_is_passed_on_for_either_kind_of_step():
    """The runtime's flag (whether a prefill was launched before the step's result was
    processed) is the telemetry's 15th item, as given for a decode and an extend step; a
    tuple without it is unknown."""
    for flag in (None, False, True):
        decode = (launch(), 3, [1], T0 + 0.25, None, None, flag)
        extend = (launch(is_decode=False, extend_tokens=5), -1, None, T0 + 0.25, None, None,
                  flag)
        assert telemetry_of("srv", 0, decode)[14] is flag
        assert telemetry_of("srv", 0, extend)[14] is flag
    assert telemetry_of("srv", 0, (launch(), 0, None, T0 + 0.25, None, False))[14] is None


def test_a_decode_step_the_policy_was_not_asked_about_used_no_steps():
    assert telemetry_of("srv", 0, (launch(), -1, None, T0 + 0.25, None))[10] == 0


def test_an_extend_step_counts_its_requests_as_running_and_at_least_a_token_each():
    for extend_tokens, batch, prefill in ((100, 2, 100), (None, 2, 2), (0, 2, 2), (None, 0, 1)):
        step = (launch(is_decode=False, batch=batch, extend_tokens=extend_tokens), 3, None,
                T0 + 0.25, None)
        telemetry = telemetry_of("srv", 0, step)
        assert telemetry[6] == 3 + batch and telemetry[9:11] == (prefill, 0)
        assert telemetry[7:9] == (3_000, 10_000)  # KV used: capacity less both free parts


def test_kv_use_is_never_negative():
    for is_decode in (True, False):
        full = (*launch(is_decode=is_decode)[:7], 9_000, 2_000, *launch()[9:])
        assert telemetry_of("srv", 0, (full, 1, None, T0, None))[7] == 0


def test_latency_runs_from_the_previous_result_unless_none_or_an_idle_gap_before_launch():
    assert telemetry_of("s", 0, (launch(), 1, None, T0 + 0.5, None))[12] == 0.5
    at_gap = T0 - IDLE_GAP_S
    assert telemetry_of("s", 0, (launch(), 1, None, T0 + 0.5, at_gap))[12] == T0 + 0.5 - at_gap
    idle = T0 - 2 * IDLE_GAP_S
    assert telemetry_of("s", 0, (launch(), 1, None, T0 + 0.5, idle))[12] == 0.5


def test_the_recorders_copies_come_out_of_the_launch():
    requests, lens = ["a", "b"], ([0, 512], [100, 200])
    step = (launch(requests=requests, lens=lens), 0, None, T0, None)
    assert request_copies(step) == (requests, lens)
    assert request_copies((launch(), 0, None, T0, None)) == (None, None)
