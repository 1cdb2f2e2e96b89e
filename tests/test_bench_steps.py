"""A few CPU steps of the step-time benchmarks (bench/step_time.py, bench/fp8_step.py): their figures are
GPU work (docs/benchmarks.md), so here they run end to end at the tiny preset on one process and write
what they promise, each ratio from the phases of the same run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT

LAYOUT = ["--nproc", "1", "--tp", "1", "--pp", "1", "--micro-batch-size", "1", "--global-batch-size", "2",
          "--iters", "3", "--warmup", "1"]


@pytest.fixture(scope="module")
def bench_data(tmp_path_factory):
    return tmp_path_factory.mktemp("bench_data")  # built by the first script, reused by the second


def bench(script: str, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), *LAYOUT, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.integration
def test_step_time_times_plain_ours_and_fp8_in_one_run(bench_data, tmp_path):
    proc = bench("step_time.py", "--repeats", "1", "--compare-precision", "fp8", "--data-dir", str(bench_data),
                 "--json", str(tmp_path / "out.json"))
    out = json.loads((tmp_path / "out.json").read_text())
    seconds = out["seconds_per_iteration"]
    assert set(seconds) == {"plain", "ours", "fp8"} and all(s > 0 for s in seconds.values())
    assert out["fp8_vs_bf16"] == {"tensorwise": pytest.approx(seconds["fp8"] / seconds["ours"])}
    (ratio,) = [g for g in out["goals"] if g["name"] == "trainer step / plain megatron-core step (bf16)"]
    assert ratio["value"] == pytest.approx(seconds["ours"] / seconds["plain"])
    assert f"ratio ours / plain       :     {ratio['value']:.3f}" in proc.stdout


@pytest.mark.integration
def test_fp8_step_times_each_recipe_and_checks_the_speed_tables_prediction(bench_data, tmp_path):
    proc = bench("fp8_step.py", "--recipes", "tensorwise", "rowwise", "--data-dir", str(bench_data),
                 "--json", str(tmp_path / "out.json"))
    out = json.loads((tmp_path / "out.json").read_text())
    phases = out["measured"]["phases"]
    assert set(phases) == {"bf16", "fp8-tensorwise", "fp8-rowwise"}
    assert out["bf16_ms"] == pytest.approx(phases["bf16"] * 1e3)
    for recipe, row in out["recipes"].items():
        gemm = out["measured"]["recipes"][recipe]  # the table's GEMM seconds per step, bf16 and this recipe
        assert row["vs_bf16"] == pytest.approx(phases[f"fp8-{recipe}"] / phases["bf16"])
        assert row["predicted_ms"] == pytest.approx((phases["bf16"] - gemm["bf16"] + gemm["fp8"]) * 1e3)
        assert f"our fp8 ({recipe}) step: {row['ms']:.1f} ms" in proc.stdout
    assert "speed table: measured on CPU" in proc.stdout
