"""bench/gpu_suite.py and what it carries: its CPU mode and plan (steps, budgets, caps), its step runner
(bench/suite_run.py) and report (bench/suite_report.py), the benchmarks' figures it reports side by side
and the conditions both sides ran under, the CUDA test selection and its per-test deadline, and the pinned
wheels (bench/prepare_gpu_wheels.py)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import conditions
import gpu_suite
import prepare_gpu_wheels as wheels
import suite_report
import suite_run
from side_by_side import side_by_side

CUDA_FILES = {"tests/test_triton_qdq.py", "tests/test_fp8_gemm.py", "tests/test_fp8_linear.py",
              "tests/test_quantizers.py", "tests/test_gpu_training.py", "tests/test_snip_probes.py",
              "tests/test_step_speed.py", "tests/test_context_parallel.py"}


def suite(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_suite.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


DEFAULT_STEPS = ["install", "peer_tinyllama", "ours_tinyllama", "peer_llama3_8b_4l", "ours_llama3_8b_4l", "compile",
                 "gemm", "quantize", "tests"]
TINYLLAMA = "--preset tinyllama-1.1b"
LLAMA3_8B_4L = "--preset llama3-8b --num-layers 4 --seq-length 4096"


def listed(stdout: str) -> dict[str, tuple[int | None, int, str]]:
    """The dry run's steps: name -> (budget, cap, command)."""
    found = re.findall(r"^  (\w+) +\((?:budget (\d+) s, )?cap (?:the time left, at most )?(\d+) s\) .*\n +(.*)$",
                       stdout, re.M)
    return {name: (int(budget) if budget else None, int(cap), cmd) for name, budget, cap, cmd in found}


@pytest.mark.integration
def test_without_cuda_the_suite_says_what_it_would_run_within_9_minutes_and_exits_0(tmp_path):
    (tmp_path / "wheels").mkdir()
    dry = ["--dry-run"] if torch.cuda.is_available() else []  # on a GPU only the dry run prints the plan
    proc = suite("--wheels", str(tmp_path / "wheels"), "--out", str(tmp_path / "out"), *dry)
    assert proc.returncode == 0, proc.stderr
    steps = listed(proc.stdout)
    assert list(steps) == DEFAULT_STEPS
    # A fresh GPU machine's start and the suite within 9 minutes; every step but the last (the tests,
    # which take what is left) inside the suite's budget even when each runs to its cap.
    assert gpu_suite.BUDGET_S + gpu_suite.DEVICE_START_S <= 540
    measuring = [(budget, cap) for name, (budget, cap, _) in steps.items() if name != "tests"]
    assert sum(budget for budget, _ in measuring) < gpu_suite.SUITE_S + sum(cap for _, cap in measuring) <= 450
    assert all(budget < cap for budget, cap in measuring)
    assert re.search(r"^budgeted \d+ s of --budget 450 s\b.*every step at its cap: (\d+) s.*the session takes at most "
                     r"540 s", proc.stdout, re.M)
    assert [s.name for s in gpu_suite.plan(None, tmp_path) if s.fill] == ["tests"] and steps["tests"][1] == 150
    assert ("extra steps (--only NAME): tests_all, attention, cp_attention, compile_host, snip_cycle, "
            "snip_cycle_fisher, fp8_step_tinyllama, fp8_step_llama3_8b_4l, health_overhead") in proc.stdout
    # eager and --torch-compile beside the peer at TinyLlama's dims, dynamo's counters (issue 57)
    compile_step = steps["compile"][2]
    assert ("fwd_bwd_side_by_side.py --preset tinyllama-1.1b --num-layers 2 --bf16 --threads "
            f"{conditions.threads_per_process(1)}") in compile_step
    assert "--count --json" in compile_step
    assert f"gpu_suite.py --install {tmp_path / 'wheels'}" in steps["install"][2]
    threads = f"--threads {conditions.threads_per_process(1)}"
    for shape, flags in (("tinyllama", TINYLLAMA), ("llama3_8b_4l", LLAMA3_8B_4L)):
        peer, ours = steps[f"peer_{shape}"][2], steps[f"ours_{shape}"][2]
        # Both sides take the same conditions: shape, batch, threads, dtype, timing.
        same = f"{flags} --micro-batch-size 1 {threads} --iters 5 --warmup 2 --bf16"
        assert "peer_step.py " + same + " --num-microbatches 8" in peer
        assert "step_time.py " + same + " --nproc 1 --tp 1 --pp 1 --global-batch-size 8" in ours
        assert "--compare-precision fp8:tensorwise fp8:rowwise fp8:blockwise" in ours and "--snip-cycle" in ours
        assert ("--snip-time-target 0.85" in ours) == (shape == "llama3_8b_4l")
        assert ours.endswith("--profile ours fp8" + (" snip" if shape == "llama3_8b_4l" else ""))
        assert "--variants eager compiled" in peer and peer.endswith("--profile compiled")
    tests = steps["tests"][2]
    assert "-m pytest -v -m cuda" in tests and all(f in tests for f in CUDA_FILES)
    assert "-p pytest_deadline --test-deadline 60 --durations 15" in tests
    for slow in ("bf16", "nvfp4", "mxfp4"):
        assert f"--deselect 'tests/test_gpu_training.py::test_one_gpu_trains_in_each_precision[{slow}]'" in tests
    assert "[fp8]" not in tests
    assert not (tmp_path / "out").exists(), "nothing runs, nothing is written"
    bad = suite("--wheels", str(tmp_path / "absent"))
    assert bad.returncode == 2 and "--wheels" in bad.stderr and "prepare_gpu_wheels.py" in bad.stderr


