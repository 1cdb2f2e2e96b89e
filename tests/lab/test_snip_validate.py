"""tools/lab/snip_validate.py, the arbiter of SNIP's estimators, as a user runs it (its ground truth is
checked against SNIP's probes in tests/test_snip_probes.py, which share that test's launch)."""

from __future__ import annotations

import json
import math

import pytest
from conftest import launch, train_args


@pytest.mark.integration
def test_snip_validate_by_type_measures_every_type_in_every_format(tiny_data, tmp_path):
    """tools/lab/snip_validate.py --validate-by-type, as a user runs it: one row per module type and
    quantized format, SNIP's update terms next to the measured drifts, all of them finite."""
    out = tmp_path / "by_type.json"
    run = train_args(tiny_data, "--snip", "--snip-formats", "bf16", "fp8", "mxfp4", "--snip-interval", "4", iters=4)
    proc = launch(1, [*run, "--validate-by-type", "--validate-batches", "2", "--output", str(out)],
                  script="tools/lab/snip_validate.py")
    assert "the exact update drift in mxfp4, every module of a type at once" in proc.stdout
    table = json.loads(out.read_text())["by_type"]
    assert sorted(table) == ["fp8", "mxfp4"]
    for rows in table.values():
        assert sorted(rows) == ["linear_fc1", "linear_fc2", "linear_proj", "linear_qkv"]
        for row in rows.values():
            assert all(math.isfinite(v) for v in row.values()), row
            assert row["bwd: own"] > 0 and row["SNIP local"] > 0
            assert all(-1 < row[f"bwd: {p}persistence"] < 1 for p in ("", "own ", "other "))


def test_snip_validate_by_type_needs_two_batches(monkeypatch, capsys):
    """Persistence compares batches: one batch is refused up front, naming the flag and what would do."""
    from snip_lab.cli.snip_validate import main

    monkeypatch.setattr("sys.argv", ["snip_validate.py", "--validate-by-type", "--validate-batches", "1"])
    assert main() == 2
    assert "give --validate-batches 2 or more (got 1)" in capsys.readouterr().err
