"""A precision plan as a picture: one row per layer, one column per GEMM group, coloured by format.

Columns: for each of linear_qkv, linear_proj, linear_fc1, linear_fc2 a forward
cell (fprop) and a backward cell (dgrad + wgrad), so a plan that splits the two
shows it. Used for TensorBoard's image panel and ``tools/snip_report.py``.
"""

from __future__ import annotations

import numpy as np

from megatron_snip.precision.plan import LINEAR_MODULES, PrecisionPlan, module_name
from megatron_snip.precision.registry import PRECISIONS

# Colour-blind-safe palette (Paul Tol's "bright"), RGB, from the format registry.
FORMAT_COLOURS: dict[str, tuple[int, int, int]] = {name: p.colour for name, p in PRECISIONS.items()}
_GAP = (255, 255, 255)


def plan_image(plan: PrecisionPlan, num_layers: int, cell: int = 8) -> np.ndarray:
    """``[num_layers * cell, 8 * cell + 3 * gap, 3]`` uint8 RGB image of ``plan`` (layer 0 on top).

    A 1-pixel-per-cell white gap separates the four modules.
    """
    gap = max(cell // 4, 1)
    width = len(LINEAR_MODULES) * 2 * cell + (len(LINEAR_MODULES) - 1) * gap
    image = np.full((num_layers * cell, width, 3), _GAP, dtype=np.uint8)
    for layer in range(num_layers):
        rows = slice(layer * cell, (layer + 1) * cell)
        for m, module in enumerate(LINEAR_MODULES):
            precision = plan[module_name(layer, module)]
            left = m * (2 * cell + gap)
            image[rows, left:left + cell] = FORMAT_COLOURS[precision.fwd]
            image[rows, left + cell:left + 2 * cell] = FORMAT_COLOURS[precision.bwd]
    return image
