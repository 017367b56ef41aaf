"""A stand-in SGLang scheduler for tests and benchmarks of the hooks.

SGLang's scheduler cannot run without a GPU, so the tests drive the hooks
through small classes with the same method names and the attributes the hooks
read (``tests/test_sglang_contract.py`` checks those exist in the real source).
:func:`hooked_classes` applies a :class:`~sglang_hooks.runtime.Runtime`'s hooks
to fresh copies of them with SGLang's real ``HookRegistry``, and
:class:`RankLoop` calls them in the order of ``Scheduler.event_loop_overlap``:
pull (source only) -> broadcast -> process_input_requests -> run_batch (next
batch) -> process_batch_result (previous batch). The adaptive controller is the
real one (``AdaptiveController``) with a :class:`WorkerStandIn`.
"""

from __future__ import annotations

import atexit
import importlib.util
import itertools
import os
import shutil
import sys
import tempfile
import time
import types
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sglang_hooks.compat import SCHEDULER_ENTRY
from sglang_hooks.contract import HOOK_TARGETS
from sglang_hooks.runtime import Runtime

#: SGLang's package import pulls in ``triton`` (1 GB) and, in 0.5.15.post1,
#: ``torchvision.io``, for kernels and image decoding that the modules the plugin
#: uses never touch. Without a GPU stack these empty stand-ins take their place.
IMPORT_STAND_INS = {
    "triton/__init__.py": '"""Stand-in: SGLang imports triton at package import."""\n',
    "torchvision/__init__.py": '"""Stand-in: SGLang 0.5.15 imports torchvision.io."""\n',
    "torchvision/io.py": (
        "def decode_jpeg(*args, **kwargs):\n"
        "    raise RuntimeError('torchvision stand-in: no image decoding on a CPU install')\n"
    ),
}


def write_import_stand_ins(directory: str | Path) -> list[str]:
    """Write the stand-ins for the packages that are not installed; returns their names."""
    written = []
    for name, text in IMPORT_STAND_INS.items():
        package = name.split("/")[0]
        if importlib.util.find_spec(package) is None:
            path = Path(directory) / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            written.append(package)
    return sorted(set(written))


def load_plugins_as_scheduler() -> None:
    """Run SGLang's ``load_plugins()`` the way its scheduler processes do: called from
    ``run_scheduler_process`` in the scheduler module (which needs a GPU stack to import,
    so a function of that name and module stands in for it)."""
    module, function = SCHEDULER_ENTRY
    namespace: dict[str, Any] = {"__name__": module}
    exec(f"def {function}():\n    from sglang.srt.plugins import load_plugins\n"
         "    load_plugins()\n", namespace)
    namespace[function]()


def load_plugins_as_http(entry: str = "engine") -> None:
    """Run SGLang's ``load_plugins()`` the way its HTTP server's process does, from
    ``entry``: ``engine`` (``Engine._launch_subprocesses``), ``launch_server`` (the
    module-level code of ``python -m sglang.launch_server``: ``__name__`` is ``__main__``,
    its ``__spec__`` names the module) or ``serve`` (``sglang serve``'s ``serve``). Stand-ins
    of those names call it: the real ones need a GPU stack to import."""
    from importlib.machinery import ModuleSpec

    from sglang_hooks import contract

    call = "from sglang.srt.plugins import load_plugins\nload_plugins()\n"
    if entry == "launch_server":
        namespace: dict[str, Any] = {"__name__": "__main__",
                                     "__spec__": ModuleSpec(contract.LAUNCH_SERVER, None)}
        exec(compile(call, "<launch_server>", "exec"), namespace)
        return
    module, function = {"engine": (contract.ENGINE, "_launch_subprocesses"),
                        "serve": (contract.CLI_SERVE, "serve")}[entry]
    namespace = {"__name__": module}
    exec(f"def {function}():\n" + "".join(f"    {line}\n" for line in call.splitlines()),
         namespace)
    namespace[function]()


class GenerateReqInputStandIn:
    """``io_struct.GenerateReqInput``: the fields the warm-up sets (keywords only)."""

    def __init__(self, *, input_ids: Any = None, rid: Any = None,
                 sampling_params: Any = None, stream: bool = False) -> None:
        self.input_ids = input_ids
        self.rid = rid
        self.sampling_params = sampling_params
        self.stream = stream


