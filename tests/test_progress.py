"""agents.progress.run_all: results in the tasks' order, in-process or in workers."""

from __future__ import annotations

import pytest

from agents.progress import run_all


def _power(base: int, exponent: int) -> int:
    if base < 0:
        raise ValueError(f"negative base {base}")
    return base**exponent


@pytest.mark.parametrize("workers", [1, 2])
def test_results_keep_the_order_of_the_tasks(workers):
    tasks = [(b, 3) for b in range(7, 0, -1)]
    assert run_all(_power, tasks, workers=workers) == [b**3 for b in range(7, 0, -1)]


@pytest.mark.parametrize("workers", [1, 2])
def test_a_failing_task_raises_its_own_error(workers):
    with pytest.raises(ValueError, match="negative base -1"):
        run_all(_power, [(2, 2), (-1, 2), (3, 2)], workers=workers)
