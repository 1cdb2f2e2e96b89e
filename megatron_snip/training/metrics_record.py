"""The run's own record of its scalars: ``SAVE/metrics.jsonl``, beside the checkpoints.

Every scalar the logging rank sends to TensorBoard (the tags of ``training/tags.py``) is also
appended here, one JSON line per logging call: ``{"version": 1, "iteration": N, "scalars": {tag:
value}}``. Tools read a run's numbers from this record (``read_metrics``) instead of parsing
TensorBoard event files, and it exists whether or not ``--tensorboard-dir`` is given.

A resumed run appends the iterations after its checkpoint again (a resume reproduces them): the
reader keeps the last value of each (tag, iteration). A line cut short by a crash is skipped.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path

METRICS_FILE = "metrics.jsonl"
METRICS_RECORD_VERSION = 1


class MetricsRecord:
    """Appends the logging rank's scalars to ``directory/metrics.jsonl`` (flushed at every line)."""

    def __init__(self, directory: str):
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, METRICS_FILE)
        self._file = open(self.path, "a", encoding="utf-8")  # open for the run's lifetime

    def write(self, iteration: int, scalars: dict[str, float]) -> None:
        # JSON has no NaN/Inf: a non-finite value is written as null (and read back as NaN).
        values = {tag: (float(v) if math.isfinite(float(v)) else None) for tag, v in scalars.items()}
        self._file.write(json.dumps({"version": METRICS_RECORD_VERSION, "iteration": iteration,
                                     "scalars": values}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def abandon(self) -> None:
        """Close after a failed write, dropping what could not be written."""
        with contextlib.suppress(OSError):  # the failed write's error is the one reported
            self._file.close()


def read_metrics(path: str | Path) -> dict[str, dict[int, float]]:
    """tag -> iteration -> value of a ``metrics.jsonl`` (or of the one in directory ``path``).

    Raises FileNotFoundError naming the file when there is none, ValueError for a record written by a
    newer program.
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    out: dict[str, dict[int, float]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:  # the last line of a run that died mid-write
            continue
        if entry.get("version", 0) > METRICS_RECORD_VERSION:
            raise ValueError(f"{path}: metrics record version {entry['version']} is newer than this program's "
                             f"{METRICS_RECORD_VERSION}")
        for tag, value in entry["scalars"].items():
            out.setdefault(tag, {})[entry["iteration"]] = math.nan if value is None else value
    return out
