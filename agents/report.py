"""Tables and plots of results (shared by ``specctl-bench`` and ``specctl-eval``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt
from rich.console import Console
from rich.table import Table


def sweep_table(results: Mapping[str, Mapping[str, Mapping]], title: str,
                metric: str = "throughput_tok_s", console: Console | None = None) -> Table:
    """Print (and return) policy x concurrency for one metric."""
    concurrencies = sorted({int(c) for cells in results.values() for c in cells})
    table = Table(title=title)
    table.add_column("policy")
    for c in concurrencies:
        table.add_column(f"C={c}", justify="right")
    for policy, cells in results.items():
        row = []
        for c in concurrencies:
            value = cells.get(str(c), {}).get(metric)
            row.append("-" if value is None else f"{value:,.1f}")
        table.add_row(policy, *row)
    (console or Console()).print(table)
    return table


def plot_sweep(results: Mapping[str, Mapping[str, Mapping]], path: Path, title: str = "") -> None:
    """Throughput against concurrency, one line per policy (log-scale concurrency)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy, cells in results.items():
        xs = sorted(int(c) for c in cells)
        ys = [cells[str(c)]["throughput_tok_s"] for c in xs]
        ax.plot(xs, ys, marker="o", label=policy)
    ax.set_xscale("log")
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("output tokens / s")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
