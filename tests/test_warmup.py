"""The start-up warm-up's parts that need no SGLang: the ramp, the depth cycle, how warm-up
requests are told apart, and the HTTP half's requests (with stand-ins for SGLang's request
class and tokenizer manager). The scheduler half on SGLang's real adaptive classes:
``tests/test_sglang_inside.py``; the registration in SGLang's processes:
``tests/test_sglang_versions.py``."""

from __future__ import annotations

import asyncio
import logging
import sys
import types

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sglang_hooks import config, warmup
from sglang_hooks.testing import GenerateReqInputStandIn, TokenizerManagerStandIn


@given(st.integers(1, 5000))
def test_the_ramp_has_one_batch_in_every_power_of_two_bucket_up_to_the_limit(limit):
    sizes = warmup.ramp(limit)
    top = 1 << (limit - 1).bit_length()
    expected = [1 << k for k in range(top.bit_length())]
    assert sorted(warmup.bucket(s) for s in sizes) == expected
    assert max(sizes) == limit and sizes == tuple(sorted(set(sizes)))


def test_ramp_examples_and_buckets():
    assert warmup.ramp(48) == (1, 2, 4, 8, 16, 32, 48)
    assert warmup.ramp(64) == (1, 2, 4, 8, 16, 32, 64)
    assert warmup.ramp(1) == (1,)
    assert [warmup.bucket(n) for n in (1, 2, 3, 4, 5, 33, 48, 64, 65)] == [
        1, 2, 4, 4, 8, 64, 64, 64, 128]


def test_the_cycle_runs_off_then_repeats_the_first_depth_after_it():
    assert warmup.cycle(range(8)) == (0, 1, 1, 2, 3, 4, 5, 6, 7)
    assert warmup.cycle([3, 0, 1, 3]) == (0, 1, 1, 3)
    assert warmup.cycle([2, 5]) == (2, 5)
    assert warmup.cycle([0]) == (0,)


class _Arrival:
    def __init__(self, rid, n: int = 4) -> None:
        self.rid, self.input_ids = rid, list(range(n))


class _Abort:  # has a rid, is no generate request
    def __init__(self, rid: str) -> None:
        self.rid = rid


def test_arrivals_open_on_warmup_requests_and_close_on_any_other_generate_request():
    w = warmup.PREFIX
    assert warmup.arrivals([_Arrival(f"{w}1-0"), _Arrival(f"{w}1-1")]) is True
    assert warmup.arrivals([_Arrival(f"{w}1-0"), _Arrival("user-7")]) is False
    assert warmup.arrivals([_Arrival("user-7"), _Arrival(f"{w}1-0")]) is False
    batch = types.SimpleNamespace(batch=[_Arrival(f"{w}2-0"), _Arrival(f"{w}2-1")])
    assert warmup.arrivals([batch]) is True
    assert warmup.arrivals([types.SimpleNamespace(batch=[_Arrival("x")])]) is False
    # Neither: no generate request (an abort, a marker-like tuple, a rid that is no string).
    assert warmup.arrivals([_Abort("user-1"), (1, 2), _Arrival(None), _Arrival(7)]) is None
    assert warmup.arrivals([]) is None
    # The prefix must start the id.
    assert warmup.arrivals([_Arrival(f"x-{w}1-0")]) is False


def test_a_batch_is_a_warmup_batch_if_any_request_is_one():
    reqs = [types.SimpleNamespace(rid=r) for r in ("a", "b", f"{warmup.PREFIX}4-3")]
    assert warmup.in_batch(reqs) and not warmup.in_batch(reqs[:2])
    assert not warmup.in_batch([types.SimpleNamespace(rid=None)])
    assert not warmup.in_batch([])


# -- the HTTP server's half ----------------------------------------------------------------


@pytest.fixture
def io_struct(monkeypatch):
    """The warm-up's request class, as SGLang's module (which needs a GPU stack)."""
    module = types.ModuleType("sglang.srt.managers.io_struct")
    module.GenerateReqInput = GenerateReqInputStandIn
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct", module)
    monkeypatch.delenv("SPECCTL_WARMUP_MAX_BS", raising=False)
    monkeypatch.delenv("SPECCTL_WARMUP_TOKENS", raising=False)