@pytest.mark.integration
def test_only_runs_the_steps_named_extras_included_and_trainer_args_reach_every_trainer_command():
    proc = suite("--dry-run", "--only", "snip_cycle", "tests", "ours_tinyllama", "peer_tinyllama",
                 "--trainer-args=--num-workers 0")
    assert proc.returncode == 0, proc.stderr
    steps = listed(proc.stdout)
    assert list(steps) == ["peer_tinyllama", "ours_tinyllama", "tests", "snip_cycle"]  # the plan's order
    for name in ("ours_tinyllama", "snip_cycle"):
        assert steps[name][2].endswith("--num-workers 0"), name
    assert "--num-workers" not in steps["peer_tinyllama"][2]
    assert "snip_cycle.py " + TINYLLAMA in steps["snip_cycle"][2]
    bad = suite("--dry-run", "--only", "step_time")
    assert bad.returncode == 2 and "--only step_time: no such step" in bad.stderr


@pytest.mark.integration
def test_the_cuda_cases_are_selected_by_their_marker():
    assert set(gpu_suite.cuda_test_files()) == CUDA_FILES
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda", "-p",
                           "no:cacheprovider", *sorted(CUDA_FILES)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    selected = proc.stdout
    assert "test_quantizers.py::test_cuda_matches_cpu" in selected
    assert "test_quantizers.py::test_rounding_matches_oracle" not in selected  # unmarked cases stay out
    for case in ("test_triton_qdq.py::test_quantized_linear_with_kernels_equals_reference",
                 "test_fp8_gemm.py::test_scaled_mm_matches_emulated_within_accumulation_order",
                 "test_gpu_training.py::test_one_gpu_trains_in_each_precision[fp8]",
                 "test_gpu_training.py::test_one_gpu_snip_replans_and_trains",
                 "test_snip_probes.py::test_the_fused_noise_kernel_draws_the_references_values"):
        assert case in selected, case


def running(pid: int) -> bool:
    """Whether ``pid`` runs (a killed process may linger as a zombie until its new parent reaps it)."""
    for _ in range(20):
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False
        if state in "ZX":
            return False
        time.sleep(0.1)
    return True


