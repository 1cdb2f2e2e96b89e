"""Faults in low precision: non-finite gradients are caught before the optimizer step, on every rank.

A test-only driver (tests/drivers/inject_nonfinite.py) writes a NaN/Inf into one element of one
parameter's gradient at a chosen iteration, on a chosen TP rank.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from conftest import launch, resume_from, scalars, train_args

from megatron_snip.arguments import ArgumentError, parse_config
from megatron_snip.numerics.fp8 import fp8_scale_from_amax
from megatron_snip.numerics.health import FIELDS, POINTS, HealthStats, combine, operand_health, summarize
from megatron_snip.numerics.linear import QuantState, quantized_linear
from megatron_snip.numerics.quantize import quantize_dequantize
from megatron_snip.numerics.recipes import Precision, RecipeConfig, operand_quantizer
from megatron_snip.precision.plan import PrecisionPlan, module_names
from megatron_snip.training import tags
from megatron_snip.training.checkpointing import read_record
from megatron_snip.training.quant_health import HealthTable, promote
from megatron_snip.training.safety import is_spike

DRIVER = "tests/drivers/inject_nonfinite.py"
LOSS, SKIPPED = tags.LM_LOSS, tags.SKIPPED_ITERATIONS


def inject(at: int, param: str, **more) -> dict:
    return {"INJECT_AT": str(at), "INJECT_PARAM": param, **{k: str(v) for k, v in more.items()}}


@pytest.mark.integration
def test_fail_policy_raises_on_every_rank_and_keeps_the_last_good_checkpoint(tiny_data, tmp_path):
    ckpt = tmp_path / "ckpt"
    param = "decoder.layers.3.mlp.linear_fc2.weight"  # only TP rank 1's shard is corrupted
    proc = launch(2, train_args(tiny_data, "--tensor-model-parallel-size", "2", "--save", str(ckpt),
                                "--save-interval", "2", iters=6),
                  check=False, env=inject(4, param, INJECT_TP_RANK=1), script=DRIVER)
    assert proc.returncode != 0
    errors = re.findall(r"pretrain_llama\.py: error: rank .*?nothing was saved", proc.stderr)
    assert sorted(int(re.search(r"rank (\d)", e).group(1)) for e in errors) == [0, 1], proc.stderr[-3000:]
    for e in errors:  # the same iteration and the same culprit on every rank
        assert "non-finite gradients at iteration 4: rank 1 (tp 1, pp 0, dp 0): " + param in e
        assert e.count("decoder.layers") == 1 and "policy fail" in e
    assert "[train] iteration        3/" in proc.stdout and "[train] iteration        4/" not in proc.stdout
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert not (ckpt / "iter_0000004").exists() and not (ckpt / "iter_0000004.tmp").exists()
    # The good checkpoint loads (and resharded to one process) and evaluates.
    launch(1, train_args(tiny_data, "--load", str(ckpt), "--skip-train", "--tensorboard-dir",
                         str(tmp_path / "tb"), iters=6))
    assert list(scalars(tmp_path / "tb", tags.LM_LOSS_VALIDATION)) == [2]


@pytest.mark.integration
def test_skip_policy_skips_counts_and_resumes_exactly(tiny_data, tmp_path):
    layout = ("--pipeline-model-parallel-size", "2", "--non-finite-grad-policy", "skip")
    digests = tmp_path / "digests"
    digests.mkdir()
    proc = launch(2, train_args(tiny_data, *layout, "--save", str(tmp_path / "full"), "--save-interval", "4",
                                "--tensorboard-dir", str(tmp_path / "tb_full")),
                  env=inject(3, "decoder.layers.0.self_attention.linear_qkv.weight", INJECT_VALUE="inf",
                             PARAM_DIGESTS=digests), script=DRIVER)
    assert "non-finite gradients at iteration 3: rank 0 (tp 0, pp 0, dp 0): decoder.layers.0." in proc.stdout
    assert "update skipped (1 in a row, 1 in the run)" in proc.stdout
    for rank in (0, 1):  # weights entering step 4 are those entering step 3: the skipped step changed nothing
        d = json.loads((digests / f"rank{rank}.json").read_text())
        assert d["3"] == d["4"] and len({d["2"], d["3"], d["5"], d["6"]}) == 4  # (step 1 runs at LR 0)
    assert scalars(tmp_path / "tb_full", SKIPPED) == {1: 0, 2: 0, 3: 1, 4: 1, 5: 1, 6: 1}
    full = scalars(tmp_path / "tb_full", LOSS)
    ckpt = resume_from(tmp_path / "full", 4, tmp_path / "resumed")
    launch(2, train_args(tiny_data, *layout, "--load", str(ckpt), "--tensorboard-dir", str(tmp_path / "tb_res")))
    resumed = scalars(tmp_path / "tb_res", LOSS)
    assert sorted(resumed) == [5, 6] and {k: full[k] for k in resumed} == resumed  # bit-identical
    assert scalars(tmp_path / "tb_res", SKIPPED) == {5: 1, 6: 1}  # the count came back from the checkpoint


@pytest.mark.integration
def test_too_many_consecutive_skips_fail(tiny_data, tmp_path):
    """A gradient that is NaN at every step (here: from step 2 on, max 1 skip) stops the run."""
    proc = launch(1, train_args(tiny_data, "--non-finite-grad-policy", "skip", "--max-consecutive-skips", "0",
                                iters=3),
                  check=False, env=inject(2, "decoder.layers.1.mlp.linear_fc1.weight"), script=DRIVER)
    assert proc.returncode == 1
    assert "1 consecutive iterations skipped (--max-consecutive-skips 0): giving up" in proc.stderr


@pytest.mark.integration
def test_a_checkpoint_never_holds_nonfinite_weights(tiny_data, tmp_path):
    """Without the check the NaN reaches the weights; the save at 4 refuses, the one at 2 stays the newest."""
    ckpt = tmp_path / "ckpt"
    proc = launch(1, train_args(tiny_data, "--no-check-for-nan-in-loss-and-grad", "--save", str(ckpt),
                                "--save-interval", "2", iters=4),
                  check=False, env=inject(3, "decoder.layers.2.mlp.linear_fc2.weight"), script=DRIVER)
    assert proc.returncode == 1
    # (gradient clipping by a NaN norm spreads the NaN to every weight)
    assert f"refusing to save {ckpt / 'iter_0000004'}: non-finite values in rank 0 (tp 0, pp 0, dp 0): " in proc.stderr
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000002", "latest_checkpointed_iteration.txt",
                                                      "metrics.jsonl"]


def test_spike_is_relative_to_the_median_of_recent_losses():
    assert is_spike(7.0, [3.0, 3.2, 2.9], 2.0) == 3.0
    assert is_spike(5.9, [3.0, 3.2, 2.9], 2.0) is None
    assert is_spike(100.0, [3.0, 3.2], 2.0) is None  # too little history to judge


@pytest.mark.parametrize("flags, message", [
    (["--no-check-for-nan-in-loss-and-grad", "--non-finite-grad-policy", "skip"], "needs the check"),
    (["--spiky-loss-factor", "0.5"], "--spiky-loss-factor 0.5 must be > 1"),
    (["--max-consecutive-skips", "-1"], "--max-consecutive-skips must be >= 0"),
])
def test_bad_safety_flags_are_named(tiny_data, flags, message):
    with pytest.raises(ArgumentError, match=re.escape(message)):
        parse_config(train_args(tiny_data, *flags), world_size=1, cuda=False)


@pytest.mark.integration
def test_promote_on_fault_names_the_module_skips_and_recovers(tiny_data, tmp_path):
    """A NaN made by one NVFP4 module's forward GEMM: the health numbers name it, it is promoted to FP8 and the
    run goes on."""
    module = "decoder.layers.1.mlp.linear_fc2"
    ckpt, tb = tmp_path / "ckpt", tmp_path / "tb"
    # Logged (and so fully measured) every second step: step 3 is not measured in full, flags only.
    proc = launch(2, train_args(tiny_data, "--pipeline-model-parallel-size", "2", "--precision", "nvfp4",
                                "--promote-on-fault", "--save", str(ckpt), "--tensorboard-dir", str(tb),
                                "--log-interval", "2", "--tensorboard-log-interval", "2", iters=6),
                  env={"INJECT_AT": "3", "INJECT_GEMM": module}, script=DRIVER)
    assert re.search(rf"quantized modules with non-finite values: {module} \([a-z.]*, ?[a-z., ]*fprop\.y",
                     proc.stdout)  # listed first
    assert (f"first: {module} fprop.y, made by its quantized forward GEMM (its inputs were finite); "
            "--promote-on-fault: update skipped") in proc.stdout
    assert f"promoted {module} nvfp4 -> fp8 until the end of the run" in proc.stdout
    assert scalars(tb, SKIPPED) == {2: 0, 4: 1, 6: 1}
    loss = scalars(tb, LOSS)
    assert loss[2] == loss[2] and loss[6] == loss[6] and loss[6] < loss[2]  # finite, and learning, after the fault
    fp8 = scalars(tb, tags.FP8_FRACTION)
    assert fp8[2] == 0 and fp8[4] > 0 and fp8[6] == fp8[4]
    saved = read_record(str(ckpt), 6)
    assert saved.precision_plan["modules"] == {module: "fp8"}
    (event,) = saved.stored()["precision_history"]
    assert event["iteration"] == 3 and event["modules"] == {module: "nvfp4 -> fp8"}
    mse = scalars(tb, tags.quant_health("relative mse", "mlp.linear_fc1", "fprop.x"))
    assert sorted(mse) == [2, 4, 6] and all(0 < v < 0.1 for v in mse.values())
    assert set(scalars(tb, tags.quant_health("underflow", "003", "dgrad.dy", per_layer=True))) == {2, 4, 6}


def test_operand_health_counts_clipping_flushing_and_error():
    x = torch.tensor([[0.0, 1e-9, 0.5, 1.0, 2.0, 100.0, float("nan"), -3.0]])
    q = operand_quantizer("fp8", "fprop", "x", RecipeConfig(fp8_recipe="delayed"))
    scale = fp8_scale_from_amax(torch.tensor(4.0), q.element)  # a stale amax of 4: 100 clips to 4
    out = quantize_dequantize(x, q, scale=scale)
    h = summarize(operand_health(x, out, q).tolist())
    valid = torch.isfinite(x)
    assert h["nonfinite"] == 1 and h["amax"] == 100.0
    assert h["saturated"] == 1 / 8 and h["underflow"] == 1 / 8  # 100 -> 4 clipped; 1e-9 -> 0 flushed
    want = ((out - x)[valid] ** 2).sum() / (x[valid] ** 2).sum()
    assert h["relative mse"] == pytest.approx(want.item(), rel=1e-6)


def test_operand_health_of_tensor_parallel_shards_combines_to_the_whole():
    torch.manual_seed(0)
    x = torch.randn(32, 64) * torch.logspace(-12, 2, 64)  # flushes some columns
    q = operand_quantizer("mxfp4", "fprop", "x", RecipeConfig())
    whole = operand_health(x, quantize_dequantize(x, q), q)
    shards = [operand_health(s, quantize_dequantize(s, q), q) for s in x.split(16)]
    assert torch.allclose(combine(*shards), whole, rtol=1e-5)
    assert whole[FIELDS.index("underflow")] > 0 and whole[FIELDS.index("saturated")] > 0


def _table(names, bad_points):
    """A health table with one non-finite element at each (module index, point)."""
    table = np.zeros((len(names), len(POINTS), len(FIELDS)))
    for m, point in bad_points:
        table[m, POINTS.index(point), FIELDS.index("nonfinite")] = 1
    return HealthTable(names, table)


def test_health_table_blames_where_nonfinite_values_entered():
    names = module_names(2)
    forward_after = [(m, p) for m in range(5, 8) for p in ("fprop.x", "fprop.y")]
    backward_all = [(m, p) for m in range(8) for p in ("dgrad.dy", "dgrad.dx")]
    # A NaN entering layer 1's linear_proj input reaches every later forward and every backward.
    # It is named, but not blamed: promoting it would not keep the NaN out (--promote-on-fault leaves it).
    blamed, detail = _table(names, forward_after + backward_all).fault_modules(nonfinite=True)
    assert blamed == [] and detail.startswith(f"quantized modules with non-finite values: {names[5]} (")
    assert detail.endswith(f"first: {names[5]} fprop.x, entered its input from outside the quantized GEMMs (no "
                           f"quantized GEMM made them: nothing to promote)")
    # The same, but made by layer 0's linear_fc2 GEMM from finite inputs: that module is blamed, not its consumer.
    table = _table(names, [(3, "fprop.y"), (4, "fprop.x"), (4, "fprop.y")] + backward_all)
    assert table.origin() == (names[3], "fprop.y")
    blamed, detail = table.fault_modules(True)
    assert blamed == [names[3]] and detail.endswith("made by its quantized forward GEMM (its inputs were finite)")
    assert _table(names, [(6, "dgrad.dx")]).fault_modules(True)[0] == [names[6]]
    assert _table(names, [(6, "wgrad.dy")]).fault_modules(True)[0] == []
    assert _table(names, [(6, "fprop.w")]).fault_modules(True)[0] == []
    # Backward-only: the backward runs in reverse, so the last module in forward order came first.
    assert _table(names, [(0, "wgrad.dy"), (3, "wgrad.dy")]).origin() == (names[3], "wgrad.dy")
    # ... and a dgrad GEMM that made the NaN is told from the modules its dX flowed into.
    assert _table(names, [(6, "dgrad.dx")] + [(m, "dgrad.dy") for m in range(6)]).origin() == (names[6], "dgrad.dx")
    assert _table(names, []).fault_modules(True)[0] == []


def test_a_gemm_that_overflows_is_named_as_the_producer():
    """Finite FP8 operands whose product overflows fp32: the module's own output row says it made the Inf."""
    name = module_names(1)[2]
    state = QuantState()
    state.health = HealthStats()
    x = torch.full((4, 32), 1e20, requires_grad=True)
    w = torch.full((8, 32), 1e20)
    y = quantized_linear(x, w, Precision.uniform("fp8"), RecipeConfig(fp8_recipe="tensorwise"), state)
    assert torch.isinf(y).all()
    rows = {k: summarize(r.tolist()) for k, r in state.health.rows.items()}
    assert rows["fprop.x"]["nonfinite"] == rows["fprop.w"]["nonfinite"] == 0
    assert rows["fprop.y"]["nonfinite"] == y.numel()
    names = module_names(1)
    table = np.zeros((len(names), len(POINTS), len(FIELDS)))
    for key, row in state.health.rows.items():
        table[names.index(name), POINTS.index(key)] = row.numpy()
    assert HealthTable(names, table).origin() == (name, "fprop.y")


