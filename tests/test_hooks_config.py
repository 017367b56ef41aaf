"""The plugin's environment variables: off unless asked, and errors that name the variable."""

from __future__ import annotations

import pytest

from sglang_hooks import config
from sglang_hooks.config import ConfigError, PluginConfig, from_env
from sglang_hooks.testing import wait_until


def test_nothing_set_means_disabled():
    assert from_env({}) is None
    assert from_env({"SPECCTL_TIMEOUT_MS": "20", "SPECCTL_SERVER": "a"}) is None


def test_a_full_configuration(tmp_path):
    table = tmp_path / "table.json"
    table.write_text('{"32": 1, "1": 3, "64": 0}')
    cfg = from_env({
        "SPECCTL_CONTROLLER": "tcp://127.0.0.1:5557", "SPECCTL_FALLBACK": f"table:{table}",
        "SPECCTL_TIMEOUT_MS": "25", "SPECCTL_RECORD": str(tmp_path), "SPECCTL_SERVER": "gpu0",
    })
    assert cfg == PluginConfig(controller="tcp://127.0.0.1:5557", fallback="table",
                               table=((1, 3), (32, 1), (64, 0)), timeout_s=0.025,
                               record_dir=str(tmp_path), server="gpu0")
    assert cfg.rule == "table"


def test_a_prefill_while_off_skips_the_draft_unless_asked_to_run_it():
    assert from_env({"SPECCTL_FALLBACK": "sglang"}).off_prefill == "skip"
    cfg = from_env({"SPECCTL_FALLBACK": "sglang", "SPECCTL_OFF_PREFILL": "draft"})
    assert cfg.off_prefill == "draft"
    # A follower rank (no other SPECCTL_* variable) reads the same variable.
    assert config.off_prefill({}) == "skip"
    assert config.off_prefill({"SPECCTL_OFF_PREFILL": "draft"}) == "draft"


def test_the_io_threads_look_interval_is_the_clients_default_unless_set():
    from sglang_hooks.client import _POLL_S, ControllerClient, Hello

    assert from_env({"SPECCTL_CONTROLLER": "ipc:///x"}).io_poll_s is None
    cfg = from_env({"SPECCTL_CONTROLLER": "ipc:///x", "SPECCTL_IO_POLL_US": "1000"})
    assert cfg.io_poll_s == pytest.approx(0.001) != _POLL_S
    hello = Hello("s", 0, [0, 3], "test")
    for poll_s, expected in ((None, _POLL_S), (cfg.io_poll_s, 0.001)):
        client = ControllerClient(None, hello, 0.1, poll_s=poll_s)
        try:
            assert client._poll_s == pytest.approx(expected)
        finally:
            client.close()


def test_exploration_is_a_record_mode():
    cfg = from_env({"SPECCTL_RECORD": "/tmp/t", "SPECCTL_RECORD_EXPLORE": "1",
                    "SPECCTL_EXPLORE_DWELL": "8"})
    assert cfg.rule == "explore" and cfg.explore_dwell == 8


@pytest.mark.parametrize(("env", "message"), [
    ({"SPECCTL_CONTROLLER": "localhost:5557"}, "SPECCTL_CONTROLLER='localhost:5557'"),
    ({"SPECCTL_FALLBACK": "ema"}, "SPECCTL_FALLBACK='ema'"),
    ({"SPECCTL_FALLBACK": "sglang", "SPECCTL_OFF_PREFILL": "none"},
     "SPECCTL_OFF_PREFILL='none': expected one of skip, draft"),
    ({"SPECCTL_FALLBACK": "table:{1: 2}"}, "SPECCTL_FALLBACK table is not JSON"),
    ({"SPECCTL_FALLBACK": 'table:{"x": 2}'}, "SPECCTL_FALLBACK table entry 'x'"),
    ({"SPECCTL_FALLBACK": 'table:{"4": -1}'}, "SPECCTL_FALLBACK table entry '4'"),
    ({"SPECCTL_FALLBACK": "table:/no/such/file"}, "SPECCTL_FALLBACK table file /no/such/file"),
    ({"SPECCTL_CONTROLLER": "ipc:///x", "SPECCTL_TIMEOUT_MS": "5"}, "SPECCTL_TIMEOUT_MS='5'"),
    ({"SPECCTL_CONTROLLER": "ipc:///x", "SPECCTL_IO_POLL_US": "5"}, "SPECCTL_IO_POLL_US='5'"),
    ({"SPECCTL_CONTROLLER": "ipc:///x", "SPECCTL_IO_POLL_US": "1e6"},
     "SPECCTL_IO_POLL_US='1e6': must be <= 20000"),
    ({"SPECCTL_RECORD_EXPLORE": "1", "SPECCTL_FALLBACK": "sglang"}, "needs SPECCTL_RECORD"),
    ({"SPECCTL_RECORD": "/tmp/t", "SPECCTL_RECORD_EXPLORE": "maybe"}, "SPECCTL_RECORD_EXPLORE"),
    ({"SPECCTL_FALLBACK": "sglang", "SPECCTL_HOOK_TIMING_CPU": "1"},
     "SPECCTL_HOOK_TIMING_CPU=1 .* needs SPECCTL_HOOK_TIMING"),
    ({"SPECCTL_FALLBACK": "sglang", "SPECCTL_HOOK_TIMING": "/tmp/h",
      "SPECCTL_HOOK_TIMING_CPU": "yes please"},
     "SPECCTL_HOOK_TIMING_CPU='yes please'"),
])
def test_errors_name_the_variable(env, message):
    with pytest.raises(ConfigError, match=message.replace("{", r"\{").replace("(", r"\(")):
        from_env(env)