@pytest.mark.integration
def test_steps_that_fail_hang_or_find_no_time_are_recorded_and_the_report_still_written(tmp_path):
    py = sys.executable
    child, result = tmp_path / "child.pid", tmp_path / "hangs.json"
    # A benchmark that hangs with a child in a session of its own (as torchrun starts its workers): at its cap
    # SIGINT lets it write what it has (its handler, set first: a SIGINT before it would end the benchmark with
    # nothing written), then everything of it is killed (the sleep resumes after the handler, PEP 475).
    hang = ("import signal\n"
            f"signal.signal(signal.SIGINT, lambda *_: open({str(result)!r}, 'w').write('{{\"stopped\": true}}'))\n"
            "import subprocess, sys, time\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
            f"open({str(child)!r}, 'w').write(str(p.pid))\n"
            "time.sleep(120)\n")
    steps = [gpu_suite.Step("ok", "prints", [py, "-c", "print('fine')"], 30),
             gpu_suite.Step("broken", "fails", [py, "-c", "import sys; print('boom'); sys.exit(3)"], 30),
             gpu_suite.Step("raises", "raises", [py, "-c", "print('before')\ndef f():\n"
                                                  "    raise ValueError('bad shape')\nf()\n"], 30),
             # Its cap leaves 16 s before the SIGINT (cap - STOP_GRACE_S) for Python to start on a loaded machine.
             gpu_suite.Step("hangs", "sleeps with a child", [py, "-c", hang], 24, result="hangs.json")]
    deadline = time.monotonic() + 60
    start = time.monotonic()
    records = [gpu_suite.run_step(s, tmp_path, deadline, dict(os.environ)) for s in steps]
    assert time.monotonic() - start < 40
    ok, broken, raised, hung = records
    assert (ok.status, ok.returncode, ok.output_tail, ok.error) == ("passed", 0, ["fine"], [])
    assert (broken.status, broken.returncode, broken.output_tail) == ("failed", 3, ["boom"])
    assert raised.status == "failed" and raised.error[0] == suite_run.TRACEBACK
    assert raised.error[-1] == "ValueError: bad shape" and "before" not in raised.error
    assert hung.status == "timeout" and hung.returncode is None and "cap, 24 s" in hung.note
    assert hung.result == {"stopped": True}, "SIGINT first: what a stopped benchmark measured is kept"
    assert not running(int(child.read_text())), "the step's whole process tree is killed"
    late = gpu_suite.run_step(steps[0], tmp_path, time.monotonic() + 8, dict(os.environ))
    assert late.status == "skipped" and "budget" in late.note
    summary = gpu_suite.write_report(tmp_path, {"date": "d", "device": "dev", "command": "c", "budget": 60,
                                                "wall_s": 30.0}, [*records, late])
    for line in ("| ok | passed |", "| broken | failed |", "| raises | failed |", "| hangs | timeout |",
                 "| ok | skipped |", "| suite: steps stopped at their cap | 1.000 | <= 0 | **no** |",
                 "| suite: wall seconds (--budget 60) | 30.000 | <= 60 | yes |"):
        assert line in summary
    report = json.loads((tmp_path / "report.json").read_text())
    assert [s["status"] for s in report["steps"]] == ["passed", "failed", "failed", "timeout", "skipped"]
    md = (tmp_path / "report.md").read_text()
    assert "boom" in md
    assert "First error in its log:\n\n```text\nTraceback (most recent call last):\n" in md
    assert (tmp_path / "logs" / "broken.log").read_text() == "boom\n"


@pytest.mark.integration
def test_report_shows_benchmark_goals_and_test_failures(tmp_path):
    """A real benchmark run (tiny GEMMs, here on CPU) and a real pytest run, as the suite reports them."""
    py = sys.executable
    (tmp_path / "test_sample.py").write_text("def test_good():\n    assert 1\n\n"
                                             "def test_bad():\n    assert 1 == 2, 'one is not two'\n")
    out = tmp_path / "out"
    out.mkdir()
    steps = [
        gpu_suite.Step("gemm", "gemms", [py, str(ROOT / "bench" / "gemm_bench.py"), "--models", "tiny", "--tokens",
                                         "32", "--reps", "1", "--json", str(out / "gemm.json")], 120, "gemm.json"),
        gpu_suite.Step("tests", "pytest", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml",
                                           str(out / "pytest.xml"), str(tmp_path / "test_sample.py")], 120),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    records = [gpu_suite.run_step(s, out, time.monotonic() + 300, env) for s in steps]
    gemm, tests = records
    assert gemm.status == "passed" and tests.status == "failed"
    assert tests.tests["passed"] == 1 and tests.tests["failures"] == 1
    assert "test_bad" in tests.tests["failed"][0] and "one is not two" in tests.tests["failed"][0]
    goals = gemm.result["goals"]
    assert [g["name"] for g in goals] == [f"FP8 GEMM speed-up, tiny {k} (ours)" for k in ("fprop", "dgrad", "wgrad")]
    summary = gpu_suite.write_report(out, {"date": "d", "device": "dev", "command": "c"}, records)
    for g in goals:
        met = "yes" if g["met"] else "**no**"
        assert f"| gemm: {g['name']} | {g['value']:.3f} | >= 1.3 | {met} |" in summary
    md = (out / "report.md").read_text()
    assert "1 passed, 1 failed, 0 skipped" in md and "one is not two" in md


