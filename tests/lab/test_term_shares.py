"""tools/lab/term_shares.py: where SNIP's loss and update terms put a format's cost, by layer and module type."""

from __future__ import annotations

import json

import pytest
from conftest import launch, train_args


@pytest.mark.integration
def test_term_shares_split_each_term_over_the_layers_and_types(tiny_data, tmp_path):
    """Trained 3 iterations, then one probe cycle: each term's shares cover every layer and type and add up to 1,
    and the printed rows are the written ones."""
    out = tmp_path / "shares.json"
    run = train_args(tiny_data, "--snip", "--snip-formats", "bf16", "fp8", "mxfp4", "--snip-interval", "100", iters=3)
    proc = launch(1, [*run, "--format", "mxfp4", "--json", str(out)], script="tools/lab/term_shares.py")
    result = json.loads(out.read_text())
    assert result["iteration"] == 3 and result["format"] == "mxfp4"
    for term in ("loss term", "update term"):
        shares = result[term]
        assert sorted(shares["types"]) == ["linear_fc1", "linear_fc2", "linear_proj", "linear_qkv"]
        assert len(shares["layers"]) >= 2
        for groups in shares.values():
            assert sum(groups.values()) == pytest.approx(1.0) and all(v >= 0 for v in groups.values())
        assert f"{term:<12} types   linear_fc1 {shares['types']['linear_fc1']:.3f}" in proc.stdout


def test_term_shares_needs_the_format_among_the_candidates(tiny_data, tmp_path):
    """A format the run does not measure is refused, naming the flags and the run's candidates."""
    run = train_args(tiny_data, "--snip", "--snip-formats", "bf16", "fp8", "mxfp4", "--snip-interval", "100", iters=2)
    proc = launch(1, [*run, "--format", "nvfp4"], script="tools/lab/term_shares.py", check=False)
    assert proc.returncode != 0
    assert "--format nvfp4: give --snip and a --snip-formats that holds it (the run's: bf16 fp8 mxfp4)" in proc.stderr
