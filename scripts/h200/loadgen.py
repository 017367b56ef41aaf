"""Load generators for a real SGLang server (``/generate`` with token ids, streaming).

* :func:`one_batch`: C requests at once (the shape of the measured H200 sweep);
* :func:`closed_loop`: C clients, each sending its next request when the last ends;
* :func:`replay`: open-loop arrivals at given times (a trace whose load rises and falls).

Each returns output tokens per second over the run and per-request TTFT, TPOT and
end-to-end latency (TPOT = time from the first to the last token over the tokens after
the first), measured by the client from the streamed chunks, and why any request failed.

Every request gets its own connection: SGLang's HTTP server (uvicorn) closes a
keep-alive connection after 5 idle seconds (``SGLANG_TIMEOUT_KEEP_ALIVE``) while
aiohttp keeps one for reuse for 15, so a request sent on a connection the server
is just closing fails (``ServerDisconnectedError``) - rarely, where load rises
after a lull: the one lost request in 818 of two static-3 replays.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp


@dataclass
class RequestResult:
    """One request as the client saw it."""

    sent_s: float
    first_token_s: float | None = None
    done_s: float | None = None
    output_tokens: int = 0
    error: str | None = None


@dataclass
class RunResult:
    """A whole run."""

    started_s: float
    ended_s: float
    requests: list[RequestResult] = field(default_factory=list)

    def summary(self) -> dict:
        ok = [r for r in self.requests if r.error is None and r.done_s is not None]
        tokens = sum(r.output_tokens for r in ok)
        elapsed = self.ended_s - self.started_s
        tpots = [(r.done_s - r.first_token_s) / (r.output_tokens - 1) for r in ok
                 if r.first_token_s is not None and r.output_tokens > 1]
        errors = Counter(r.error or "no end of stream" for r in self.requests if r not in ok)
        return {
            "requests": len(self.requests),
            "failed": len(self.requests) - len(ok),
            "errors": dict(errors),
            "output_tokens": tokens,
            "seconds": elapsed,
            "throughput_tok_s": tokens / elapsed if elapsed > 0 else 0.0,
            "mean_tpot_ms": 1e3 * sum(tpots) / len(tpots) if tpots else None,
            "mean_ttft_ms": 1e3 * sum(r.first_token_s - r.sent_s for r in ok
                                      if r.first_token_s is not None) / max(len(ok), 1),
            "mean_e2e_s": sum(r.done_s - r.sent_s for r in ok) / max(len(ok), 1),
            # Every answered request (sent, first token and done, seconds from the run's
            # start; output tokens), so that a metric other than the summary's (e.g. the
            # tokens of a closed loop's sending window, without its drain) can be computed
            # afterwards from the same run.
            "per_request": [[round(r.sent_s - self.started_s, 4),
                             round((r.first_token_s or r.done_s) - self.started_s, 4),
                             round(r.done_s - self.started_s, 4), r.output_tokens]
                            for r in ok],
        }


async def _request(session: aiohttp.ClientSession, url: str, prompt_tokens: int,
                   output_tokens: int, rng: random.Random,
                   input_ids: list[int] | None = None) -> RequestResult:
    """One streamed request: ``input_ids`` if given, else ``prompt_tokens`` random ids."""
    result = RequestResult(sent_s=time.perf_counter())
    if input_ids is None:
        input_ids = [rng.randrange(1000, 100_000) for _ in range(prompt_tokens)]
    payload = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": output_tokens, "ignore_eos": True,
                            "temperature": 0.0},
        "stream": True,
    }
    try:
        async with session.post(f"{url}/generate", json=payload) as response:
            response.raise_for_status()
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if result.first_token_s is None:
                    result.first_token_s = time.perf_counter()
                ids = chunk.get("output_ids")
                if ids is not None:
                    result.output_tokens = max(result.output_tokens, len(ids))
                meta = chunk.get("meta_info", {})
                result.output_tokens = max(result.output_tokens,
                                           int(meta.get("completion_tokens", 0)))
        result.done_s = time.perf_counter()
    except Exception as exc:
        result.error = repr(exc)
    return result


def _session() -> aiohttp.ClientSession:
    # force_close: no connection reuse, so none races the server's keep-alive close.
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                 connector=aiohttp.TCPConnector(limit=0, force_close=True))


async def _one_batch(url: str, concurrency: int, prompt: int, output: int, seed: int) -> RunResult:
    rng = random.Random(seed)
    async with _session() as session:
        run = RunResult(started_s=time.perf_counter(), ended_s=0.0)
        run.requests = list(await asyncio.gather(
            *[_request(session, url, prompt, output, rng) for _ in range(concurrency)]))
        run.ended_s = time.perf_counter()
    return run


async def _closed_loop(url: str, concurrency: int, prompt: int, output: int, seconds: float,
                       seed: int) -> RunResult:
    rng = random.Random(seed)
    run = RunResult(started_s=time.perf_counter(), ended_s=0.0)
    deadline = run.started_s + seconds
    async with _session() as session:
        async def client() -> None:
            while time.perf_counter() < deadline:
                run.requests.append(await _request(session, url, prompt, output, rng))
        await asyncio.gather(*[client() for _ in range(concurrency)])
    run.ended_s = time.perf_counter()
    return run


async def _replay(url: str, arrivals: list[float], prompts: list[int], outputs: list[int],
                  seed: int, prompt_ids: list[list[int]] | None = None) -> RunResult:
    rng = random.Random(seed)
    run = RunResult(started_s=time.perf_counter(), ended_s=0.0)
    ids = prompt_ids if prompt_ids is not None else [None] * len(arrivals)
    async with _session() as session:
        tasks = []
        for at, prompt, output, input_ids in zip(arrivals, prompts, outputs, ids, strict=True):
            delay = run.started_s + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(
                _request(session, url, prompt, output, rng, input_ids)))
        run.requests = list(await asyncio.gather(*tasks))
    run.ended_s = time.perf_counter()
    return run


def one_batch(url: str, concurrency: int, prompt: int = 256, output: int = 128,
              seed: int = 0) -> dict:
    """C requests sent at once; throughput = their tokens over the time to the last answer."""
    return asyncio.run(_one_batch(url, concurrency, prompt, output, seed)).summary()


def closed_loop(url: str, concurrency: int, seconds: float, prompt: int = 256,
                output: int = 128, seed: int = 0) -> dict:
    """C clients back to back for ``seconds``."""
    return asyncio.run(_closed_loop(url, concurrency, prompt, output, seconds, seed)).summary()


def replay(url: str, arrivals: list[float], prompts: list[int], outputs: list[int],
           seed: int = 0, prompt_ids: list[list[int]] | None = None) -> dict:
    """Open-loop arrivals (seconds from the start) with their lengths; ``prompt_ids``: each
    prompt's token ids (a shared prefix must be the same ids), else random ids."""
    return asyncio.run(_replay(url, arrivals, prompts, outputs, seed, prompt_ids)).summary()