def test_gemm_bench_times_the_same_product_on_every_path():
    """The bf16, raw _scaled_mm and our FP8 GEMM of each kind compute one product (FP8 rounding apart),
    so the speed-ups compare like with like."""
    from gemm_bench import gemm_calls

    gemms = gemm_calls(64, 128, 96, torch.device("cpu"))
    assert set(gemms) == {"fprop", "dgrad", "wgrad"}
    for gemm, calls in gemms.items():
        results = {path: fn().float() for path, fn in calls.items()}
        reference = results.pop("bf16")
        assert results, gemm
        for path, value in results.items():
            assert value.shape == reference.shape, (gemm, path)
            error = (value - reference).norm() / reference.norm()
            assert error < 0.1, (gemm, path, float(error))


def test_step_time_ratios_are_against_the_same_runs_baseline():
    from step_time import summarise

    measured = {"flops_per_iteration": 3e12, "world_size": 1, "peak_tflops": 100.0, "fp8_recipe": "tensorwise",
                "phases": {"plain": {"medians": [0.11, 0.10], "peak_gib": 5.0},
                           "ours": {"medians": [0.102, 0.103], "peak_gib": 5.1},
                           "fp8": {"medians": [0.08], "peak_gib": 4.0},
                           "fp8:blockwise": {"medians": [0.09], "peak_gib": 4.0},
                           "nvfp4": {"medians": [0.2], "peak_gib": 6.0},
                           "snip": {"medians": [0.15], "peak_gib": 5.5}},
                "snip_cycle_seconds": 0.918, "snip_cycle_peak_gib": 6.12,
                "snip_plan": {"fp4": 0.75, "time_ratio": 0.3, "time_target": 0.3, "time_target_given": False}}
    lines, figures = summarise(measured)
    goals = {g["name"]: (round(g["value"], 6), g["met"]) for g in figures["goals"]}
    assert goals == {"trainer step / plain megatron-core step (bf16)": (1.02, True),
                     "SNIP cycle in bf16 iterations": (9.0, True),
                     "SNIP cycle peak memory / bf16 step peak": (1.2, True)}
    assert figures["mfu_bf16"] == pytest.approx(3e12 / 0.102 / 1e12 / 100.0)
    assert figures["fp8_vs_bf16"] == {"tensorwise": pytest.approx(0.08 / 0.102),
                                      "blockwise": pytest.approx(0.09 / 0.102)}
    text = "\n".join(lines)
    assert "assumed peak of 100 TFLOP/s" in text and "ratio to bf16 1.961" in text
    assert "uniform fp8 blockwise    :      90.0 ms/iteration" in text
    assert "9.0 bf16 iterations (goal <= 10), 6.1 iterations of the plan it chose" in text
    assert "snip cycle 6.12" in text and "nvfp4 6.00" in text

    # A --snip-time-target plan: its step against the target, and what it logged against what it measured.
    measured["snip_plan"] = {"fp4": 0.0, "time_ratio": 0.8, "time_target": 0.85, "time_target_given": True}
    measured["phases"]["snip"]["medians"] = [0.0867]
    goals = {g["name"]: (round(g["value"], 6), g["met"]) for g in summarise(measured)[1]["goals"]}
    assert goals["SNIP --snip-time-target 0.85 plan step / bf16 step"] == (0.85, True)
    assert goals["SNIP plan's logged time ratio, relative error against its measured step ratio"] == (
        round(0.05 / 0.85, 6), True)

    # Stopped at the suite's cap (bench/suite_run.py) after the cycle, before the phase under its plan ended:
    # the cycle's figures against bf16, nothing of the plan's step; before the bf16 phases ended: no figures.
    del measured["phases"]["snip"]
    lines, figures = summarise(measured)
    assert "9.0 bf16 iterations (goal <= 10), stopped before the plan it chose was timed" in "\n".join(lines)
    assert [g["name"] for g in figures["goals"] if "SNIP" in g["name"]] == [
        "SNIP cycle in bf16 iterations", "SNIP cycle peak memory / bf16 step peak"]
    lines, figures = summarise({**measured, "phases": {"plain": measured["phases"]["plain"]}})
    assert lines == ["stopped before the bf16 phases (plain, ours) ended: no figures"] and figures["goals"] == []


