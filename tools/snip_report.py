#!/usr/bin/env python
"""PNG plots of a SNIP run: its plans over time and the divergences per module.

    python tools/snip_report.py CKPT/snip --out report/

Reads every ``snip_iter_*.json`` a ``--snip`` run wrote next to its checkpoints and writes
``plans.png`` (one panel per cycle: rows are layers; for qkv, proj, fc1, fc2 the forward
and the backward GEMMs, coloured by format) and ``divergences_iter_N.png`` for the last
cycle (per module and candidate format: the estimated forward loss divergence and
backward update divergence, log scale).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from megatron_snip.precision.plan import PrecisionPlan  # noqa: E402
from megatron_snip.snip.plan_image import FORMAT_COLOURS, plan_image  # noqa: E402


def load_cycles(directory: Path) -> list[dict]:
    files = sorted(directory.glob("snip_iter_*.json"))
    if not files:
        raise SystemExit(f"snip_report.py: error: no snip_iter_*.json in {directory} (a --snip run with --save "
                         f"writes them to SAVE/snip/)")
    return [json.loads(f.read_text()) for f in files]


def plot_plans(cycles: list[dict], out: Path) -> Path:
    layers = cycles[0]["run"]["dims"]["num_layers"]
    fig, axes = plt.subplots(1, len(cycles), figsize=(1.6 * len(cycles) + 1.5, 0.25 * layers + 1.5), squeeze=False)
    for ax, cycle in zip(axes[0], cycles):
        report = cycle["cycle"]
        ax.imshow(plan_image(PrecisionPlan.from_dict(report["plan"]), layers))
        ax.set_title(f"iter {report['iteration']}\nFP4 {report['fp4_fraction']:.0%}", fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
    axes[0][0].set_ylabel("layer (0 at top)")
    fig.legend(handles=[Patch(color=np.array(c) / 255, label=f) for f, c in FORMAT_COLOURS.items()],
               loc="lower center", ncol=len(FORMAT_COLOURS), fontsize=8)
    fig.suptitle("SNIP plans (per layer: qkv, proj, fc1, fc2 x fwd|bwd)", fontsize=9)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    path = out / "plans.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_divergences(cycle: dict, out: Path) -> Path:
    div = cycle["divergences"]
    names = list(div)
    formats = sorted({f for per in div.values() for f in per})
    fig, axes = plt.subplots(2, 1, figsize=(max(6, 0.3 * len(names)), 6), sharex=True)
    x = np.arange(len(names))
    width = 0.8 / len(formats)
    for i, fmt in enumerate(formats):
        colour = np.array(FORMAT_COLOURS.get(fmt, (128, 128, 128))) / 255
        for ax, key in zip(axes, ("forward", "backward")):
            values = [max(div[n].get(fmt, {}).get(key, np.nan), 1e-12) for n in names]
            ax.bar(x + i * width, values, width, color=colour, label=fmt)
    for ax, label in zip(axes, ("loss divergence dL / loss", "update divergence dU / ||u||^2")):
        ax.set_yscale("log")
        ax.set_ylabel(label, fontsize=8)
    axes[0].legend(fontsize=8)
    short = [n.replace("decoder.layers.", "L").replace("self_attention.linear_", "").replace("mlp.linear_", "")
             for n in names]
    axes[1].set_xticks(x + 0.4 - width / 2, short, rotation=90, fontsize=6)
    fig.suptitle(f"SNIP estimates at iteration {cycle['cycle']['iteration']}", fontsize=9)
    fig.tight_layout()
    path = out / f"divergences_iter_{cycle['cycle']['iteration']:07d}.png"
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
