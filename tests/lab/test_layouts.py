"""snip_lab.layouts: how far apart two runs' exact update drifts and SNIP's estimates are (--validated)."""

from __future__ import annotations

import json

import pytest

from snip_lab.cli.compare_layouts import main
from snip_lab.layouts import compare_validations, spread


def _validation(path, truth, estimate):
    path.write_text(json.dumps({"iteration": 40, "truth_backward": truth, "estimate_backward": estimate}))
    return path


def test_spread_takes_each_pair_the_larger_over_the_smaller():
    a = {"l0.fc1": {"fp8": 1.0, "nvfp4": 4.0}, "l1.fc1": {"fp8": 2.0, "nvfp4": 1.0}}
    b = {"l0.fc1": {"fp8": 1.2, "nvfp4": 2.0}, "l1.fc1": {"fp8": 2.0, "nvfp4": 1.5}}
    s = spread(a, b)
    assert s.largest == (2.0, "l0.fc1 nvfp4")
    assert s.median == pytest.approx((1.2 + 1.5) / 2)  # ratios 1.2, 2.0, 1.0, 1.5
    assert (s.over, s.pairs) == (2, 4)  # 2.0 and 1.5 are over 1.3


def test_spread_refuses_values_without_a_ratio():
    with pytest.raises(ValueError, match="l0.fc1 fp8: a value <= 0 has no ratio"):
        spread({"l0.fc1": {"fp8": 0.0}}, {"l0.fc1": {"fp8": 1.0}})


def test_validations_compare_truth_and_estimate_and_the_cli_prints_them(tmp_path, capsys):
    a = _validation(tmp_path / "a.json", {"m": {"fp8": 1.0, "nvfp4": 3.0}}, {"m": {"fp8": 1.0, "nvfp4": 9.0}})
    b = _validation(tmp_path / "b.json", {"m": {"fp8": 1.1, "nvfp4": 2.0}}, {"m": {"fp8": 4.0, "nvfp4": 9.0}})
    spreads = compare_validations(a, b)
    assert spreads["truth"].largest == (1.5, "m nvfp4") and spreads["truth"].over == 1
    assert spreads["estimate"].largest == (4.0, "m fp8") and spreads["estimate"].median == pytest.approx(2.5)
    assert main(["--validated", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "truth         1.500 m nvfp4" in out and "1 of 2" in out
    assert "estimate      4.000 m fp8" in out


def test_validations_refuse_a_by_type_file(tmp_path, capsys):
    a = _validation(tmp_path / "a.json", {"m": {"fp8": 1.0}}, {"m": {"fp8": 1.0}})
    by_type = tmp_path / "bt.json"
    by_type.write_text(json.dumps({"iteration": 40, "by_type": {}}))
    assert main(["--validated", str(a), str(by_type)]) == 2
    assert "bt.json holds no per-module update drifts (written by --validate-by-type?)" in capsys.readouterr().err