H200 = {"device": "NVIDIA H200", "processes": 1, "threads_per_process": 16, "dtype": "bf16", "compile": "eager",
        "recompute": "none", "model": "22 layers x 2048, ffn 5632, 32 heads / 4 groups, vocab 2048", "seq_length": 2048,
        "micro_batch_size": 1, "num_microbatches": 8, "flops_per_iteration": 1.1e14}


def test_side_by_side_sets_our_trainer_against_the_peer_at_each_shape():
    peer = {"variants": {"eager": {"seconds": 0.515, "tflops": 221.0, "mfu": 0.223, "conditions": H200},
                         "compiled": {"seconds": 0.338, "tflops": 337.0, "mfu": 0.341,
                                      "conditions": {**H200, "compile": "inductor"}},
                         "float8-tensorwise": {"seconds": 0.522, "tflops": 218.0, "mfu": 0.22},
                         "float8-rowwise": {"skipped": "torchao does not import"}}}
    ours = {"seconds_per_iteration": {"plain": 0.604, "ours": 0.632}, "bf16_tflops_per_device": 180.0,
            "mfu_bf16": 0.182, "fp8_vs_bf16": {"tensorwise": 2.93, "blockwise": 1.1}, "conditions": H200}
    ours_8b = {**ours, "fp8_vs_bf16": {"tensorwise": 0.8}}
    lines, goals = side_by_side({"peer_tinyllama": peer, "ours_tinyllama": ours, "ours_llama3_8b_4l": ours_8b,
                                 "gemm": {"goals": []}})
    assert {g["name"]: (round(g["value"], 4), g["met"]) for g in goals} == {
        "tinyllama: our best fp8 step / our bf16 step": (1.1, True),
        "tinyllama: conditions that differ between our step and the peer's eager step": (0, True),
        "tinyllama: our bf16 step / the peer's compiled step": (round(0.632 / 0.338, 4), False),
        "llama3_8b_4l: our fp8 tensorwise speed-up over our bf16": (1.25, True)}
    profiles = {g["name"]: g.get("profiles") for g in goals}
    assert profiles["tinyllama: our bf16 step / the peer's compiled step"] == ["ours_tinyllama/ours",
                                                                             "peer_tinyllama/compiled"]
    assert profiles["llama3_8b_4l: our fp8 tensorwise speed-up over our bf16"] == ["ours_llama3_8b_4l/fp8",
                                                                                 "ours_llama3_8b_4l/ours"]
    text = "\n".join(lines)
    assert "ours bf16 / peer eager: 1.227 (same conditions)" in text
    assert ("ours bf16 / peer compiled (goal <= 1.1): 1.870 (same conditions, compile: ours eager / peer "
            "inductor)") in text
    assert ("conditions, ours: NVIDIA H200, 1 process(es) x 16 threads, bf16, eager, recompute none, 22 layers x "
            "2048, ffn 5632, 32 heads / 4 groups, vocab 2048, seq 2048, 8 micro-batches of 1, 110 TFLOP per "
            "iteration") in text
    assert "peer torchao float8-tensorwise speed-up over its compiled bf16: 0.648x" in text
    assert "peer float8-rowwise       skipped: torchao does not import" in text
    assert "/ plain loop 1.046" in text and "MFU 0.182" in text
    assert "4 Llama-3-8B layers" in text  # a shape with one of the two results is shown
    assert side_by_side({}) == ([], [])