def test_local_mode_takes_a_policy_file_and_its_profile(tmp_path):
    policy = tmp_path / "policy.npz"
    policy.write_bytes(b"checked when loaded")
    cfg = from_env({"SPECCTL_POLICY": str(policy), "SPECCTL_PROFILE": "h200_llama31_8b"})
    assert (cfg.policy, cfg.profile, cfg.controller) == (str(policy), "h200_llama31_8b", None)
    with pytest.raises(ConfigError, match="SPECCTL_POLICY"):
        from_env({"SPECCTL_POLICY": str(tmp_path / "missing.npz")})
    with pytest.raises(ConfigError, match="SPECCTL_PROFILE"):
        from_env({"SPECCTL_CONTROLLER": "ipc:///tmp/x", "SPECCTL_PROFILE": "h200_llama31_8b"})


def test_local_mode_turns_the_acceptance_probe_on_or_off(tmp_path):
    policy = tmp_path / "policy.npz"
    policy.write_bytes(b"checked when loaded")
    assert from_env({"SPECCTL_POLICY": str(policy)}).probe is None  # as the file says
    assert from_env({"SPECCTL_POLICY": str(policy), "SPECCTL_PROBE": "0"}).probe is False
    assert from_env({"SPECCTL_POLICY": str(policy), "SPECCTL_PROBE": "1"}).probe is True
    with pytest.raises(ConfigError, match="SPECCTL_PROBE"):
        from_env({"SPECCTL_POLICY": str(policy), "SPECCTL_PROBE": "maybe"})
    with pytest.raises(ConfigError, match="SPECCTL_PROBE"):  # specctl-serve has its own
        from_env({"SPECCTL_CONTROLLER": "ipc:///tmp/x", "SPECCTL_PROBE": "0"})


def test_local_mode_turns_the_goodput_guard_on_or_off(tmp_path):
    policy = tmp_path / "policy.npz"
    policy.write_bytes(b"checked when loaded")
    cfg = from_env({"SPECCTL_POLICY": str(policy)})
    assert (cfg.guard, cfg.probe) == (None, None)  # as the file says
    cfg = from_env({"SPECCTL_POLICY": str(policy), "SPECCTL_GUARD": "0"})
    assert (cfg.guard, cfg.probe) == (False, None)  # the probe is another switch
    assert from_env({"SPECCTL_POLICY": str(policy), "SPECCTL_GUARD": "1"}).guard is True
    with pytest.raises(ConfigError, match="SPECCTL_GUARD='maybe'"):
        from_env({"SPECCTL_POLICY": str(policy), "SPECCTL_GUARD": "maybe"})
    with pytest.raises(ConfigError, match=r"SPECCTL_GUARD .*SPECCTL_POLICY.*guard\.enabled"):
        from_env({"SPECCTL_CONTROLLER": "ipc:///tmp/x", "SPECCTL_GUARD": "0"})


def test_plain_looks_are_asked_for_by_a_flag_and_reach_the_client():
    from controller.wire import DecisionDecoder
    from sglang_hooks.client import ControllerClient, Hello

    assert from_env({"SPECCTL_CONTROLLER": "ipc:///x"}).io_plain_looks is False
    cfg = from_env({"SPECCTL_CONTROLLER": "ipc:///x", "SPECCTL_IO_PLAIN_LOOKS": "1"})
    assert cfg.io_plain_looks is True
    assert from_env({"SPECCTL_CONTROLLER": "ipc:///x"}).io_held_send is False
    assert from_env({"SPECCTL_CONTROLLER": "ipc:///x",
                     "SPECCTL_IO_HELD_SEND": "1"}).io_held_send is True
    with pytest.raises(ConfigError, match="SPECCTL_IO_PLAIN_LOOKS"):
        from_env({"SPECCTL_CONTROLLER": "ipc:///x", "SPECCTL_IO_PLAIN_LOOKS": "maybe"})
    hello = Hello("s", 0, [0, 3], "test")
    for plain in (False, True):
        client = ControllerClient("ipc:///nowhere-plain", hello, 0.1, plain_looks=plain)
        try:
            wait_until(lambda c=client: c._held is not None, "the I/O thread started")
            assert (client._held._c is None) == plain
            assert isinstance(client._decode, DecisionDecoder) != plain
        finally:
            client.close()


def test_the_hook_timings_cpu_split_is_asked_for_by_its_own_variable():
    on = {"SPECCTL_FALLBACK": "sglang", "SPECCTL_HOOK_TIMING": "/tmp/h"}
    assert not from_env(on).hook_timing_cpu
    cfg = from_env({**on, "SPECCTL_HOOK_TIMING_CPU": "1"})
    assert cfg.hook_timing == "/tmp/h" and cfg.hook_timing_cpu
