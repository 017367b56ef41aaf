"""A workload whose prompts share prefixes, to test the simulator's radix-cache model.

Every prompt is ``SHARED_BLOCKS`` blocks of its group's prefix (one of ``GROUPS``) and
``OWN_BLOCKS`` blocks of its own, ``BLOCK_TOKENS`` tokens each (the block size of
Mooncake's ``hash_ids``, which the simulator's cache works in); Poisson arrivals at
``RATE`` requests/s for ``SECONDS``. The same arrivals and lengths with every block its own
(``shared=False``) compute every prompt in full on any server, so one server with the radix
cache on measures both sides: what the cache saves, and whether the simulator's cache
(``SchedulerConfig.prefix_cache``) saves the same.

The sizes are chosen so the cache matters for throughput on the H200 8B (dense) server:
its prefill costs about 20 us per token (``docs/results/h200/fidelity/dense_nospec.yaml``),
so 3,584-token prompts at 10/s need about 0.7 s of prefill per second without the cache,
0.1 s with it.

Both ``load_cells.py prefix`` (on the GPU) and ``compare.py`` (the simulator) build the
workload here, so the two replay the same requests.
"""

from __future__ import annotations

import random

import numpy as np

SECONDS = 30.0
RATE = 10.0
GROUPS = 16
SHARED_BLOCKS = 6
OWN_BLOCKS = 1
BLOCK_TOKENS = 512
OUTPUT_TOKENS = 64
#: Block ids of the requests' own blocks start here (group prefixes use the ids below it).
OWN_BLOCK_BASE = 1_000_000


def prefix_workload(shared: bool, seconds: float = SECONDS, rate: float = RATE,
                    seed: int = 0) -> tuple[list[float], list[list[int]], list[int]]:
    """Arrival times, block ids per prompt, output lengths (``shared``: prefixes shared)."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=int(rate * seconds * 2)))
    arrivals = arrivals[arrivals < seconds]
    groups = rng.integers(0, GROUPS, size=len(arrivals))
    blocks = []
    for i, group in enumerate(groups.tolist()):
        own = [OWN_BLOCK_BASE + i * (SHARED_BLOCKS + OWN_BLOCKS) + k
               for k in range(OWN_BLOCKS + (0 if shared else SHARED_BLOCKS))]
        prefix = [group * SHARED_BLOCKS + k for k in range(SHARED_BLOCKS)] if shared else []
        blocks.append(prefix + own)
    return arrivals.tolist(), blocks, [OUTPUT_TOKENS] * len(arrivals)


def prompt_tokens(blocks: list[int]) -> int:
    """Tokens of a prompt made of ``blocks``."""
    return len(blocks) * BLOCK_TOKENS


def token_ids(blocks: list[int]) -> list[int]:
    """The prompt's token ids: each block's ``BLOCK_TOKENS`` ids drawn from its id alone,
    so equal blocks are equal tokens and a shared prefix is a shared token prefix."""
    ids: list[int] = []
    for block in blocks:
        rng = random.Random(block)
        ids += [rng.randrange(1000, 100_000) for _ in range(BLOCK_TOKENS)]
    return ids
