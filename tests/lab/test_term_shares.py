"""tools/lab/term_shares.py: where SNIP's loss and update terms put a format's cost, by layer and module type."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import launch, train_args

from snip_lab.ranks import spearman


def test_equilibrium_cost_by_hand():
    """Element 0: h = 10 x 0.01 = 0.1, eta = 0.01 / 0.1 = 0.1, so 1 / h = steps x eta = 10: the repeated error
    b = 2 costs 0.5 x 0.1 x 4 x 10^2 = 20; the independent one (variance 2) settles at 0.1 x 2 / 0.2 = 1 (the
    random walk's 100 x 0.01 x 2 = 2 is larger): 0.05. Element 1 is flat (no gradient): it costs nothing.
    Element 2: h = 40, eta = 0.01 / 2 = 0.005, 1 / h = 0.025 < 0.5 = steps x eta: 0.5 x 40 x 1 x 0.025^2 = 0.0125;
    the noise settles at 0.005 x 1 / 80 (under the walk's 100 x 0.005^2 = 0.0025): 0.5 x 40 x 6.25e-5 = 0.00125."""
    from snip_lab.ground_truth import equilibrium_cost

    bias, noise = equilibrium_cost(torch.tensor([4.0, 9.0, 1.0], dtype=torch.float64),
                                   torch.tensor([2.0, 3.0, 1.0], dtype=torch.float64),
                                   torch.tensor([0.01, 0.0, 4.0], dtype=torch.float64),
                                   tokens=10, lr=0.01, eps=0.0, steps=100)
    assert float(bias) == pytest.approx(20.0 + 0.0125) and float(noise) == pytest.approx(0.05 + 0.00125)


@pytest.mark.integration
def test_term_shares_split_each_term_over_the_layers_and_types(tiny_data, tmp_path):
    """Trained 3 iterations, then one probe cycle and the exact equilibrium terms: each term's shares cover every
    layer and type and add up to 1, the printed rows are the written ones, and the Spearman correlations with
    ablation costs are those of the shares."""
    out, ablations = tmp_path / "shares.json", tmp_path / "costs.json"
    ablated = {"ablate-layer0": 0.003, "ablate-layer1": 0.001, "ablate-linear_qkv": 0.002, "ablate-linear_proj": 0.0,
              "ablate-linear_fc1": 0.001, "ablate-linear_fc2": 0.004}
    ablations.write_text(json.dumps({"groups": ablated}))
    run = train_args(tiny_data, "--snip", "--snip-formats", "bf16", "fp8", "mxfp4", "--snip-interval", "100", iters=3)
    flags = ["--format", "mxfp4", "--json", str(out), "--equilibrium-steps", "10", "--equilibrium-batches", "1",
             "--ablation-costs", str(ablations)]
    proc = launch(1, [*run, *flags], script="tools/lab/term_shares.py")
    result = json.loads(out.read_text())
    assert result["iteration"] == 3 and result["format"] == "mxfp4"
    # the repeated part's estimate is unbiased, not clamped at 0, so only the independent part must be positive
    assert result["totals"]["equilibrium, independent"] > 0 and math.isfinite(result["totals"]["equilibrium, repeated"])
    types = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    for term in ("objective", "loss term", "update term", "equilibrium, repeated", "equilibrium, independent"):
        by_type = result[term]["types"]
        assert result["spearman"][term]["types"] == pytest.approx(
            spearman([by_type[t] for t in types], [ablated[f"ablate-{t}"] for t in types]))
        shares = result[term]
        assert sorted(shares["types"]) == ["linear_fc1", "linear_fc2", "linear_proj", "linear_qkv"]
        assert len(shares["layers"]) >= 2
        for groups in shares.values():
            assert sum(groups.values()) == pytest.approx(1.0)
            assert term == "equilibrium, repeated" or all(v >= 0 for v in groups.values())
        assert f"{term:<12} types   linear_fc1 {shares['types']['linear_fc1']:.3f}" in proc.stdout


def test_term_shares_needs_the_format_among_the_candidates(tiny_data, tmp_path):
    """A format the run does not measure is refused, naming the flags and the run's candidates."""
    run = train_args(tiny_data, "--snip", "--snip-formats", "bf16", "fp8", "mxfp4", "--snip-interval", "100", iters=2)
    proc = launch(1, [*run, "--format", "nvfp4"], script="tools/lab/term_shares.py", check=False)
    assert proc.returncode != 0
    assert "--format nvfp4: give --snip and a --snip-formats that holds it (the run's: bf16 fp8 mxfp4)" in proc.stderr


def test_a_missing_ablation_costs_file_is_refused_before_anything_runs(tmp_path, capsys):
    from snip_lab.cli.term_shares import main

    assert main(["--format", "mxfp4", "--ablation-costs", str(tmp_path / "costs.json")]) == 2
    assert f"--ablation-costs {tmp_path / 'costs.json'}: no such file" in capsys.readouterr().err
