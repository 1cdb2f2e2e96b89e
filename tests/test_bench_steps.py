"""A few CPU steps of the step-time benchmarks (bench/step_time.py, bench/fp8_step.py, bench/peer_step.py and
their side by side, bench/side_by_side.py; bench/fwd_bwd_side_by_side.py and bench/optimizer_step.py): their
figures are GPU work (docs/benchmarks.md), so here they run end to end at small shapes on one process and write
what they promise, each ratio from phases measured under the same conditions."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))

LAYOUT = ["--nproc", "1", "--tp", "1", "--pp", "1", "--micro-batch-size", "1", "--global-batch-size", "2",
          "--iters", "3", "--warmup", "1"]
# The same work on both sides of the side by side: one layer wide enough that the GEMMs, not the host, take the
# time (at the tiny preset's width our host overhead would dominate), fp32, 4 micro-batches of 64 tokens.
EQUAL_WORK = ["--preset", "tiny", "--num-layers", "1", "--hidden-size", "1024", "--ffn-hidden-size", "2816",
              "--num-attention-heads", "8", "--num-query-groups", "4", "--seq-length", "64", "--num-microbatches", "4"]


@pytest.fixture(scope="module")
def bench_data(tmp_path_factory):
    return tmp_path_factory.mktemp("bench_data")  # built by the first script, reused by the others


def bench(script: str, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def side_by_side(bench_data, tmp_path_factory):
    """The side by side on this CPU, one thread per side (pytest runs beside other tests: more threads than
    cores would time the scheduler), our side also timing fp8: (its stdout, its JSON)."""
    out = tmp_path_factory.mktemp("side_by_side") / "out.json"
    proc = bench("side_by_side.py", *EQUAL_WORK, "--threads", "1", "--iters", "4", "--warmup", "1",
                 "--data-dir", str(bench_data), "--json", str(out), "--compare-precision", "fp8")
    return proc.stdout, json.loads(out.read_text())


@pytest.mark.integration
def test_side_by_side_at_equal_work_under_equal_conditions_is_near_parity(side_by_side):
    """Both sides ran with the threads asked for (measured inside each process), the same shape, batch, dtype
    and FLOPs, so the ratio is the two programs' (on this 2-core CPU ~0.95-1.0 when idle: the notes' 0.99 at
    TinyLlama's width); a thread count that differs, which once made ours look 1.69x the peer's, is refused.
    The sides run one after the other while other tests share the cores, which stretches the wall time of
    each by what they take in its turn: the band is checked on the process CPU time each side spent."""
    from conditions import FIELDS

    stdout, result = side_by_side
    peer, ours = result["peer"], result["ours"]
    (eager,) = peer["variants"].values()  # the CPU run times the peer eager only
    assert eager["conditions"] == ours["conditions"] and set(ours["conditions"]) == set(FIELDS)
    assert ours["conditions"]["threads_per_process"] == 1 and ours["conditions"]["processes"] == 1
    assert (ours["conditions"]["dtype"], ours["conditions"]["compile"]) == ("fp32", "eager")
    assert ours["conditions"]["flops_per_iteration"] == peer["flops_per_iteration"]
    assert len(eager["losses"]) == 4 and all(v > 0 for v in ours["seconds_per_iteration"].values())
    ratio = ours["seconds_per_iteration"]["ours"] / eager["seconds"]
    cpu_ratio = ours["cpu_seconds_per_iteration"]["ours"] / eager["cpu_seconds"]
    assert 0.5 <= cpu_ratio <= 2.0, f"ours / peer at equal work, process CPU time: {cpu_ratio:.3f}\n{stdout}"
    assert f"ours fp32 / peer eager: {ratio:.3f} (same conditions); in process CPU time {cpu_ratio:.3f}" in stdout
    (differ,) = [g for g in result["goals"] if g["name"].startswith("run: conditions that differ")]
    assert (differ["value"], differ["met"]) == (0, True)


@pytest.mark.integration
def test_step_time_times_plain_ours_and_fp8_in_one_run(side_by_side):
    stdout, result = side_by_side
    out = result["ours"]
    seconds = out["seconds_per_iteration"]
    assert set(seconds) == {"plain", "ours", "fp8"} and all(s > 0 for s in seconds.values())
    assert out["fp8_vs_bf16"] == {"tensorwise": pytest.approx(seconds["fp8"] / seconds["ours"])}
    (ratio,) = [g for g in out["goals"] if g["name"] == "trainer step / plain megatron-core step (bf16)"]
    assert ratio["value"] == pytest.approx(seconds["ours"] / seconds["plain"])
    assert f"/ plain loop {ratio['value']:.3f}" in stdout


@pytest.mark.integration
def test_fp8_step_times_each_recipe_and_checks_the_speed_tables_prediction(bench_data, tmp_path):
    proc = bench("fp8_step.py", *LAYOUT, "--recipes", "tensorwise", "rowwise", "--data-dir", str(bench_data),
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
    from conditions import threads_per_process

    assert out["conditions"]["threads_per_process"] == threads_per_process(1)  # one process: every core


@pytest.mark.integration
def test_fwd_bwd_side_by_side_times_both_modes_and_reads_dynamos_counters(tmp_path):
    """bench/fwd_bwd_side_by_side.py (issue 57): our model's forward+backward and the peer's in one process, eager
    and compiled (aot_eager here), the ratios per round, dynamo's counters for our layers, and its goals."""
    out = tmp_path / "fwd_bwd.json"
    proc = bench("fwd_bwd_side_by_side.py", "--num-layers", "2", "--runs", "2", "--warmup", "1", "--repeats", "2",
                 "--threads", "1", "--backend", "aot_eager", "--count", "--json", str(out))
    result = json.loads(out.read_text())
    assert set(result["figures"]) == {"eager", "compiled"}
    for mode in ("eager", "compiled"):
        assert len(result["figures"][mode]["wall"]["ratios"]) == 2
    counters = result["figures"]["compiled"]["counters"]
    assert counters["frames_given_up"] == counters["graph_breaks"] == counters["recompiles"] == 0
    goals = {g["name"]: g for g in result["goals"]}
    assert any("compile pays" in name for name in goals) and goals["our compiled layers: graph breaks"]["met"]
    assert "ours / peer" in proc.stdout and "torch-function calls ours" in proc.stdout