def test_side_by_side_refuses_a_ratio_whose_sides_ran_under_different_conditions():
    """On a 2-core CPU our workers ran on 1 thread each, the peer on 2: our step looked 1.69x the peer's at equal
    work. Such a ratio is not given: the report names what differs instead."""
    peer = {"variants": {"eager": {"seconds": 25.9, "tflops": 0.1, "mfu": None, "conditions": {
        **H200, "device": "cpu", "threads_per_process": 2}}}}
    ours = {"seconds_per_iteration": {"plain": 43.0, "ours": 43.7}, "bf16_tflops_per_device": 0.1, "mfu_bf16": None,
            "conditions": {**H200, "device": "cpu", "threads_per_process": 1}}
    lines, goals = side_by_side({"peer_tinyllama": peer, "ours_tinyllama": ours})
    text = "\n".join(lines)
    assert ("ours bf16 / peer eager: REFUSED, the two sides ran under different conditions: "
            "threads_per_process: 1 vs 2") in text
    assert "1.687" not in text and "ours bf16 / peer compiled (goal <= 1.1): no peer figure (not run)" in text
    by_name = {g["name"]: g for g in goals}
    differ = by_name["tinyllama: conditions that differ between our step and the peer's eager step"]
    assert (differ["value"], differ["met"], differ["note"]) == (1, False, "threads_per_process: 1 vs 2")
    # A result without its conditions (an older benchmark's) is refused alike.
    del ours["conditions"]
    text = "\n".join(side_by_side({"peer_tinyllama": peer, "ours_tinyllama": ours})[0])
    assert "REFUSED, the two sides ran under different conditions: conditions not recorded by the first side" in text


def test_conditions_differ_field_by_field_except_what_a_comparison_names():
    a = {**H200}
    assert conditions.differences(a, dict(a)) == []
    b = {**H200, "compile": "inductor", "dtype": "fp32", "flops_per_iteration": 1.2e14}
    assert conditions.differences(a, b) == ["dtype: 'bf16' vs 'fp32'", "compile: 'eager' vs 'inductor'",
                                            "flops_per_iteration: 1.1e+14 vs 1.2e+14"]
    assert conditions.differences(a, b, by_design=("compile",)) == ["dtype: 'bf16' vs 'fp32'",
                                                                    "flops_per_iteration: 1.1e+14 vs 1.2e+14"]
    assert conditions.differences(None, None) == ["conditions not recorded by either side"]
    assert conditions.differences(a, {}) == ["conditions not recorded by the second side"]
    assert set(H200) == set(conditions.FIELDS)  # every field of the dataclass, and no other
    # N processes on C cores: C / N threads each (at least 1), unless --threads says
    cores = conditions.cores()
    assert conditions.threads_per_process(1) == cores and conditions.threads_per_process(2 * cores) == 1
    assert conditions.threads_per_process(4, threads=3) == 3
    assert conditions.worker_env(1, env={"OMP_NUM_THREADS": "1"})["OMP_NUM_THREADS"] == str(cores)


def test_tiny_mode_runs_every_flag_of_the_gpu_commands_at_tiny_sizes(tmp_path):
    """--tiny checks on a CPU the commands a GPU run gives: every step's, each with every flag it has there."""
    gpu = gpu_suite.plan(tmp_path / "wheels", tmp_path)
    tiny = gpu_suite.plan(tmp_path / "wheels", tmp_path, tiny=True)
    assert [s.name for s in gpu][1:] == [s.name for s in tiny][1:] and tiny[0].name == "environment"

    def flags(step):
        return {a for a in step.cmd if a.startswith("--")}

    for g, t in zip(gpu[1:], tiny[1:]):
        assert flags(g) <= flags(t), (g.name, flags(g) - flags(t))
        assert (t.cap_s, t.extra, t.fill, t.result) == (g.cap_s * gpu_suite.TINY_CAP_FACTOR, g.extra, g.fill, g.result)
    ours = next(s for s in tiny if s.name == "ours_llama3_8b_4l").cmd
    assert " ".join(gpu_suite.TINY_SHAPE) in " ".join(ours) and "--gemm-speed-model blackwell" in " ".join(ours)