#: Stand-ins for the two modules SGLang's warm-up registry imports that need packages a
#: CPU install lacks (``transformers``, through SGLang's model configs).
WARMUP_IMPORT_STAND_INS = {
    "sglang.srt.managers.io_struct": {"GenerateReqInput": GenerateReqInputStandIn},
    "sglang.srt.disaggregation.utils": {"FAKE_BOOTSTRAP_HOST": "2.2.2.2"},
}


def warmup_import_stand_ins() -> list[str]:
    """Put :data:`WARMUP_IMPORT_STAND_INS` in ``sys.modules`` where ``transformers`` is not
    installed (then the real modules cannot be imported); returns the names put there."""
    if importlib.util.find_spec("transformers") is not None:
        return []
    for name, attributes in WARMUP_IMPORT_STAND_INS.items():
        module = types.ModuleType(name)
        module.__dict__.update(attributes)
        sys.modules[name] = module
    return sorted(WARMUP_IMPORT_STAND_INS)


class TokenizerManagerStandIn:
    """``TokenizerManager`` for the warm-up: ``generate_request`` records each request and
    yields one output per request of it (the batch finished); ``events`` lists
    ("sent", batch size) and ("done", batch size) in order."""

    def __init__(self, max_running_requests: int | None = None, vocab_size: int = 1000,
                 fail_at: int | None = None) -> None:
        self.server_args = types.SimpleNamespace(max_running_requests=max_running_requests)
        self.model_config = types.SimpleNamespace(vocab_size=vocab_size)
        self.requests: list[Any] = []
        self.events: list[tuple[str, int]] = []
        self.fail_at = fail_at

    async def generate_request(self, obj: Any, request: Any = None):
        size = len(obj.input_ids)
        self.requests.append(obj)
        self.events.append(("sent", size))
        if size == self.fail_at:
            raise ValueError(f"stand-in failure at batch {size}")
        yield [{"meta_info": {"id": rid}} for rid in obj.rid]
        self.events.append(("done", size))


