"""Tables and plots of results (shared by ``specctl-bench`` and ``specctl-eval``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt
from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table


def _cell(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.1f}"


def _header(policy: str) -> str:
    # Policy names are snake_case: break at the first underscore so that a column is as
    # narrow as its longer half ("sglang" over "adaptive") rather than the whole name.
    return policy.replace("_", "\n", 1)


def _table(title: str | None, concurrencies: list[int], cells: Mapping[str, list[str]],
           policies: list[str]) -> Table:
    table = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left")
    table.add_column("C", justify="right", no_wrap=True)
    for policy in policies:
        table.add_column(_header(policy), justify="right", no_wrap=True)
    for row, c in enumerate(concurrencies):
        table.add_row(str(c), *(cells[p][row] for p in policies))
    return table


def _width(console: Console, concurrencies: list[int], cells: Mapping[str, list[str]],
           policies: list[str]) -> int:
    table = _table(None, concurrencies, cells, policies)
    unbounded = console.options.update_width(10_000)  # measured as if nothing were cut
    return Measurement.get(console, unbounded, table).maximum


def sweep_table(results: Mapping[str, Mapping[str, Mapping]], title: str,
                metric: str = "throughput_tok_s", console: Console | None = None) -> list[Table]:
    """Print (and return) one metric by concurrency (rows) and policy (columns).

    Columns that do not fit the console's width (80 when the output is redirected) go into
    further tables below the first, so that no cell is ever cut short.
    """
    console = console or Console()
    concurrencies = sorted({int(c) for cells in results.values() for c in cells})
    cells = {p: [_cell(results[p].get(str(c), {}).get(metric)) for c in concurrencies]
             for p in results}
    groups: list[list[str]] = [[]]
    for policy in results:  # greedily, in the given order
        if groups[-1] and _width(console, concurrencies, cells,
                                 [*groups[-1], policy]) > console.width:
            groups.append([])
        groups[-1].append(policy)
    tables = []
    for i, group in enumerate(groups):
        table = _table(title if i == 0 else None, concurrencies, cells, group)
        console.print(table)
        tables.append(table)
    return tables


#: Marker and line style per line, so that lines with equal values stay apart: a later
#: line's smaller marker is drawn on top of an earlier one's larger marker.
_MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "<", ">")
_STYLES = ("-", "--", "-.", ":")


def plot_sweep(results: Mapping[str, Mapping[str, Mapping]], path: Path, title: str = "",
               baseline: str = "no_spec") -> None:
    """Throughput against concurrency, one line per policy (log-scale concurrency); below
    it, each policy's throughput relative to ``baseline`` (when it was run)."""
    relative = baseline in results
    fig, axes = plt.subplots(2 if relative else 1, 1, figsize=(7.5, 7 if relative else 4.5),
                             sharex=True, squeeze=False)
    top = axes[0][0]
    for k, (policy, cells) in enumerate(results.items()):
        xs = sorted(int(c) for c in cells)
        ys = np.array([cells[str(c)]["throughput_tok_s"] for c in xs])
        style = {"marker": _MARKERS[k % len(_MARKERS)], "linestyle": _STYLES[k % len(_STYLES)],
                 "markersize": max(3.0, 9.0 - 0.8 * k), "label": policy, "zorder": 2 + k,
                 "alpha": 0.9}
        top.plot(xs, ys, **style)
        if relative:
            base = np.array([results[baseline].get(str(c), {}).get("throughput_tok_s", np.nan)
                             for c in xs], dtype=float)
            with np.errstate(divide="ignore", invalid="ignore"):
                axes[1][0].plot(xs, ys / base, **style)
    top.set_xscale("log")
    top.set_ylabel("output tokens / s")
    top.set_title(title + "\n(simulated; C clients each sending the next request when the "
                  "last finishes)", fontsize=10)
    top.legend(fontsize=8, title="policy", title_fontsize=8)
    if relative:
        bottom = axes[1][0]
        bottom.axhline(1.0, color="grey", linewidth=0.8)
        bottom.set_ylabel(f"throughput / {baseline}'s\n(> 1: faster than {baseline})")
    for (ax,) in axes:
        ax.grid(True, alpha=0.3)
    concurrencies = sorted({int(c) for cells in results.values() for c in cells})
    axes[-1][0].set_xticks(concurrencies, [str(c) for c in concurrencies], fontsize=8)
    axes[-1][0].minorticks_off()
    axes[-1][0].set_xlabel("concurrent clients C")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