def test_the_warmup_sends_one_batch_per_ramp_size_each_finished_before_the_next(io_struct):
    tm = TokenizerManagerStandIn(max_running_requests=48, vocab_size=500)
    asyncio.run(warmup.run("null", tm))
    sizes = warmup.ramp(48)
    assert tm.events == [(kind, s) for s in sizes for kind in ("sent", "done")]
    rids = [rid for r in tm.requests for rid in r.rid]
    assert len(rids) == len(set(rids)) == sum(sizes)
    assert all(rid.startswith(warmup.PREFIX) for rid in rids)
    for request, size in zip(tm.requests, sizes, strict=True):
        assert len(request.input_ids) == len(request.rid) == size
        assert all(ids == request.input_ids[0] for ids in request.input_ids)
        assert len(request.input_ids[0]) == warmup.PROMPT_TOKENS
        assert all(1 <= i < 500 for i in request.input_ids[0])
        assert request.sampling_params == {"max_new_tokens": 64, "ignore_eos": True,
                                           "temperature": 0.0}
        assert request.stream is False


def test_the_limit_comes_from_the_variable_then_the_server_then_the_default(io_struct,
                                                                          monkeypatch):
    def sent(tm) -> list[int]:
        asyncio.run(warmup.run("null", tm))
        return [len(r.rid) for r in tm.requests]

    assert sent(TokenizerManagerStandIn(max_running_requests=None)) == list(
        warmup.ramp(warmup.DEFAULT_LIMIT))
    assert sent(TokenizerManagerStandIn(max_running_requests=12)) == [1, 2, 4, 8, 12]
    monkeypatch.setenv("SPECCTL_WARMUP_MAX_BS", "5")
    monkeypatch.setenv("SPECCTL_WARMUP_TOKENS", "24")
    tm = TokenizerManagerStandIn(max_running_requests=12)
    assert sent(tm) == [1, 2, 4, 5]
    assert tm.requests[0].sampling_params["max_new_tokens"] == 24


@pytest.mark.parametrize("env", [{"SPECCTL_WARMUP_TOKENS": "3"},
                                 {"SPECCTL_WARMUP_MAX_BS": "many"}])
def test_a_bad_variable_skips_the_warmup_with_a_warning(io_struct, monkeypatch, caplog, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    tm = TokenizerManagerStandIn(max_running_requests=8)
    with caplog.at_level(logging.WARNING, "sglang_hooks.warmup"):
        asyncio.run(warmup.run("null", tm))
    assert tm.requests == []
    assert "warm-up skipped, bad configuration" in caplog.text


def test_a_disaggregated_server_is_not_warmed(io_struct, caplog):
    tm = TokenizerManagerStandIn(max_running_requests=8)
    with caplog.at_level(logging.WARNING, "sglang_hooks.warmup"):
        asyncio.run(warmup.run("decode", tm))
    assert tm.requests == [] and "disaggregated" in caplog.text


def test_a_failed_batch_stops_the_warmup_without_stopping_the_server(io_struct, caplog):
    tm = TokenizerManagerStandIn(max_running_requests=8, fail_at=4)
    with caplog.at_level(logging.ERROR, "sglang_hooks.warmup"):
        asyncio.run(warmup.run("null", tm))  # does not raise
    assert [len(r.rid) for r in tm.requests] == [1, 2, 4]
    assert "warm-up failed at batch 4" in caplog.text


def test_warmup_settings_defaults_and_bounds():
    assert config.warmup_settings({}) == config.WarmupSettings(None, 64)
    assert config.warmup_settings({"SPECCTL_WARMUP_MAX_BS": "48",
                                   "SPECCTL_WARMUP_TOKENS": "32"}) == config.WarmupSettings(48, 32)
    for bad in ({"SPECCTL_WARMUP_MAX_BS": "0"}, {"SPECCTL_WARMUP_TOKENS": "2000"}):
        with pytest.raises(config.ConfigError):
            config.warmup_settings(bad)
    # The warm-up's variables do not turn the plugin on.
    assert config.from_env({"SPECCTL_WARMUP_MAX_BS": "48"}) is None
