"""The H200 load generator against a local stand-in of SGLang's streaming ``/generate``."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "h200"))
import loadgen


class StandIn:
    """Streams ``max_new_tokens`` ids as SGLang does; notes each request's connection."""

    def __init__(self, fail_every: int = 0) -> None:
        self.peers: list[tuple] = []
        self.prompts: list[list[int]] = []
        self.fail_every = fail_every

    async def generate(self, request: web.Request) -> web.StreamResponse:
        self.peers.append(request.transport.get_extra_info("peername"))
        body = await request.json()
        self.prompts.append(body["input_ids"])
        if self.fail_every and len(self.peers) % self.fail_every == 0:
            raise web.HTTPServiceUnavailable(text="overloaded")
        response = web.StreamResponse()
        await response.prepare(request)
        ids: list[int] = []
        for i in range(body["sampling_params"]["max_new_tokens"]):
            ids.append(i)
            chunk = {"output_ids": ids, "meta_info": {"completion_tokens": len(ids)}}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response


async def _serve_and_replay(stand_in: StandIn, arrivals: list[float],
                            prompt_ids: list[list[int]] | None = None) -> dict:
    app = web.Application()
    app.router.add_post("/generate", stand_in.generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        run = await loadgen._replay(f"http://127.0.0.1:{port}", arrivals, [4] * len(arrivals),
                                    [3] * len(arrivals), seed=0, prompt_ids=prompt_ids)
        return run.summary()
    finally:
        await runner.cleanup()


def test_every_request_has_its_own_connection():
    """A reused keep-alive connection can be closed by the server as it is reused."""
    stand_in = StandIn()
    summary = asyncio.run(_serve_and_replay(stand_in, [0.0, 0.05, 0.1, 0.15]))
    assert summary["failed"] == 0 and summary["output_tokens"] == 12
    assert len(set(stand_in.peers)) == 4, "requests shared a connection"


def test_failures_are_counted_with_their_reason():
    stand_in = StandIn(fail_every=2)
    summary = asyncio.run(_serve_and_replay(stand_in, [0.0, 0.01, 0.02, 0.03]))
    assert summary["failed"] == 2 and summary["output_tokens"] == 6
    [(reason, count)] = summary["errors"].items()
    assert count == 2 and "503" in reason


@pytest.mark.parametrize("requests", [0, 3])
def test_summary_without_failures_has_no_errors(requests):
    run = loadgen.RunResult(0.0, 1.0, [loadgen.RequestResult(0.0, 0.1, 0.5, 4)] * requests)
    assert run.summary()["errors"] == {}


def test_summary_keeps_each_answered_request_from_the_runs_start():
    """Another metric (a closed loop's sending window) can be computed from the same run."""
    ok = loadgen.RequestResult(10.5, 10.6, 11.0, 4)
    lost = loadgen.RequestResult(10.7, error="boom")
    summary = loadgen.RunResult(10.0, 12.0, [ok, lost]).summary()
    assert summary["per_request"] == [[0.5, 0.6, 1.0, 4]]


def test_replay_sends_the_prompt_ids_it_is_given():
    """A shared prefix must reach the server as the same token ids (prefix_workload.py)."""
    stand_in = StandIn()
    ids = [[5, 6, 7, 8], [5, 6, 7, 9]]
    summary = asyncio.run(_serve_and_replay(stand_in, [0.0, 0.02], prompt_ids=ids))
    assert summary["failed"] == 0 and stand_in.prompts == ids
    asyncio.run(_serve_and_replay(stand_in, [0.0]))
    assert len(stand_in.prompts[-1]) == 4 and stand_in.prompts[-1] not in ids
