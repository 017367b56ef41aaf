"""A start-up warm-up that runs every candidate depth at every batch bucket (``--warmups specctl``).

Why: Triton compiles SGLang's speculative kernels (``assign_req_to_token_pool``,
``assign_extend_cache_locs``, ... in ``sglang/srt/speculative/triton_ops/cache_locs.py``, and
the MoE fused kernel for a new token count) the first time a batch falls in each
power-of-two batch bucket (a ``tl.constexpr``; the same kernels for every depth), and a few
(``fill_bonus_tokens``, ``assign_draft_cache_locs_contiguous``) once per verify width (off:
1, depth d: d + 1). On an H200 a fresh server paid 19 compiles of 60-130 ms (and two
of ~0.8 s), 3.5 s of stalls, in its first 40 s of load (``docs/OFFSWITCH.md``, runs 40-43);
a ramp of every candidate depth at one batch per bucket before serving removed them.

Two halves, in two kinds of SGLang process:

* **HTTP server process** (:func:`register_http`, called by :func:`sglang_hooks.plugin.register`
  when ``load_plugins()`` was called from the engine, ``python -m sglang.launch_server`` or
  ``sglang serve``: :func:`sglang_hooks.compat.in_http_process`): registers
  :func:`run` in SGLang's custom warm-up registry under the name ``specctl``. Nothing else
  changes in that process. With ``--warmups specctl`` SGLang awaits it at start-up, before
  the server listens (``http_server.lifespan`` -> ``execute_warmups``): for each batch size
  of :func:`ramp` it sends one batch of that many identical short greedy requests
  (``input_ids``, so ``--skip-tokenizer-init`` works; ``ignore_eos``; ``SPECCTL_WARMUP_TOKENS``
  output tokens each) through the tokenizer manager, and waits for the batch to finish
  before sending the next. Their request ids start with :data:`PREFIX`.
* **scheduler processes** (:class:`sglang_hooks.runtime.Runtime`): every rank sees the same
  broadcast request list and the same batches, so every rank tells warm-up work apart the
  same way. A warm-up request arriving (:func:`arrivals`) opens the warm-up; any other
  generate request closes it for good (SGLang sends the warm-ups before it serves). While
  it is open, a batch holding a warm-up request (:func:`in_batch`) is a *warm-up step*:
  the policy ignores the controller and the local rule and runs :func:`cycle`'s depths in
  turn, by a count of warm-up decode steps that is the same on every rank; the step is not
  sent as telemetry, not recorded, and does not feed SGLang's rule (its acceptance, on a
  made-up prompt, says nothing about the traffic to come).

What one warm-up costs: one batch per bucket (1, 2, 4, ..., the limit: 7 batches up to
48), each decoding ``SPECCTL_WARMUP_TOKENS`` (default 64) tokens at 1-4 a step; measured
on the H200's MoE (run 48, ``docs/OFFSWITCH.md``): 4 s, after which 7 of the server's
107 Triton compiles (0.39 s) were left for serving and no decode step stalled in its
first 150 s (run 44, a cold start without it: 23 compiles, 3.71 s, 13 stalled steps).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any

from sglang_hooks import config

log = logging.getLogger(__name__)

#: The name to pass to SGLang: ``--warmups specctl``.
NAME = "specctl"
#: Every warm-up request's id starts with this.
PREFIX = "specctl-warmup-"
#: SGLang's custom warm-up registry (``@warmup(name)``, ``execute_warmups``).
WARMUP_MODULE = "sglang.srt.entrypoints.warmup"
#: The batch limit when neither ``SPECCTL_WARMUP_MAX_BS`` nor ``--max-running-requests`` says.
DEFAULT_LIMIT = 64
#: Prompt length of every warm-up request (all the same prompt: greedy decoding then keeps
#: the requests of a batch in step, so the batch stays in its bucket until they all finish).
PROMPT_TOKENS = 32


# -- what both halves agree on ---------------------------------------------------------------


def bucket(batch_size: int) -> int:
    """The power-of-two bucket SGLang's Triton kernels compile per (``next_power_of_2``)."""
    return 1 << max(0, batch_size - 1).bit_length()


def ramp(limit: int) -> tuple[int, ...]:
    """Batch sizes with one in every power-of-two bucket up to ``bucket(limit)``: 1, 2, 4,
    ... below ``limit``, then ``limit`` itself. Each is the top of its bucket, so a batch
    that loses a request or two while it decodes stays in it."""
    limit = max(1, int(limit))
    sizes = []
    size = 1
    while size < limit:
        sizes.append(size)
        size *= 2
    sizes.append(limit)
    return tuple(sizes)


def cycle(candidates: Iterable[int]) -> tuple[int, ...]:
    """The depths a warm-up runs in turn, from a batch size's candidate steps: off (0)
    first, then the smallest positive depth twice (with the plain-decode off path, the first
    step back on after an off step runs SGLang's steps=0 instead, :meth:`OffSwitch.choose`;
    the repeat runs the depth itself), then every other depth."""
    depths = sorted(set(candidates))
    on = [d for d in depths if d > 0]
    if on and depths[0] == 0:
        return (0, on[0], *on)
    return tuple(depths)


