"""What a benchmark hands to ``bench/gpu_suite.py``: its figures, and each goal with its verdict."""

from __future__ import annotations

import json
import os
from pathlib import Path


def goal(name: str, value: float | None, *, at_least: float | None = None, at_most: float | None = None,
         profiles: tuple[str, ...] = ()) -> dict:
    """One goal of the issue: ``value`` against its bound (met is None when nothing was measured).
    ``profiles``: the torch.profiler tables that show where the time of what it measures goes, by name
    (``PHASE`` in the same benchmark's ``profiles``, or ``STEP/PHASE`` for another step of
    bench/gpu_suite.py), which its report shows when the goal is missed."""
    if (at_least is None) == (at_most is None):
        raise ValueError("a goal has exactly one bound: at_least or at_most")
    bound = f">= {at_least:g}" if at_least is not None else f"<= {at_most:g}"
    met = None if value is None else (value >= at_least if at_least is not None else value <= at_most)
    return {"name": name, "value": value, "goal": bound, "met": met, **({"profiles": list(profiles)} if profiles
                                                                         else {})}


def write_json(path: str | Path | None, result: dict) -> None:
    """A benchmark's results as JSON (nothing when no path was asked for), written whole or not at all:
    a benchmark rewrites it as it goes, and may be killed meanwhile."""
    if path:
        tmp = Path(f"{path}.tmp")
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, path)
