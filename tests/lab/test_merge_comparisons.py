"""tools/lab/merge_comparisons.py: reports of one comparison's seeds trained in separate folders, as one table."""

from __future__ import annotations

import json
import random
import statistics
from dataclasses import replace

import pytest

from megatron_snip.snip.statistics_file import Budget
from snip_lab.branches import BranchResult, ComparisonConfig, branches, settings
from snip_lab.cli import merge_comparisons
from snip_lab.merge import merge_reports, parse_budget
from snip_lab.report import markdown, summarize

BUDGETS = (Budget(0.75), Budget(0.9))
COSTS = {"modules": {"layer0.qkv": 0.002}, "groups": {}, "base_gap": 0.001, "source": "layers x types",
         "seeds": [1]}
ARMS = ("snip", "uniform", "oracle")


def config(seeds, **kw) -> ComparisonConfig:
    base = dict(out="unused", train_args=("--num-layers", "8"), policies=ARMS, budgets=BUDGETS, seeds=tuple(seeds),
                trunk_iters=100, train_iters=300, snip_interval=100, ablations=("layers", "types"), noise_floor=True)
    return ComparisonConfig(**{**base, **kw})


def all_results(seeds=(1, 2, 3, 4, 5), rng_seed=0) -> dict[tuple[str, int], BranchResult]:
    """Every arm at both budgets, BF16, the noise floor, and two ablation arms on seed 1: random losses."""
    rng = random.Random(rng_seed)
    names = ["bf16", "bf16-reorder", *(f"{a}_{b.tag}" for a in ARMS for b in BUDGETS)]
    results = {(n, s): BranchResult(final_valid_loss=4.8 + rng.uniform(0, 0.05), mean_train_loss=3.9 + rng.uniform(
        0, 0.05), fp4_fraction=rng.choice([0.75, 0.9, 1.0]), time_ratio=rng.uniform(0.25, 0.35))
        for n in names for s in seeds}
    results.update({(a, 1): BranchResult(4.81, 3.91, 0.125, 0.47) for a in ("ablate-layer0", "ablate-none")})
    return results


def report(c: ComparisonConfig, results, path, predicted=None, record_settings=True):
    """The report a comparison with settings ``c`` writes for the branches of its seeds in ``results``."""
    mine = {k: v for k, v in results.items() if k[1] in c.seeds}
    arms = sorted({n for n, _ in mine if n.startswith("ablate-")})
    oracle = {"costs": COSTS, "predicted": {n: {s: p for s, p in v.items() if s in c.seeds}
                                            for n, v in (predicted or {}).items()}}
    summary = summarize(c, mine, branches(c, arms), oracle=oracle)
    if record_settings:
        summary["settings"] = settings(c)
    path.write_text(json.dumps(summary))
    return path