def test_a_missed_goal_is_reported_with_the_profiles_of_what_it_measures(tmp_path):
    table = "wall 1.000 s, host busy 0.900 s\n--- header ---\n" + "\n".join(f"op{i} {100 - i}" for i in range(40))
    ours = {"seconds_per_iteration": {"plain": 0.5, "ours": 0.6}, "bf16_tflops_per_device": 180.0, "mfu_bf16": 0.18,
            "fp8_vs_bf16": {"tensorwise": 2.0}, "conditions": H200,
            "profiles": {"ours": table.replace("op", "ours_op")},
            "goals": [{"name": "trainer step / plain megatron-core step (bf16)", "value": 1.2, "goal": "<= 1.03",
                       "met": False, "profiles": ["ours", "plain"]}]}
    peer = {"variants": {"eager": {"seconds": 0.55, "tflops": 200.0, "mfu": 0.2, "conditions": H200},
                         "compiled": {"seconds": 0.3, "tflops": 300.0, "mfu": 0.3, "conditions": {
                             **H200, "compile": "inductor"}, "profile": table.replace("op", "peer_op")}}}
    records = [suite_run.Record("peer_tinyllama", "peer", [], 50, status="passed", seconds=30.0, result=peer),
               suite_run.Record("ours_tinyllama", "ours", [], 130, status="passed", seconds=90.0, result=ours)]
    suite_report.write_report(tmp_path, {"date": "d", "device": "dev", "command": "c", "budget": 450, "wall_s": 125},
                              records)
    md = (tmp_path / "report.md").read_text()
    missed = md[md.index("## Missed goals: where the time went"):md.index("## peer_tinyllama")]
    sections = {part.split(":")[0] + ":" + part.split(":")[1]: part for part in missed.split("\n### ")[1:]}
    assert list(sections) == ["tinyllama: our best fp8 step / our bf16 step",
                              "tinyllama: our bf16 step / the peer's compiled step",
                              "ours_tinyllama: trainer step / plain megatron-core step (bf16)"]  # met ones left out
    overhead = sections["ours_tinyllama: trainer step / plain megatron-core step (bf16)"]
    assert overhead.startswith("ours_tinyllama: trainer step / plain megatron-core step (bf16): 1.200 (goal <= 1.03)")
    assert "`ours_tinyllama/ours`, top operators:" in overhead and "ours_op0 100" in overhead
    assert "ours_op30" not in overhead, "the table's top rows only"
    assert "`ours_tinyllama/plain`: not profiled" in overhead
    against_peer = sections["tinyllama: our bf16 step / the peer's compiled step"]
    assert "ours_op0 100" in against_peer and "peer_op0 100" in against_peer
    fp8 = sections["tinyllama: our best fp8 step / our bf16 step"]
    assert "`ours_tinyllama/fp8`: not profiled" in fp8 and "ours_op0" in fp8  # ours/ours is there


def test_the_report_is_written_whatever_a_result_holds(tmp_path):
    """A result of an unforeseen shape (a benchmark changed, a stopped one's partial figures) leaves the
    comparison said to have failed, and everything else reported."""
    records = [suite_run.Record("ours_tinyllama", "ours", [], 130, status="passed", seconds=9.0,
                                result={"seconds_per_iteration": {"ours": 0.6}, "goals": []}),
               suite_run.Record("gemm", "gemm", [], 15, status="running")]
    summary = suite_report.write_report(tmp_path, {"date": "d", "device": "dev", "command": "c"}, records)
    assert "the side-by-side comparison failed:" in summary and "KeyError: 'plain'" in summary
    assert "| gemm | running |" in summary
    assert json.loads((tmp_path / "report.json").read_text())["steps"][1]["status"] == "running"


def test_wheels_are_pinned_to_the_cpu_environments_versions(tmp_path):
    setup = (ROOT / "pyproject.toml").read_text()
    requirements = (ROOT / "requirements-cpu.txt").read_text()
    assert f'"megatron-core=={wheels.WHEELS["megatron-core"]}"' in setup
    assert f'megatron-core=={wheels.WHEELS["megatron-core"]}' in requirements
    for name, version in wheels.WHEELS.items():
        assert re.fullmatch(r"\d+(\.\d+)+", version), (name, version)
        assert f"\n{name}=={version}\n" in requirements, f"requirements-cpu.txt must pin {name}=={version}"
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        assert installed == version, f"{name}: CPU environment has {installed}, the GPU wheels pin {version}"
    cmd = wheels.download_command(tmp_path)
    assert {"--no-deps", "--only-binary=:all:"} <= set(cmd) and cmd[cmd.index("--python-version") + 1] == "3.12"
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--platform"] == list(wheels.PLATFORMS)
    assert cmd[-len(wheels.WHEELS):] == [f"{n}=={v}" for n, v in wheels.WHEELS.items()]
    assert wheels.download_command(tmp_path, wheels.OPTIONAL)[-1] == "torchao==0.18.0"


