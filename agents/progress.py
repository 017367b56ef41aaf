"""Running many independent simulator runs, in worker processes, with a progress bar.

``specctl-bench`` and ``specctl-eval`` each run dozens to hundreds of rollouts of 0.1-5 s;
the bar (tqdm, on stderr, only on a terminal: a log file gets no carriage-return noise)
says how far along they are. The first failing run stops the rest: a user mistake found
in a worker is reported at once, not after the whole sweep.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any, TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")


def run_all(fn: Callable[..., T], tasks: Sequence[tuple[Any, ...]], workers: int = 1,
            desc: str = "") -> list[T]:
    """``[fn(*task) for task in tasks]``, in ``workers`` processes, in the tasks' order."""
    results: list[Any] = [None] * len(tasks)
    with tqdm(total=len(tasks), desc=desc, unit="run", disable=None, leave=False) as bar:
        if workers <= 1 or len(tasks) <= 1:
            for i, task in enumerate(tasks):
                results[i] = fn(*task)
                bar.update()
            return results
        pool = ProcessPoolExecutor(max_workers=workers)
        try:
            futures = {pool.submit(fn, *task): i for i, task in enumerate(tasks)}
            for future in as_completed(futures):
                results[futures[future]] = future.result()
                bar.update()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    return results