def is_warmup_rid(rid: object) -> bool:
    """Whether a request id is one of the warm-up's."""
    return rid.__class__ is str and rid.startswith(PREFIX)


def in_batch(reqs: Sequence[Any]) -> bool:
    """Whether a batch's requests include a warm-up request (only asked while a warm-up is
    open: one look per request)."""
    return any(is_warmup_rid(req.rid) for req in reqs)


def arrivals(recv_reqs: Iterable[Any]) -> bool | None:
    """What a received request list says about the warm-up: False if it holds a generate
    request (a string ``rid`` and ``input_ids``) that is not a warm-up's, else True if it
    holds a warm-up request, else None (nothing either way)."""
    seen = None
    for item in recv_reqs:
        for req in getattr(item, "batch", None) or (item,):
            rid = getattr(req, "rid", None)
            if rid.__class__ is not str or getattr(req, "input_ids", None) is None:
                continue
            if not is_warmup_rid(rid):
                return False
            seen = True
    return seen


# -- the HTTP server process ----------------------------------------------------------------


def register_http() -> bool:
    """Register :func:`run` as SGLang's custom warm-up ``specctl`` (once per process:
    not again if the registry has it); returns whether this call registered it."""
    try:
        import importlib

        module = importlib.import_module(WARMUP_MODULE)
        registry = module._warmup_registry
        if NAME in registry:
            return False
        module.warmup(NAME)(run)
    except Exception as exc:  # an SGLang without the registry: nothing to register
        log.warning("specctl: could not register the %r warm-up (%s: %s)", NAME,
                    type(exc).__name__, exc)
        return False
    log.info("specctl: warm-up %r registered (--warmups %s runs it at start-up)", NAME, NAME)
    return True


def server_limit(tokenizer_manager: Any) -> int | None:
    """The server's ``--max-running-requests`` as the HTTP process knows it (None: unset).

    SGLang 0.5.23 keeps the value in effect in ``runtime_context.get_schedule()``;
    0.5.15.post1 on ``server_args``. Chosen by what is there, not by the version.
    """
    try:
        from sglang.srt import runtime_context

        get_schedule = getattr(runtime_context, "get_schedule", None)
        if get_schedule is not None:
            value = get_schedule().max_running_requests
            if value:
                return int(value)
    except Exception:  # not published in this process, or no such module
        pass
    value = getattr(getattr(tokenizer_manager, "server_args", None), "max_running_requests",
                    None)
    return int(value) if value else None


def prompt(vocab_size: int | None) -> list[int]:
    """The warm-up prompt: :data:`PROMPT_TOKENS` ids below the vocabulary's size."""
    span = max(2, min(int(vocab_size or 32000), 32000) - 1)
    return [1 + (i * 7919) % span for i in range(PROMPT_TOKENS)]


def batch_request(size: int, tokens: int, ids: list[int], tag: str) -> Any:
    """One batch of ``size`` identical requests: ``GenerateReqInput`` with ``input_ids`` and
    a warm-up id each (``PREFIX + tag + '-' + size + '-' + i``)."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    return GenerateReqInput(
        input_ids=[list(ids) for _ in range(size)],
        rid=[f"{PREFIX}{tag}-{size}-{i}" for i in range(size)],
        sampling_params={"max_new_tokens": tokens, "ignore_eos": True, "temperature": 0.0},
        stream=False,
    )


async def run(disaggregation_mode: str, tokenizer_manager: Any) -> None:
    """SGLang's custom warm-up ``specctl`` (``execute_warmups`` awaits it at start-up)."""
    if disaggregation_mode not in (None, "null"):
        log.warning("specctl: the %r warm-up does not run on a disaggregated (%s) server",
                    NAME, disaggregation_mode)
        return
    try:
        settings = config.warmup_settings()
    except config.ConfigError as exc:
        log.warning("specctl: warm-up skipped, bad configuration: %s", exc)
        return
    limit = settings.max_bs or server_limit(tokenizer_manager) or DEFAULT_LIMIT
    sizes = ramp(limit)
    ids = prompt(getattr(getattr(tokenizer_manager, "model_config", None), "vocab_size", None))
    tag = str(os.getpid())
    log.info("specctl: warm-up: one batch of %s requests, %d output tokens each",
             ", ".join(map(str, sizes)), settings.tokens)
    try:
        for size in sizes:
            request = batch_request(size, settings.tokens, ids, tag)
            async for _ in tokenizer_manager.generate_request(request, None):
                pass  # drained: the whole batch has finished
    except Exception:  # a warm-up is worth less than a server that starts
        log.exception("specctl: warm-up failed at batch %d; the server starts unwarmed", size)
        return
    log.info("specctl: warm-up done (%d batches)", len(sizes))