@pytest.mark.integration
def test_optimizer_step_bench_sets_our_step_against_torchs():
    """bench/optimizer_step.py (issue 57): our optimizer step against fused AdamW + foreach clipping per layout,
    megatron-core's loops beside it, the distributed optimizer's parameter all-gather timed apart."""
    proc = bench("optimizer_step.py", "--preset", "tiny", "--num-layers", "2", "--runs", "2", "--repeats", "1",
                 "--threads", "1", "--layouts", "fp32", "distributed", "--loops")
    lines = [line.strip() for line in proc.stdout.splitlines() if "ours / torch" in line]
    assert [line.split()[0] for line in lines] == ["fp32", "distributed"]
    assert all("megatron-core's loops" in line for line in lines) and "parameter all-gather" in lines[1]


@pytest.mark.integration
def test_snip_cycle_in_process_time_sets_the_cycle_against_an_iteration(bench_data):
    """bench/snip_cycle.py --process-time (issue 56's cycle cost): one one-process run, the median cycle and training
    iteration in process CPU time, their ratio, the peak RSS."""
    proc = bench("snip_cycle.py", "--process-time", "--nproc", "1", "--tp", "1", "--pp", "1", "--num-layers", "1",
                 "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--interval", "2",
                 "--threads", "1", "--data-dir", str(bench_data))
    iteration = float(re.search(r"training iteration :\s+([\d.]+) s", proc.stdout)[1])
    cycle, ratio = (float(x) for x in re.search(r"SNIP cycle\s+:\s+([\d.]+) s\s+cycle / iteration =\s+([\d.]+)",
                                                  proc.stdout).groups())
    assert iteration > 0 and cycle > 0 and ratio == pytest.approx(cycle / iteration, rel=0.2)
    assert re.search(r"peak RSS\s+: \d+ MiB after training, \d+ MiB after the cycles", proc.stdout)