def socket_dir() -> str:
    """A short folder for ``ipc://`` sockets (their paths must stay under 107
    characters, too short for pytest's ``tmp_path``), removed when the process exits."""
    path = tempfile.mkdtemp(prefix="sc-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


#: How long a test waits for something before calling it a hang (a failure). Long, so a
#: loaded machine never trips it; ``scripts/mutation.py`` shortens it, so that a mutant
#: that makes a test wait forever is killed in seconds rather than timed out.
HANG_GUARD_S = float(os.environ.get("SPECCTL_HANG_GUARD_S", "60"))


def wait_until(condition: Callable[[], bool], what: str, deadline_s: float | None = None) -> None:
    """Poll ``condition`` until it holds. The deadline (default :data:`HANG_GUARD_S`) only
    turns a hang into a failure: nothing a test asserts may depend on how soon it holds."""
    deadline_s = HANG_GUARD_S if deadline_s is None else deadline_s
    give_up = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > give_up:
            raise AssertionError(f"gave up after {deadline_s} s waiting for {what}")
        time.sleep(0.001)


def io_round(client: Any) -> None:
    """Wait until a :class:`~sglang_hooks.client.ControllerClient`'s I/O thread has gone
    round its loop once since the call: it has then taken what was on its socket and in
    its outbox, aged the decisions at the clock's present reading and published the
    marker. (Woken first, in case it sleeps until a HELLO or a deadline: on a manual
    clock a deadline passes when the test says, not when the thread expects.)"""
    counters = client.counters
    start = counters["io_wakeups"]  # counted at the top of each round
    client._wake()
    wait_until(lambda: counters["io_wakeups"] >= start + 2, "a round of the I/O thread")


class ManualClock:
    """A monotonic clock that moves only when told (:meth:`advance`, :meth:`sleep_until`).

    Given to a :class:`~sglang_hooks.runtime.Runtime` and a :class:`SchedulerStandIn`,
    it makes step latencies and the controller timeout depend on what a test does,
    not on how loaded the machine is. Read from any thread (a float is read atomically).
    """

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def sleep_until(self, when: float) -> None:
        """What ``time.sleep(when - now)`` does to a real clock."""
        self.now = max(self.now, when)


class ForwardModeStandIn:
    """``ForwardMode``: decode or extend (prefill)."""

    def __init__(self, decode: bool) -> None:
        self._decode = decode

    def is_decode(self) -> bool:
        return self._decode

    def is_extend(self) -> bool:
        return not self._decode


DECODE = ForwardModeStandIn(True)
EXTEND = ForwardModeStandIn(False)


class ReqStandIn:
    """``Req``: the attributes the recorder reads."""

    def __init__(self, rid: str, prompt_tokens: int = 16) -> None:
        self.rid = rid
        self.origin_input_ids = [0] * prompt_tokens
        self.output_ids: list[int] = []
        self.finished_reason: object | None = None


class BatchStandIn:
    """``ScheduleBatch``: reqs, mode, prefill tokens (and per request: cached prefix, new
    tokens); ``copy()`` keeps ``forward_iter``."""

    def __init__(self, reqs: list[ReqStandIn], forward_mode: ForwardModeStandIn,
                 extend_num_tokens: int | None = None, prefix_lens: list[int] | None = None,
                 extend_lens: list[int] | None = None) -> None:
        self.reqs = reqs
        self.forward_mode = forward_mode
        self.extend_num_tokens = extend_num_tokens
        self.prefix_lens = prefix_lens
        self.extend_lens = extend_lens
        self.forward_iter: int | None = None

    def copy(self) -> BatchStandIn:
        other = BatchStandIn(self.reqs[:], self.forward_mode, self.extend_num_tokens,
                             self.prefix_lens, self.extend_lens)
        other.forward_iter = self.forward_iter
        if hasattr(self, "done_at"):
            other.done_at = self.done_at
        return other


class _Pool:
    def __init__(self, size: int) -> None:
        self.size = size

    def available_size(self) -> int:
        return self.size

    def evictable_size(self) -> int:
        return self.size // 4


class WorkerStandIn:
    """An ``AdaptiveSpecWorker``: remembers which runtime state is active.

    With ``overrides_log`` (SGLang 0.5.23's ``RuntimeContext._overrides_log``) each
    switch appends to it as ``EAGLEWorkerV2.apply_runtime_state`` does there.
    """

    def __init__(self, speculative_num_steps: int, state_class: type,
                 overrides_log: list | None = None) -> None:
        self.speculative_num_steps = speculative_num_steps
        self._state_class = state_class
        self.overrides_log = overrides_log
        self.switches = 0

    def build_adaptive_runtime_state(self, speculative_num_steps: int,
                                     speculative_num_draft_tokens: int,
                                     cuda_graph_bs: list[int] | None = None) -> Any:
        return self._state_class(speculative_num_steps, speculative_num_draft_tokens,
                                 None, None, None, None, None, None)

    def apply_runtime_state(self, state: Any) -> None:
        if self.speculative_num_steps == state.speculative_num_steps:
            return
        self.switches += 1
        self.speculative_num_steps = state.speculative_num_steps
        if self.overrides_log is not None:
            self.overrides_log.append(("adaptive_spec.restore", {
                "speculative_num_steps": state.speculative_num_steps,
                "speculative_num_draft_tokens": state.speculative_num_draft_tokens}))


class SchedulerStandIn:
    """``Scheduler``: what the hooks read, and the four hooked methods.

    ``run_batch`` asks the adaptive controller for the batch's steps (as
    ``EAGLEWorkerV2.forward_batch_generation`` does); ``process_batch_result``
    feeds it the accepted drafts (as ``_resolve_spec_v2_tokens`` does), taken
    from ``acceptance(step_index, steps, batch_size)``.
    """

    def __init__(self, adaptive: Any, worker: WorkerStandIn,
                 acceptance: Callable[[int, int, int], list[int]], port: int = 30000,
                 gpu_seconds: Callable[[int], float] | None = None,
                 clock: ManualClock | None = None) -> None:
        self.adaptive = adaptive
        #: Optional GPU model: a launched step runs ``gpu_seconds(steps)`` after the
        #: previous one finished, and its result is ready only then (the real
        #: ``process_batch_result`` blocks on the copy of its results), on ``clock``
        #: (None: real time and real sleeps).
        self.gpu_seconds = gpu_seconds
        self.clock = clock
        self._gpu_free_at = 0.0
        self.worker = worker
        self.acceptance = acceptance
        self.forward_ct = 0
        self.waiting_queue: list = []
        self.running_batch = BatchStandIn([], DECODE)
        self.token_to_kv_pool_allocator = _Pool(400_000)
        self.tree_cache = _Pool(40_000)
        self.max_total_num_tokens = 500_000
        self.server_args = types.SimpleNamespace(port=port)
        self.dispatched: list = []
        #: (step index, steps) of every decode batch launched.
        self.launched: list[tuple[int, int]] = []

    def process_input_requests(self, recv_reqs: list) -> None:
        # SGLang's dispatcher knows its request classes only (never tuples): anything
        # else raises and kills the scheduler.
        for item in recv_reqs:
            if isinstance(item, tuple):
                raise ValueError("Invalid object")
        self.dispatched.extend(recv_reqs)

    def run_batch(self, batch: BatchStandIn) -> int:
        self.forward_ct += 1
        batch.forward_iter = self.forward_ct
        steps = 0
        if batch.forward_mode.is_decode():
            self.adaptive.activate_step_by_batch(len(batch.reqs))
            self.launched.append((self.forward_ct, self.worker.speculative_num_steps))
            steps = self.worker.speculative_num_steps
        if self.gpu_seconds is not None:
            now = self.clock() if self.clock is not None else time.monotonic()
            self._gpu_free_at = max(now, self._gpu_free_at) + self.gpu_seconds(steps)
            batch.done_at = self._gpu_free_at
        return steps

    def process_batch_result(self, batch: BatchStandIn, result: int) -> None:
        done_at = getattr(batch, "done_at", None)
        if done_at is not None and self.clock is not None:
            self.clock.sleep_until(done_at)
        elif done_at is not None:
            time.sleep(max(0.0, done_at - time.monotonic()))
        if batch.forward_mode.is_decode():
            drafts = self.acceptance(batch.forward_iter, result, len(batch.reqs))
            self.adaptive.on_verify_complete(drafts, batch_size=len(batch.reqs))
            for req, accepted in zip(batch.reqs, drafts, strict=True):
                req.output_ids.extend([1] * (accepted + 1))


class ReceiverStandIn:
    """``SchedulerRequestReceiver``: ``_pull_raw_reqs`` returns a list on the source only."""

    def __init__(self, is_source: bool) -> None:
        self.is_source = is_source
        self.inbox: deque = deque()

    def _pull_raw_reqs(self) -> list | None:
        if not self.is_source:
            return None
        pulled = list(self.inbox)
        self.inbox.clear()
        return pulled


_module_ids = itertools.count()


def hooked_classes(runtime: Runtime) -> tuple[type, type]:
    """Fresh (scheduler, receiver) stand-in classes with ``runtime``'s hooks applied by
    SGLang's ``HookRegistry``, exactly as ``sglang_hooks.plugin`` registers them."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    name = f"sglang_hooks._standins_{next(_module_ids)}"
    module = types.ModuleType(name)
    module.Scheduler = type("Scheduler", (SchedulerStandIn,), {"__module__": name})
    module.SchedulerRequestReceiver = type(
        "SchedulerRequestReceiver", (ReceiverStandIn,), {"__module__": name})
    sys.modules[name] = module
    hooks = runtime.hook_table()
    for target in HOOK_TARGETS:
        hook, hook_type = hooks[target.name]
        # The stand-in method is defined on the base class; give the subclass its own
        # attribute so the patch stays on this copy.
        cls = getattr(module, target.cls)
        setattr(cls, target.name, getattr(cls, target.name))
        HookRegistry.register(f"{name}.{target.cls}.{target.name}", hook, HookType[hook_type])
    HookRegistry.apply_hooks()
    return module.Scheduler, module.SchedulerRequestReceiver


class RankLoop:
    """One rank's scheduler loop, step by step, in overlap order."""

    def __init__(self, scheduler: SchedulerStandIn, receiver: ReceiverStandIn) -> None:
        self.scheduler = scheduler
        self.receiver = receiver
        self._in_flight: tuple[BatchStandIn, int] | None = None

    def pull(self) -> list | None:
        """The source's pulled requests (with any marker), None on other ranks."""
        return self.receiver._pull_raw_reqs()

    def iterate(self, broadcast: list, batch: BatchStandIn | None) -> None:
        """The rest of one loop iteration, given the list the TP broadcast delivered."""
        scheduler = self.scheduler
        scheduler.process_input_requests(broadcast)
        launched = None
        if batch is not None:
            result = scheduler.run_batch(batch)
            launched = (batch.copy(), result)
        if self._in_flight is not None:
            scheduler.process_batch_result(*self._in_flight)
        self._in_flight = launched

    def drain(self) -> None:
        """Process the last launched batch's result (the loop going idle)."""
        if self._in_flight is not None:
            self.scheduler.process_batch_result(*self._in_flight)
            self._in_flight = None
