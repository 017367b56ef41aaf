"""Log every just-in-time compile in a process: Triton kernels and torch.compile (Dynamo).

A diagnostic for the GPU sessions: a fresh plugin server's first off steps at a new batch
size stalled for 86-1,806 ms (``docs/OFFSWITCH.md``, runs 37-39), and a compile on first
use is the suspect. ``SPECCTL_COMPILE_LOG=<folder>`` makes ``.h200/site/sitecustomize.py``
call :func:`install` in every Python process of the server, which appends one JSON line
per compile to ``<folder>/compiles-<pid>.jsonl``:

    {"kind": "triton", "name": "get_target_cache_loc", "start": <unix s>, "seconds": 0.41,
     "constexprs": "{...}"}
    {"kind": "dynamo", "name": "0/1", "start": ..., "seconds": ...}

Unix start times line up with the recorded trace's ``t0_unix`` plus each step's time.
Triton: ``JITFunction._do_compile`` runs on every in-process cache miss (a compile, or a
load from Triton's disk cache), so its duration is what the calling step waited. Dynamo:
its compile start and end callbacks (a recompile's reason is in the server log with
``TORCH_LOGS=recompiles``).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any


def install(folder: str) -> None:
    """Wrap Triton's compile and register Dynamo's callbacks; errors are logged, not raised."""
    path = Path(folder) / f"compiles-{os.getpid()}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = threading.Lock()

    def write(kind: str, name: str, start: float, seconds: float, **extra: Any) -> None:
        line = json.dumps({"kind": kind, "name": name, "start": start,
                           "seconds": round(seconds, 6), **extra})
        with lock, path.open("a") as file:
            file.write(line + "\n")

    try:
        from triton.runtime.jit import JITFunction

        compile_kernel = JITFunction._do_compile

        def timed_compile(self, key, signature, device, constexprs, *args, **kwargs):
            start = time.time()
            try:
                return compile_kernel(self, key, signature, device, constexprs, *args, **kwargs)
            finally:
                write("triton", getattr(self, "_fn_name", repr(self)), start,
                      time.time() - start, constexprs=repr(constexprs)[:400])

        JITFunction._do_compile = timed_compile
    except Exception as error:  # a diagnostic must not stop the server
        write("error", f"triton: {error!r}", time.time(), 0.0)

    try:
        from torch._dynamo.callback import callback_handler

        started: dict[str, float] = {}

        def on_start(args: Any) -> None:
            started[str(getattr(args, "compile_id", ""))] = time.time()

        def on_end(args: Any) -> None:
            name = str(getattr(args, "compile_id", ""))
            start = started.pop(name, time.time())
            write("dynamo", name, start, time.time() - start)

        callback_handler.register_start_callback(on_start)
        callback_handler.register_end_callback(on_end)
    except Exception as error:
        write("error", f"dynamo: {error!r}", time.time(), 0.0)
