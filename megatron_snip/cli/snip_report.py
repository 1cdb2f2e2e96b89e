"""PNG plots of a SNIP run: its plans over time and the divergences per module.

    python tools/snip_report.py CKPT/snip --out report/

Reads every ``snip_iter_*.json`` a ``--snip`` run wrote next to its checkpoints and writes
``plans.png`` (one panel per cycle: rows are layers; for qkv, proj, fc1, fc2 the forward
and the backward GEMMs, coloured by format, with layer ticks and a legend) and
``divergences_iter_N.png`` for the last cycle (per module and candidate format: the
estimated forward loss divergence and backward update divergence, log scale; the chosen
format outlined, the budget in the title).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from megatron_snip.snip.plan_image import FORMAT_COLOURS, draw_plan, legend_handles, plan_cells
from megatron_snip.snip.statistics_file import StatisticsFile


def load_cycles(directory: Path) -> list[StatisticsFile]:
    """Every ``snip_iter_*.json`` in ``directory``, validated against the statistics file's schema
    (docs/snip.md, "The statistics file"); SystemExit naming a file that does not fit."""
    files = sorted(directory.glob("snip_iter_*.json"))
    if not files:
        raise SystemExit(f"snip_report.py: error: no snip_iter_*.json in {directory} (a --snip run with --save "
                         f"writes them to SAVE/snip/)")
    cycles = []
    for f in files:
        try:
            record = StatisticsFile.load(f)  # the version, the statistics, the run settings, the cycle
            missing = [key for key, value in (("cycle", record.cycle), ("divergences", record.divergences))
                       if not value]
            if missing:
                raise ValueError(f"{f}: no {' or '.join(missing)} (written by a cycle that did not finish?)")
        except ValueError as e:
            raise SystemExit(f"snip_report.py: error: {e}") from None
        cycles.append(record)
    return cycles


def plot_plans(cycles: list[StatisticsFile], out: Path) -> Path:
    """One labelled panel per cycle (layers x GEMM groups), a shared legend of the formats used."""
    layers = cycles[0].run.dims.num_layers
    row_in = min(0.16, max(0.06, 6.4 / layers))
    fig, axes = plt.subplots(1, len(cycles), figsize=(2.6 * len(cycles) + 0.6, row_in * layers + 1.6), squeeze=False)
    used = set()
    for ax, cycle in zip(axes[0], cycles):
        report = cycle.cycle
        plan = report.plan
        draw_plan(ax, plan, layers, f"iteration {report.iteration}\nFP4 {report.fp4_fraction:.1%}, "
                                    f"est. time {report.time_ratio:.3f}")
        used |= {f for row in plan_cells(plan, layers) for f in row}
    fig.legend(handles=legend_handles(used), loc="lower center", ncol=len(used), fontsize=8, frameon=False)
    fig.suptitle("SNIP plans (rows: layers; columns: each module's forward and backward GEMMs)", fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    path = out / "plans.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_divergences(cycle: StatisticsFile, out: Path) -> Path:
    """Per module and candidate format the estimated loss and update divergences (log scale); the
    format the plan chose is outlined in black, the budget is in the title."""
    div = cycle.divergences
    report = cycle.cycle
    plan = report.plan
    names = list(div)
    formats = [f for f in FORMAT_COLOURS if any(f in per for per in div.values())]
    fig, axes = plt.subplots(2, 1, figsize=(max(6, 0.3 * len(names)), 6), sharex=True)
    x = np.arange(len(names))
    width = 0.8 / len(formats)
    for i, fmt in enumerate(formats):
        colour = np.array(FORMAT_COLOURS[fmt]) / 255
        for ax, key, side in zip(axes, ("forward", "backward"), ("fwd", "bwd")):
            values = [max(getattr(div[n][fmt], key) if fmt in div[n] else np.nan, 1e-12) for n in names]
            chosen = [getattr(plan[n], side) == fmt for n in names]
            ax.bar(x + i * width, values, width, color=colour, label=fmt,
                   edgecolor=["black" if c else "none" for c in chosen], linewidth=1.2)
    for ax, label in zip(axes, ("loss divergence dL / loss", "update divergence dU / ||u||^2")):
        ax.set_yscale("log")
        ax.set_ylabel(label, fontsize=8)
    axes[0].legend(fontsize=8, title="candidate (outlined: chosen)", title_fontsize=7, loc="upper left",
                   bbox_to_anchor=(1.0, 1.0))
    short = [n.replace("decoder.layers.", "L").replace("self_attention.linear_", "").replace("mlp.linear_", "")
             for n in names]
    axes[1].set_xticks(x + 0.4 - width / 2, short, rotation=90, fontsize=6)
    run = cycle.run
    budget = f"FP4 target {run.fp4_target:.0%}" if run.fp4_target else "no FP4 target"
    budget += f", time budget {report.time_target:.3f} of bf16 ({run.budget})"
    fig.suptitle(f"SNIP estimates at iteration {report.iteration} (bf16: the reference, no bar)\n{budget}; "
                 f"plan FP4 {report.fp4_fraction:.1%}, est. time {report.time_ratio:.3f}", fontsize=9)
    fig.tight_layout()
    path = out / f"divergences_iter_{report.iteration:07d}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("directory", type=Path, help="SAVE/snip of a --snip run")
    p.add_argument("--out", type=Path, default=Path("snip_report"))
    a = p.parse_args(argv)
    cycles = load_cycles(a.directory)
    a.out.mkdir(parents=True, exist_ok=True)
    for path in (plot_plans(cycles, a.out), plot_divergences(cycles[-1], a.out)):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
