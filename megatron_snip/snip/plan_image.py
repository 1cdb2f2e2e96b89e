"""A precision plan as a labelled picture: one row per layer, one column per GEMM group, coloured by format.

Columns: for each of linear_qkv, linear_proj, linear_fc1, linear_fc2 a forward
cell (fprop) and a backward cell (dgrad + wgrad), so a plan that splits the two
shows it. Layer ticks, module labels and a legend of the formats are drawn on it;
row heights shrink with depth so an 80-layer plan stays one readable column. Used
for TensorBoard's image panel and ``tools/snip_report.py``.
"""

from __future__ import annotations

import math

import numpy as np

from megatron_snip.numerics.registry import PRECISIONS
from megatron_snip.precision.plan import LINEAR_MODULES, PrecisionPlan, module_name

# Colour-blind-safe palette (Paul Tol's "bright"), RGB, from the format registry.
FORMAT_COLOURS: dict[str, tuple[int, int, int]] = {name: p.colour for name, p in PRECISIONS.items()}
SHORT_MODULE_NAMES = {m: m.rsplit("_", 1)[-1] for m in LINEAR_MODULES}  # qkv, proj, fc1, fc2
COLUMNS = [f"{SHORT_MODULE_NAMES[m]}\n{side}" for m in LINEAR_MODULES for side in ("fwd", "bwd")]


def plan_cells(plan: PrecisionPlan, num_layers: int) -> list[list[str]]:
    """The plan as a ``[num_layers][8]`` grid of format names (columns as :data:`COLUMNS`)."""
    rows = []
    for layer in range(num_layers):
        row = []
        for module in LINEAR_MODULES:
            precision = plan[module_name(layer, module)]
            row += [precision.fwd, precision.bwd]
        rows.append(row)
    return rows


def layer_tick_step(num_layers: int, max_ticks: int = 20) -> int:
    """Label every layer up to ``max_ticks`` layers, then every 2nd, 5th, 10th, ... layer."""
    for step in (1, 2, 5, 10, 20, 50, 100):
        if math.ceil(num_layers / step) <= max_ticks:
            return step
    return math.ceil(num_layers / max_ticks)


def draw_plan(ax, plan: PrecisionPlan, num_layers: int, title: str | None = None) -> None:
    """Draw ``plan`` on a matplotlib Axes: layers as rows (0 on top), the 8 GEMM groups as labelled
    columns, white lines between modules."""
    cells = plan_cells(plan, num_layers)
    rgb = np.array([[FORMAT_COLOURS[f] for f in row] for row in cells], dtype=np.uint8)
    ax.imshow(rgb, aspect="auto", interpolation="nearest")
    ax.set_xticks(range(len(COLUMNS)), COLUMNS, fontsize=6)
    ax.tick_params(axis="x", length=0)
    for boundary in range(2, len(COLUMNS), 2):
        ax.axvline(boundary - 0.5, color="white", linewidth=2)
    step = layer_tick_step(num_layers)
    ax.set_yticks(range(0, num_layers, step), [str(i) for i in range(0, num_layers, step)], fontsize=6)
    ax.set_ylabel("layer", fontsize=7)
    if title:
        ax.set_title(title, fontsize=8)


def legend_handles(formats) -> list:
    """Legend patches for ``formats`` (in the registry's order)."""
    from matplotlib.patches import Patch

    return [Patch(color=np.array(FORMAT_COLOURS[f]) / 255, label=f) for f in FORMAT_COLOURS if f in set(formats)]


def plan_image(plan: PrecisionPlan, num_layers: int, title: str | None = None) -> np.ndarray:
    """``[H, W, 3]`` uint8 RGB picture of ``plan`` with layer ticks, module labels and a legend of the
    formats it uses; W = 480 px, H grows with depth (about 6-16 px per layer)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    dpi = 100
    row_px = min(16, max(6, 640 // max(num_layers, 1)))
    fig = Figure(figsize=(4.8, (num_layers * row_px + 130) / dpi), dpi=dpi)
    ax = fig.add_axes((0.12, 90 / (num_layers * row_px + 130), 0.85, num_layers * row_px / (num_layers * row_px + 130)))
    draw_plan(ax, plan, num_layers, title)
    used = {f for row in plan_cells(plan, num_layers) for f in row}
    fig.legend(handles=legend_handles(used), loc="lower center", ncol=len(used), fontsize=7, frameon=False)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()