def test_wheel_folder_check_wants_exactly_the_pins_within_the_carry_limit(tmp_path):
    def wheel(name, version, size=1000):
        (tmp_path / f"{wheels.normalise(name)}-{version}-py3-none-any.whl").write_bytes(b"x" * size)

    for name, version in wheels.WHEELS.items():
        wheel(name, version)
    assert wheels.check_folder(tmp_path) == pytest.approx(len(wheels.WHEELS) * 1000 / 2**20)
    wheel("torchao", wheels.OPTIONAL["torchao"])  # optional: welcome, not required
    assert wheels.check_folder(tmp_path) == pytest.approx((len(wheels.WHEELS) + 1) * 1000 / 2**20)
    wheel("pytest", "1.0")
    with pytest.raises(SystemExit, match=r"unpinned \[\('pytest', '1.0'\)\]"):
        wheels.check_folder(tmp_path)
    (tmp_path / "pytest-1.0-py3-none-any.whl").unlink()
    (tmp_path / f"highspy-{wheels.WHEELS['highspy']}-py3-none-any.whl").unlink()
    with pytest.raises(SystemExit, match="missing.*highspy"):
        wheels.check_folder(tmp_path)
    wheel("highspy", wheels.WHEELS["highspy"], size=(wheels.CARRY_LIMIT_MIB + 1) * 2**20)
    with pytest.raises(SystemExit, match="exceeds"):
        wheels.check_folder(tmp_path)


def test_quantize_bench_times_each_formats_own_kernel():
    """Each kernel the quantize benchmark times computes its format's fake_quantize, bit for bit (on CPU in
    Triton's interpreter, conftest.py; compiled on a GPU), stochastic rounding with the reference's draws."""
    pytest.importorskip("triton")
    from quantize_bench import triton_operand_quantizers

    from megatron_snip.numerics import fake_quantize

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(3)).to(device)
    kernels = triton_operand_quantizers(x)
    assert set(kernels) == {"fp8_e4m3", "fp8_e5m2", "fp8_block", "mxfp8", "nvfp4", "mxfp4", "nvfp4_sr", "mxfp4_sr"}
    generator = torch.Generator(device=device).manual_seed(0)  # the bench's seed; its SR kernels draw in turn
    for name, kernel in kernels.items():
        fmt, stochastic = name.removesuffix("_sr"), name.endswith("_sr")
        expected = fake_quantize(x, fmt, stochastic=stochastic, generator=generator if stochastic else None)
        assert torch.equal(kernel(), expected), name


def test_logs_and_results_come_back_in_one_file(tmp_path):
    """The output folder holds three files: the report (.md, .json) and one bundle of every log, every
    benchmark's JSON result and pytest's JUnit file."""
    import tarfile

    raw, out = tmp_path / "raw", tmp_path / "out"
    (raw / "logs").mkdir(parents=True)
    out.mkdir()
    for name in ("tests", "gemm", "ours_tinyllama"):
        (raw / "logs" / f"{name}.log").write_text(f"{name} says hello\n")
    (raw / "pytest.xml").write_text("<testsuite/>")
    (raw / "gemm.json").write_text("{}")
    gpu_suite.bundle(raw, out)
    gpu_suite.bundle(raw, out)  # rewritten after every step
    assert [p.name for p in out.iterdir()] == ["logs.tar.gz"]
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert tar.getnames() == ["gemm.json", "logs/gemm.log", "logs/ours_tinyllama.log", "logs/tests.log",
                                  "pytest.xml"]
        assert tar.extractfile("logs/tests.log").read() == b"tests says hello\n"
    for step in gpu_suite.plan(None, raw):
        assert step.result is None or f"--json {raw / step.result}" in " ".join(step.cmd), step.name
        assert str(out) not in " ".join(step.cmd), step.name


@pytest.mark.integration
def test_a_test_past_its_deadline_fails_and_the_run_goes_on(tmp_path):
    (tmp_path / "test_sample.py").write_text("import time\n\ndef test_hangs():\n    time.sleep(60)\n\n"
                                             "def test_after():\n    assert True\n")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "pytest_deadline",
                           "--test-deadline", "2", "--junitxml", str(tmp_path / "pytest.xml"),
                           str(tmp_path / "test_sample.py")], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT / "bench")})
    assert time.monotonic() - start < 40
    assert proc.returncode == 1, proc.stdout
    summary = suite_run.junit_summary(tmp_path / "pytest.xml")
    assert (summary["passed"], summary["failures"]) == (1, 1)
    assert "test_hangs: Failed: still running after the 2 s per-test deadline" in summary["failed"][0]
    assert summary["slowest"][0][0].endswith("test_hangs") and 2 <= summary["slowest"][0][1] < 10
