"""Task 1: calls of ``Simulator._admit_arrivals`` and ``_prefill_due`` per decode step, and
what one pair of them costs, on ``benchmarks/bench_simulator.py``'s decode loops (closed
loop of 64 clients, depth 3, ``h200_llama31_8b``: the booking on). Counts do not depend on
the machine's load; the costs are the best of 15 ``timeit`` repeats.

    PYTHONPATH=TREE python docs/results/sim23/calls_per_step.py
"""

from __future__ import annotations

import timeit
from collections import Counter

from env.sim.acceptance import SGLangSimulatedAcceptance
from env.sim.cost_model import load_profile
from env.sim.simulator import Simulator
from env.traces.workloads import ClosedLoop

STEPS = 20_000


def steady(output_tokens: int) -> Simulator:
    """The bench's simulator after 1,000 decode steps."""
    sim = Simulator(load_profile("h200_llama31_8b"), SGLangSimulatedAcceptance(3.5),
                    ClosedLoop(64, 256, output_tokens))
    sim.advance()
    for _ in range(1000):
        sim.decode(3)
        sim.advance()
    return sim


def count_calls(output_tokens: int) -> dict[str, float]:
    """Calls per decode step (decode + advance) of the two methods."""
    calls: Counter[str] = Counter()
    sim = steady(output_tokens)
    for name in ("_admit_arrivals", "_prefill_due"):
        method = getattr(sim, name)

        def counted(_method=method, _name=name):
            calls[_name] += 1
            return _method()

        setattr(sim, name, counted)  # on the instance: the class stays as it is
    for _ in range(STEPS):
        sim.decode(3)
        sim.advance()
    return {name: calls[name] / STEPS for name in ("_admit_arrivals", "_prefill_due")}


def costs_us(output_tokens: int) -> tuple[float, float]:
    """Microseconds of one ``_admit_arrivals() + _prefill_due()`` and of one decode step."""
    sim = steady(output_tokens)
    pair = min(timeit.repeat(lambda: (sim._admit_arrivals(), sim._prefill_due()),
                             number=STEPS, repeat=15)) / STEPS

    def step() -> None:
        sim.decode(3)
        sim.advance()

    return pair * 1e6, min(timeit.repeat(step, number=2000, repeat=15)) / 2000 * 1e6


def main() -> None:
    for output_tokens in (100_000, 256):
        pair, step = costs_us(output_tokens)
        print(f"outputs {output_tokens}: calls per decode step {count_calls(output_tokens)}; "
              f"one pair {pair:.2f} us, one decode step {step:.2f} us (best of 15)")


if __name__ == "__main__":
    main()