def test_promotion_steps_each_pass_up_once():
    name = module_names(1)[2]
    plan = PrecisionPlan.uniform("nvfp4")
    plan, changes = promote(plan, [name])
    assert plan[name] == Precision.uniform("fp8") and changes == {name: (Precision.uniform("nvfp4"), plan[name])}
    assert promote(PrecisionPlan({name: Precision("mxfp4", "fp8")}), [name])[0][name] == Precision("fp8", "bf16")
    plan, _ = promote(plan, [name])
    assert promote(plan, [name]) == (plan, {})  # bf16 is the top


def test_unmeasured_steps_keep_only_nonfinite_flags():
    """Between logged steps a module keeps one max-abs per operand: enough to see where a NaN entered."""
    q = operand_quantizer("nvfp4", "fprop", "x", RecipeConfig())
    x, w = torch.randn(4, 32), torch.randn(8, 32)
    stats = HealthStats()
    stats.reset(full=False)
    bad = x.clone()
    bad[1, 3] = float("nan")
    for t in (x, bad):  # two micro-batches, the second with a NaN
        stats.record("fprop.x", t, quantize_dequantize(t, q), q)
        stats.record("fprop.w", w, quantize_dequantize(w, q), q)
    stats.record("wgrad.x", x, x, q)  # X was checked in fprop: not again
    rows = {k: summarize(r.tolist()) for k, r in stats.rows.items()}
    assert sorted(rows) == ["fprop.w", "fprop.x"]
    assert rows["fprop.x"]["nonfinite"] == 1 and rows["fprop.w"]["nonfinite"] == 0
    assert rows["fprop.w"]["amax"] == w.abs().max().item()
    assert all(r[FIELDS.index("numel")] == 0 for r in stats.rows.values())  # partial rows: no fractions logged


def test_logged_steps_measure_the_first_micro_batch_in_full_and_check_the_rest():
    q = operand_quantizer("nvfp4", "fprop", "x", RecipeConfig())
    first, larger, bad = torch.randn(4, 32), torch.randn(4, 32), torch.randn(4, 32)
    larger[0, 0], bad[2, 5] = 100.0, float("inf")
    want = operand_health(first, quantize_dequantize(first, q), q)
    for later, nonfinite, amax in (((larger,), 0, 100.0), ((bad,), 1, want[FIELDS.index("amax")])):
        stats = HealthStats()
        stats.reset(full=True)
        for t in (first, *later):
            stats.record("fprop.x", t, quantize_dequantize(t, q), q)
        row = stats.rows["fprop.x"]
        assert row[FIELDS.index("numel")] == first.numel()  # fractions are of the measured micro-batch
        assert row[FIELDS.index("err2")] == want[FIELDS.index("err2")]
        assert row[FIELDS.index("nonfinite")] == nonfinite  # a later Inf, as a flag
        assert row[FIELDS.index("amax")] == amax  # a finite later micro-batch raises the amax
