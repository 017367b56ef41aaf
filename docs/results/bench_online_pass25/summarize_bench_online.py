"""The bench_online --runs 1 pairs of the twenty-fifth pass, one line a run."""

import json
import statistics
from pathlib import Path

HERE = Path(__file__).parent


def main() -> None:
    rows = {"base": [], "branch": []}
    for path in sorted(HERE.glob("bench_online_*_pair*.json")):
        tree = path.stem.split("_")[2]
        run = json.loads(path.read_text())["runs"][0]
        one, eight = run["rtt_1"], run["rtt_8"]
        r1 = one["serve"]["answered_us"]["p50"] / one["echo"]["answered_us"]["p50"]
        r8 = eight["serve"]["answered_us"]["p50"] / eight["echo"]["answered_us"]["p50"]
        per_cpu = run["throughput"]["serve"]["decisions_per_cpu_s"]
        local = run["local"]["telemetry_to_decision_us"]["p50"]
        rows[tree].append((r1, r8, per_cpu, local))
        print(f"{path.stem:28s} load {run['load_average_1min_before']:.2f}  1 client "
              f"{one['serve']['answered_us']['p50']:6.0f} us ({r1:.2f})  8 clients "
              f"{eight['serve']['answered_us']['p50']:6.0f} us ({r8:.2f})  "
              f"{per_cpu / 1e3:.1f}k/CPU-s  local {local:.0f} us")
    for tree, values in rows.items():
        medians = [statistics.median(v[i] for v in values) for i in range(4)]
        print(f"median {tree:6s}: 1 client {medians[0]:.2f}, 8 clients {medians[1]:.2f}, "
              f"{medians[2] / 1e3:.1f}k/CPU-s, local {medians[3]:.0f} us")


if __name__ == "__main__":
    main()
