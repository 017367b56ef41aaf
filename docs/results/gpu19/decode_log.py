"""Runs 56, 58 and 59: SGLang's own decode log (``Decode batch`` lines, one per 40 decode
steps) per replay window, as milliseconds per step (running requests / generated tokens
per second) per batch band: were the plugin's off steps (static 0, run 58) slower than no
speculation's (runs 56, 59)?

    python docs/results/gpu19/decode_log.py > docs/results/gpu19/decode_log.txt

The windows are the replays' times in the runs' logs (UTC). A line's throughput counts
the interval's prefill time too, so this is per-step time as the clients saw it.
"""

from __future__ import annotations

import gzip
import re
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
LINE = re.compile(r"\[\S+ (\S+)\] Decode batch, #running-req: (\d+), .*?"
                  r"gen throughput \(token/s\): ([\d.]+), #queue-req: (\d+)")
BANDS = ((1, 8), (8, 24), (24, 40), (40, 49))
#: (label, log, first and last time of the replay)
WINDOWS = (("no speculation r12 (run 56)", "server_nospec_run56.log.gz", "21:15:54", "21:16:34"),
           ("no speculation r12 (run 59)", "server_nospec_run59.log.gz", "21:33:44", "21:34:24"),
           ("static 0 r12 (run 58)", "server_sim_run58.log.gz", "21:29:16", "21:29:57"),
           ("no speculation r8 (run 59)", "server_nospec_run59.log.gz", "21:34:25", "21:35:05"),
           ("static 0 r8 (run 58)", "server_sim_run58.log.gz", "21:30:39", "21:31:20"))


def ms_per_step(log: Path, first: str, last: str) -> list[tuple[int, float]]:
    """(running requests, ms per decode step) of each decode log line in the window."""
    rows = []
    with gzip.open(log, "rt") as lines:
        for line in lines:
            match = LINE.search(line)
            if match and first <= match.group(1) <= last and float(match.group(3)) > 0:
                running = int(match.group(2))
                rows.append((running, 1e3 * running / float(match.group(3))))
    return rows


def main() -> None:
    for label, log, first, last in WINDOWS:
        rows = ms_per_step(HERE / log, first, last)
        bands = []
        for lo, hi in BANDS:
            sel = [ms for running, ms in rows if lo <= running < hi]
            median = f"{statistics.median(sel):.2f}" if sel else "-"
            bands.append(f"{lo}-{hi - 1}: {median} ms ({len(sel)} lines)")
        print(f"{label}: " + "; ".join(bands))


if __name__ == "__main__":
    main()