def test_reports_of_separate_seeds_merge_into_the_report_of_all_seeds(tmp_path):
    """Seeds 1-2 in one folder, 3-5 in another (the 90% arms of seeds 3-5 in a third): the merged rows,
    regrets, paired differences with 95% intervals and additive predictions are the one comparison's."""
    results = all_results()
    predicted = {f"uniform_{b.tag}": {s: 0.01 * s for s in range(1, 6)} for b in BUDGETS}
    whole = config((1, 2, 3, 4, 5))
    want = summarize(whole, results, branches(whole, ["ablate-layer0", "ablate-none"]),
                     oracle={"costs": COSTS, "predicted": predicted})
    a = report(config((1, 2)), results, tmp_path / "a.json", predicted)
    b = report(config((3, 4, 5), budgets=BUDGETS[:1]), results, tmp_path / "b.json", predicted)
    late = {k: v for k, v in results.items() if k[0] in ("bf16", *(f"{x}_fp4-0.90" for x in ARMS))}
    c = report(config((3, 4, 5), budgets=BUDGETS[1:], noise_floor=False), late, tmp_path / "c.json", predicted,
               record_settings=False)
    notes = []
    got = merge_reports([a, b, c], str(tmp_path / "merged"), log=notes.append)
    assert notes == [f"{c}: written before reports recorded their settings; checked on trunk_iters, train_iters, "
                     "window only"]
    assert got["sources"] == [str(a), str(b), str(c)] and got["complete"]
    rows = {(r["arm"], r["budget"]): r for r in got["rows"]}
    assert set(rows) == {(r["arm"], r["budget"]) for r in want["rows"]}
    for w in want["rows"]:
        r = rows[(w["arm"], w["budget"])]
        assert r["seeds"] == w["seeds"]
        for key in ("gap", "gap_std", "train_gap", "train_gap_std", "fp4_fraction", "time_ratio", "regret",
                    "regret_ci", "train_regret", "ratio_to_oracle", "train_ratio_to_oracle", "additive_prediction"):
            assert r.get(key, 0.0) == pytest.approx(w.get(key, 0.0), nan_ok=True), (w["arm"], w["budget"], key)
    assert rows[("uniform", "FP4 target 0.90")]["additive_prediction"] == pytest.approx(0.03)  # (0.01 + ... + 0.05) / 5
    assert len(got["versus_snip"]) == len(want["versus_snip"]) == 4  # uniform and oracle against snip, 2 budgets
    for g, w in zip(got["versus_snip"], want["versus_snip"]):
        assert (g["arm"], g["budget"], g["seeds"]) == (w["arm"], w["budget"], w["seeds"])
        assert [g[k] for k in ("val", "val_ci", "train", "train_ci")] == pytest.approx(
            [w[k] for k in ("val", "val_ci", "train", "train_ci")])
    assert got["noise_floor"]["seeds"] == [1, 2, 3, 4, 5] and got["oracle"] == COSTS
    assert got["noise_floor"]["val_ci"] == pytest.approx(want["noise_floor"]["val_ci"])
    assert not (tmp_path / "merged").exists()  # merge_reports writes nothing; write_merged (the command) does

    # The command: the merged table, printed and written.
    assert merge_comparisons.main(["--out", str(tmp_path / "cli"), str(a), str(b), str(c)]) == 0
    table = (tmp_path / "cli" / "results.md").read_text()
    assert f"Merged from 3 reports: {a}, {b}, {c}." in table and "| FP4 target 0.90 | oracle | 5 |" in table
    # Under the default speed model each report's est. GEMM times come from its own machine: said so.
    assert "est. GEMM times were measured on its own machine" in table
    assert json.loads((tmp_path / "cli" / "oracle" / "costs.json").read_text()) == COSTS  # for --oracle-costs
    assert [r["gap"] for r in json.loads((tmp_path / "cli" / "results.json").read_text())["rows"]] == pytest.approx(
        [r["gap"] for r in got["rows"]], nan_ok=True)
    # A report whose seeds an arm lacks: incomplete, and said so in the merge's own words.
    partial = merge_reports([a, c], str(tmp_path / "partial"))
    assert not partial["complete"]
    assert "some arms lack some of the seeds (the seeds column)" in markdown(partial)


def test_a_merge_refuses_other_trunks_other_settings_and_two_oracles(tmp_path, capsys):
    results = all_results()
    a = report(config((1, 2)), results, tmp_path / "a.json")
    # The same branch in two reports with the same numbers: one branch (seed 2 in both).
    both = merge_reports([a, report(config((2, 3)), results, tmp_path / "b.json")], str(tmp_path / "m1"))
    assert next(r for r in both["rows"] if r["arm"] == "bf16")["seeds"] == [1, 2, 3]

    # Other numbers for it: other trunks (or settings), refused, naming both reports and the branch.
    other = dict(results)
    other[("bf16", 2)] = replace(results[("bf16", 2)], final_valid_loss=4.9)
    b = report(config((2, 3)), other, tmp_path / "b_other.json")
    with pytest.raises(ValueError, match=rf"bf16 of seed 2 differs between {a} .* and {b} \(4.9, "):
        merge_reports([a, b], str(tmp_path / "m2"))
    summary = json.loads(b.read_text())  # other trunks whose oracles differ too: the trunks are named first
    b.write_text(json.dumps({**summary, "oracle": {**COSTS, "seeds": [2]}}))
    with pytest.raises(ValueError, match=r"bf16 of seed 2 differs between"):
        merge_reports([a, b], str(tmp_path / "m2"))
    # Other settings: what differs is named.
    b = report(config((3,), train_args=("--num-layers", "16")), results, tmp_path / "b_deeper.json")
    with pytest.raises(ValueError, match=rf"{b} and {a} differ in train_args"):
        merge_reports([a, b], str(tmp_path / "m3"))
    b = report(config((3,), train_iters=400), results, tmp_path / "b_longer.json")
    with pytest.raises(ValueError, match=r"differ in train_iters, window \(train_iters 400 vs 300, window 60 vs 40\)"):
        merge_reports([a, b], str(tmp_path / "m4"))

    # Oracles planned from other costs are other arms: refused, or the one --oracle-from names kept.
    # (b: the same trunks and arms, seeds 1-3, and an oracle planned with costs of three seeds' ablations)
    b = tmp_path / "b_oracle3.json"
    three = {**results, **{k: v for k, v in all_results(rng_seed=1).items() if k[0].startswith("oracle_")}}
    summary = json.loads(report(config((1, 2, 3)), three, b).read_text())
    summary["oracle"] = {**COSTS, "seeds": [1, 2, 3]}
    b.write_text(json.dumps(summary))
    with pytest.raises(ValueError, match="planned with different costs .* --oracle-from"):
        merge_reports([a, b], str(tmp_path / "m5"))
    got = merge_reports([a, b], str(tmp_path / "m6"), oracle_from=b)
    oracle = {r["budget"]: r for r in got["rows"] if r["arm"] == "oracle"}
    theirs = {r["budget"]: r for r in summary["rows"] if r["arm"] == "oracle"}
    assert json.loads(json.dumps({k: v["per_seed"] for k, v in oracle.items()})) == {
        k: v["per_seed"] for k, v in theirs.items()}
    assert got["oracle"]["seeds"] == [1, 2, 3]
    snip = next(r for r in got["rows"] if (r["arm"], r["budget"]) == ("snip", "FP4 target 0.75"))
    assert snip["regret"] == pytest.approx(statistics.fmean(
        results[("snip_fp4-0.75", s)].final_valid_loss - three[("oracle_fp4-0.75", s)].final_valid_loss
        for s in (1, 2, 3)))
    with pytest.raises(ValueError, match="--oracle-from .*: give one of the merged reports that has oracle rows"):
        merge_reports([a, b], str(tmp_path / "m7"), oracle_from=tmp_path / "nowhere.json")

    # Bad input from the command line: one clear line, nothing written.
    (tmp_path / "cmp").mkdir()
    (tmp_path / "cmp" / "comparison.json").write_text("{}")
    assert merge_comparisons.main(["--out", str(tmp_path / "cmp"), str(a), str(a)]) == 1
    assert "holds a comparison (comparison.json): write the merge to a folder of its own" in capsys.readouterr().err
    assert merge_comparisons.main(["--out", str(tmp_path / "m8"), str(a), str(tmp_path / "none.json")]) == 1
    assert f"{tmp_path / 'none.json'}: not a comparison's report" in capsys.readouterr().err
    assert merge_comparisons.main(["--out", str(tmp_path / "m9"), str(a)]) == 1
    assert "give two or more reports" in capsys.readouterr().err
    assert merge_comparisons.main(["--out", str(tmp_path / "m10"), "--versus", "threshold", str(a), str(a)]) == 1
    assert "--versus threshold is not among --policies ['snip', 'uniform', 'oracle']" in capsys.readouterr().err
    assert not [p for p in ("m8", "m9", "m10") if (tmp_path / p).exists()]


def test_budgets_parse_back_from_their_labels():
    for b in (Budget(0.75), Budget(0.9), Budget(time_target=0.4)):
        assert parse_budget(b.label) == b and parse_budget(b.label).tag == b.tag
    with pytest.raises(ValueError, match="unknown budget label 'FP4 0.75'"):
        parse_budget("FP4 0.75")
