"""Everything of the GPU path, checked and timed in one command on a CUDA machine: at most 9 minutes on a
freshly started GPU machine, its start included.

    python bench/prepare_gpu_wheels.py             # with network: the wheels a machine without it lacks
    python bench/gpu_suite.py --wheels .gpu_wheels --out DIR           # on the GPU machine: everything
    python bench/gpu_suite.py --out DIR --only ours_tinyllama tests    # a subset (names from --dry-run)
    python bench/gpu_suite.py --dry-run            # the steps, their budgets and caps, their commands
    python bench/gpu_suite.py --tiny --out DIR     # every step's command at tiny sizes, on this machine (CPU)

Steps, each a subprocess with its own time cap (bench/suite_run.py: a hung or failing step costs its
cap, not the report; what a stopped benchmark measured is kept), all inside ``--budget`` seconds;
each step's budget is what it should take on an H100/H200, and the caps of all but the last step add
up to less than the budget, so that every step gets its turn even when each runs to its cap
(``--dry-run`` prints budgets, caps and their sums):

1. install: the wheels of ``--wheels`` (megatron-core, highspy, gurobipy, psutil, pytest, and
   torchao when present) with ``pip install --no-index``, then the GPU, driver, versions and what
   imports (without ``--wheels``: the environment alone);
2. at each of the two SHAPES (TinyLlama-1.1B; four Llama-3-8B layers at sequence 4096), 8
   micro-batches of 1 per iteration, bf16, under one definition of the run's conditions that both
   sides take (bench/side_by_side.py's Run: the same threads, batch, dtype, timing): ``peer_SHAPE``,
   bench/peer_step.py (a plain-PyTorch Llama as torchtitan writes it: eager, compiled per block, at
   the 8B shape also torchao float8 tensorwise; its compiled step profiled), then ``ours_SHAPE``,
   bench/step_time.py (our trainer and the plain megatron-core loop in bf16, our FP8 under each
   recipe, a SNIP cycle: at TinyLlama its cost and memory, at the 8B shape a ``--snip-time-target
   0.85`` plan; the bf16 and fp8 steps, and the plan's at the 8B shape, profiled); the report sets
   them side by side, refusing a ratio whose two sides ran under different conditions;
3. compile: our model's forward+backward eager and under ``--torch-compile`` beside the peer's eager and
   compiled blocks (bench/fwd_bwd_side_by_side.py, TinyLlama's dims at 2 layers), dynamo's counters for
   our layers, and whether compile pays for us (the rule of ``--torch-compile``'s default);
4. gemm, quantize: FP8 ``_scaled_mm`` vs bf16 GEMMs; the fused quantize kernels;
5. tests, last, in the time the others leave (at most its cap): pytest on the cases marked ``cuda``
   (Triton kernels, FP8 GEMMs, the quantized linear, SNIP's noise kernel, one-GPU training in FP8
   and with SNIP), each under a per-test deadline; SLOW_CUDA_TESTS, each with its reason, are left
   to the extra ``tests_all`` step.

``--only`` also runs the EXTRA steps (every cuda test, the attention comparison, compile at negligible
compute (the host's cost), the full trainer's SNIP cycle, the FP8 step per recipe against the speed
table, quantization health's cost).
``--trainer-args`` appends flags to every command that runs our trainer (a compile switch, say).
``report.md`` and ``report.json`` under ``--out`` are rewritten after every step
(bench/suite_report.py: where a goal is missed, the profiles of what it measures); every step's log,
the benchmarks' JSON results and pytest's JUnit file go into ``logs.tar.gz`` beside them. Without
CUDA the suite prints what it would run and exits 0; ``--tiny`` runs every step there instead, at
tiny sizes (each command's flags as on a GPU; the tests step only collects), to check the commands,
the results and the report end to end before a GPU's minutes are spent.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import conditions
from prepare_gpu_wheels import OPTIONAL, TOP_LEVEL, WHEELS, check_folder
from side_by_side import SHAPES, Run
from suite_report import bundle, write_report
from suite_run import Record, Step, adopt_orphans, run_step

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
sys.path.insert(1, str(ROOT))  # megatron_snip, where it is not installed (a GPU machine's checkout)

CUDA_MARK = "pytest.mark.cuda"
CALL_S = 540  # a freshly started GPU machine's session: its start and the suite, 9 minutes
DEVICE_START_S = 90  # that machine's start before the suite runs (a minute or more; estimated)
BUDGET_S = CALL_S - DEVICE_START_S  # the suite's own wall time
SUITE_S = 20  # the suite's own work beside its steps: its start (torch's import), the reports, the bundle
TEST_DEADLINE_S = 60  # per test (bench/pytest_deadline.py): the longest, a one-GPU training launch, takes ~25 s
TINY_CAP_FACTOR = 6  # --tiny: caps and budget this many times the GPU run's (a loaded 2-core CPU)
# Left out of the default run, each with its reason; the EXTRA tests step runs them.
SLOW_CUDA_TESTS = {
    "tests/test_gpu_training.py::test_one_gpu_trains_in_each_precision[bf16]":
        "bf16 training on the GPU is what the ours_* steps run",
    "tests/test_gpu_training.py::test_one_gpu_trains_in_each_precision[mxfp4]":
        "its path is nvfp4's with another quantizer, which the kernel tests check",
    "tests/test_gpu_training.py::test_one_gpu_trains_in_each_precision[nvfp4]":
        "the SNIP case trains NVFP4 modules on the GPU too (its plan puts half the FLOPs in NVFP4)",
}
# Flags every command of our trainer gets (bench/step_time.py passes what it does not know to
# pretrain_llama.py); --trainer-args adds more for one run.
TRAINER_FLAGS: list[str] = []
ONE_GPU = ["--nproc", "1", "--tp", "1", "--pp", "1", "--bf16", "--micro-batch-size", "1", "--global-batch-size", "8"]
SNIP_TIME_TARGET = "0.85"  # issue 45's target at the 8B shape
# --tiny: one small shape for both SHAPES' steps (their flags otherwise as on a GPU), and fewer iterations.
TINY_SHAPE = ("--preset", "tiny", "--num-layers", "2", "--seq-length", "64")
# The compile step's shape: TinyLlama's layers, two of them, at its sequence (compute-dominated; issue 57).
COMPILE_SHAPE = ("--preset", "tinyllama-1.1b", "--num-layers", "2")
COMPILE_LABEL = "TinyLlama-1.1B's dims, 2 layers, sequence 2048"


def cuda_test_files(tests: Path = ROOT / "tests") -> list[str]:
    """Test files with cases marked ``cuda`` (only these are collected: others may import what the GPU lacks)."""
    return sorted(str(p.relative_to(ROOT)) for p in tests.glob("test_*.py") if CUDA_MARK in p.read_text())


def fp8_recipes() -> list[str]:
    """Our FP8 recipes the ours_* steps time: tensorwise, rowwise where it exists, blockwise."""
    from megatron_snip.numerics.registry import FP8_RECIPE_SCHEMES

    return [r for r in ("tensorwise", "rowwise", "blockwise") if r in FP8_RECIPE_SCHEMES]


def plan(wheels: Path | None, raw: Path, trainer_args: list[str] = (), tiny: bool = False) -> list[Step]:
    """The steps, in order (a new step: one more entry); benchmarks write their results and pytest its
    JUnit file into ``raw``. ``trainer_args``: appended to every command of our trainer. ``tiny``: the same
    commands at tiny sizes, for a CPU (see the module's docstring)."""
    py = sys.executable
    bench = str(BENCH)
    data = ["--data-dir", str(raw / "data")]  # built by the first trainer step, reused by the others
    ours = [*ONE_GPU, *data]
    trainer = [*TRAINER_FLAGS, *trainer_args]
    tinyllama, llama8 = SHAPES
    shape_flags = {s.name: TINY_SHAPE if tiny else s.flags for s in SHAPES}
    fp8 = [f"fp8:{r}" for r in fp8_recipes()]
    iters = ["--iters", "3", "--warmup", "1"] if tiny else ["--iters", "5", "--warmup", "2"]
    pytest = [py, "-m", "pytest", "-v", "-m", "cuda", "-p", "no:cacheprovider", "-rfE", "-p", "pytest_deadline",
              "--test-deadline", str(TEST_DEADLINE_S), "--durations", "15", "--junitxml", str(raw / "pytest.xml"),
              *(["--collect-only", "-q"] if tiny else [])]
    steps = [Step("install", "install the wheels (+ torchao if there); GPU, driver, versions, what imports",
                  [py, __file__, "--install", str(wheels)], 35, budget_s=25) if wheels is not None and not tiny else
             Step("environment", "GPU, driver and package versions, what imports", [py, __file__, "--environment"],
                  35, budget_s=20)]
    # (peer variants, peer budget and cap, ours budget and cap) per shape: on the 8B layers torchao's float8
    # too, where FP8 pays (the H200's 2026-11-25 figures: 304 vs 366 ms compiled); the profiles for the report.
    for shape, variants, (peer_budget, peer_cap, ours_budget, ours_cap), profiles in (
            (tinyllama, ("eager", "compiled"), (35, 45, 105, 115), ("ours", "fp8")),
            (llama8, ("eager", "compiled", "float8-tensorwise"), (45, 50, 95, 110), ("ours", "fp8", "snip"))):
        run = Run(shape_flags[shape.name], micro_batch_size=1, num_microbatches=2 if tiny else 8, bf16=True,
                  iters=int(iters[1]), warmup=int(iters[3]))
        steps.append(Step(f"peer_{shape.name}", f"the plain-PyTorch peer, {shape.label}: {', '.join(variants)}",
                          run.peer(raw / f"peer_{shape.name}.json", "--variants", *variants, "--profile", "compiled",
                                   *(["--backend", "aot_eager"] if tiny else [])),
                          peer_cap, f"peer_{shape.name}.json", peer_budget))
        snip = ["--snip-time-target", SNIP_TIME_TARGET] if shape is llama8 else []
        if snip and tiny:  # a CPU emulates FP8 and FP4: the target is planned for a GPU's speeds instead
            snip += ["--gemm-speed-model", "blackwell"]
        steps.append(Step(f"ours_{shape.name}", f"our trainer, {shape.label}: bf16 vs the plain megatron-core loop, "
                          f"FP8 {', '.join(fp8_recipes())}, a SNIP cycle" + (
                              f" with --snip-time-target {SNIP_TIME_TARGET}" if snip else " (its cost and memory)"),
                          run.ours(raw / f"ours_{shape.name}.json", *data, "--repeats", "1" if tiny else "2",
                                   "--compare-precision", *fp8, "--snip-cycle", *snip, "--profile", *profiles,
                                   *trainer),
                          ours_cap, f"ours_{shape.name}.json", ours_budget))
    threads = ["--threads", str(conditions.threads_per_process(1))]
    steps += [
        Step("compile", f"--torch-compile: our forward+backward eager and compiled beside the peer's, {COMPILE_LABEL}, "
             "bf16; dynamo's counters; whether compile pays",
             [py, f"{bench}/fwd_bwd_side_by_side.py", *(TINY_SHAPE if tiny else COMPILE_SHAPE), "--bf16", *threads,
              *(["--runs", "2", "--warmup", "1", "--repeats", "1", "--backend", "aot_eager"] if tiny else
                ["--runs", "10", "--warmup", "3", "--repeats", "2"]), "--count", "--json", str(raw / "compile.json")],
             50, "compile.json", 40),
        Step("gemm", "FP8 _scaled_mm vs bf16 matmul, Llama-3-8B/70B linear shapes",
             [py, f"{bench}/gemm_bench.py", *(["--models", "tiny", "--tokens", "64", "--reps", "1"] if tiny else []),
              "--json", str(raw / "gemm.json")], 12, "gemm.json", 8),
        Step("quantize", "fused quantize-dequantize kernels vs a copy of the same bytes",
             [py, f"{bench}/quantize_bench.py", "--size", "256" if tiny else "8192", "--reps", "1" if tiny else "20",
              "--json", str(raw / "quantize.json")], 12, "quantize.json", 8),  # its 8 kernels compile on first use
        Step("tests", "pytest -m cuda: kernels, FP8 GEMMs, quantized linear, SNIP noise, one-GPU training (fp8, SNIP), "
             f"{TEST_DEADLINE_S} s per test, in the time the measurements leave",
             [*pytest, *(a for t in SLOW_CUDA_TESTS for a in ("--deselect", t)), *cuda_test_files()], 150,
             fill=True),
        # Extras: only with --only.
        Step("tests_all", "pytest -m cuda, every case", [*pytest, *cuda_test_files()], 300, extra=True),
        Step("attention", f"core attention, SDPA vs DotProductAttention, alone and in the step ({tinyllama.label})",
             [py, f"{bench}/step_time.py", *shape_flags["tinyllama"], *ours, "--iters", "6", "--warmup", "2",
              "--compare-attention", "256" if tiny else "2048", "--json", str(raw / "attention.json"), *trainer], 120,
             "attention.json", extra=True),
        Step("cp_attention", "context parallelism's chunked attention (CP 2 layout) vs plain causal SDPA, "
             "sequence 8192, Llama-3-8B heads, bf16",
             [py, f"{bench}/cp_attention.py", *(["--seq-length", "256", "--reps", "2"] if tiny else []), "--json",
              str(raw / "cp_attention.json")], 60, "cp_attention.json", extra=True),
        Step("compile_host", "--torch-compile at negligible compute (22 layers x 64, sequence 32): the host's cost, "
             "ours against the peer's, eager and compiled",
             [py, f"{bench}/fwd_bwd_side_by_side.py", *(["--num-layers", "2"] if tiny else []), "--bf16", *threads,
              *(["--runs", "2", "--warmup", "1", "--repeats", "1", "--backend", "aot_eager"] if tiny else []),
              "--count", "--json", str(raw / "compile_host.json")], 90, "compile_host.json", extra=True),
        Step("snip_cycle", f"one SNIP cycle of the full trainer, {tinyllama.label}, as a share of 1000 iterations",
             [py, f"{bench}/snip_cycle.py", *shape_flags["tinyllama"], *ONE_GPU, *data, "--interval", "5", *trainer],
             120, extra=True),
        Step("snip_cycle_fisher", "the same cycle with --snip-curvature fisher (no Hutchinson passes)",
             [py, f"{bench}/snip_cycle.py", *shape_flags["tinyllama"], *ONE_GPU, *data, "--interval", "5",
              "--curvature", "fisher", *trainer], 120, extra=True),
    ]
    # Issue 45's FP8 step per recipe against our bf16 step, the measured speed table and the step it
    # predicts, at both shapes; and quantization health's cost on logged steps (--only: the ours_* steps
    # already time every FP8 recipe, these add the table's prediction and the health figure).
    for shape in SHAPES:
        steps.append(Step(f"fp8_step_{shape.name}", f"our fp8 step per recipe vs bf16 and the measured speed table's "
                          f"prediction, {shape.label}", [
                              py, f"{bench}/fp8_step.py", *shape_flags[shape.name], *ONE_GPU, *iters,
                              "--recipes", *fp8_recipes(), "--json", str(raw / f"fp8_step_{shape.name}.json"),
                              *trainer], 180, f"fp8_step_{shape.name}.json", extra=True))
    steps.append(Step("health_overhead", f"--quant-health on vs off in fp8 on logged steps, {tinyllama.label}",
                      [py, f"{bench}/step_time.py", *shape_flags["tinyllama"], *ours, "--iters", "10", "--warmup", "2",
                       "--repeats", "2", "--health-overhead", "fp8", "--json", str(raw / "health_overhead.json"),
                       *trainer], 150, "health_overhead.json", extra=True))
    if tiny:
        for step in steps:
            step.cap_s *= TINY_CAP_FACTOR
            step.budget_s = None if step.budget_s is None else step.budget_s * TINY_CAP_FACTOR
    return steps


def worst_case(steps: list[Step]) -> float:
    """Seconds the suite takes when every step but the fill step runs to its cap, its own work included
    (the fill step takes what is left of --budget)."""
    return SUITE_S + sum(s.cap_s for s in steps if not s.fill)


def pip_install(wheels: Path, *args: str) -> int:
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(wheels),
           "--disable-pip-version-check", *args]
    print("$", " ".join(cmd), flush=True)
    return subprocess.run(cmd).returncode


def install(wheels: Path) -> int:
    """The install step: the top-level pins, their dependencies from the machine or the folder. Should pip
    find a dependency neither has, the pins go in without dependencies, with those pinned ones the
    machine lacks, and what then fails to import shows in the environment printed after. The OPTIONAL
    wheels go in without dependencies when the folder has them; their failure fails nothing."""
    code = pip_install(wheels, *(f"{n}=={v}" for n, v in TOP_LEVEL.items()))
    if code:
        import importlib.metadata

        def missing(name: str) -> bool:
            try:
                importlib.metadata.version(name)
                return False
            except importlib.metadata.PackageNotFoundError:
                return True

        lacking = [f"{n}=={v}" for n, v in WHEELS.items() if n in TOP_LEVEL or missing(n)]
        print("[gpu_suite] dependency resolution failed: installing the pins without their dependencies", flush=True)
        code = pip_install(wheels, "--no-deps", *lacking)
    for name, version in OPTIONAL.items():
        if not any(wheels.glob(f"{name}-{version}-*.whl")):
            print(f"[gpu_suite] optional {name}=={version}: no wheel in {wheels}; what needs it is skipped")
        elif pip_install(wheels, "--no-deps", f"{name}=={version}"):
            print(f"[gpu_suite] optional {name}=={version} did not install; what needs it is skipped")
    # In a fresh interpreter: this one imported nothing of what was just installed, but may have cached metadata.
    return code or subprocess.run([sys.executable, __file__, "--environment"]).returncode


def print_environment() -> None:
    import importlib
    import platform

    import torch

    print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda)
    if torch.cuda.is_available():
        print("device", torch.cuda.get_device_name(), "| capability", torch.cuda.get_device_capability(),
              f"| memory {torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB")
    for name in ("triton", "megatron.core", "highspy", "gurobipy", "psutil", "pytest", "torchao", "sentencepiece",
                 "tensorboard", "transformers", "apex", "transformer_engine"):
        try:
            print(f"{name}: {getattr(importlib.import_module(name), '__version__', 'imports')}")
        except Exception as e:
            print(f"{name}: not importable ({type(e).__name__}: {e})")
    try:
        print(subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout)
    except (OSError, subprocess.TimeoutExpired) as e:
        print("nvidia-smi:", e)


def select(steps: list[Step], only: list[str] | None) -> list[Step]:
    """The default steps, or those ``only`` names (extras included), in the plan's order."""
    if not only:
        return [s for s in steps if not s.extra]
    return [s for s in steps if s.name in only]


def print_plan(steps: list[Step], budget: float) -> None:
    width = max(len(s.name) for s in steps)
    for s in steps:
        planned = "" if s.budget_s is None else f"budget {s.budget_s:.0f} s, "
        cap = "the time left, at most " if s.fill else ""
        print(f"  {s.name:<{width}} ({planned}cap {cap}{s.cap_s:.0f} s) {s.what}\n      {shlex.join(s.cmd)}")
    planned = sum(s.budget_s or s.cap_s for s in steps if not s.fill)
    print(f"budgeted {planned:.0f} s of --budget {budget:.0f} s (a step without a budget counts its cap); every "
          f"step at its cap: {worst_case(steps):.0f} s with the suite's own {SUITE_S} s (the last step takes what "
          f"is left); with a fresh machine's start ({DEVICE_START_S} s) the session takes at most "
          f"{budget + DEVICE_START_S:.0f} s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--wheels", type=Path, help="folder of wheels to install first (bench/prepare_gpu_wheels.py)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "runs" / "gpu_suite")),
                   help="report folder (default $OUT, else runs/gpu_suite)")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds for the whole suite (default {BUDGET_S}: with a fresh machine's start, "
                        f"{CALL_S} s; --tiny: {TINY_CAP_FACTOR}x that)")
    p.add_argument("--only", nargs="+", metavar="STEP", help="run only these steps (names as --dry-run lists them; "
                                                             "the extra steps too)")
    p.add_argument("--trainer-args", default="", help="flags appended to every command of our trainer, one string "
                                                      "(e.g. --trainer-args='--num-workers 0')")
    p.add_argument("--dry-run", action="store_true", help="print the steps and exit")
    p.add_argument("--tiny", action="store_true", help="run every step at tiny sizes on this machine (no CUDA "
                                                       "needed): the commands, results and report end to end")
    p.add_argument("--environment", action="store_true", help=argparse.SUPPRESS)  # the environment step
    p.add_argument("--install", type=Path, help=argparse.SUPPRESS)  # the install step
    args = p.parse_args()
    if args.environment:
        print_environment()
        return 0
    if args.install:
        return install(args.install)
    wheels = args.wheels.resolve() if args.wheels else None
    if wheels is not None and not wheels.is_dir():
        p.error(f"--wheels {args.wheels}: no such folder; run python bench/prepare_gpu_wheels.py first")
    budget = args.budget or BUDGET_S * (TINY_CAP_FACTOR if args.tiny else 1)
    out = args.out.resolve()
    import torch

    run = not args.dry_run and (args.tiny or torch.cuda.is_available())
    # logs and results, bundled into out/logs.tar.gz
    raw = Path(tempfile.mkdtemp(prefix="gpu_suite_")) if run else Path(tempfile.gettempdir()) / "gpu_suite_RUN"
    steps = plan(wheels, raw, shlex.split(args.trainer_args), tiny=args.tiny)
    if args.only:
        unknown = set(args.only) - {s.name for s in steps}
        if unknown:
            p.error(f"--only {' '.join(sorted(unknown))}: no such step; steps: {', '.join(s.name for s in steps)}")
    steps = select(steps, args.only)
    if not run:
        print("no CUDA device: nothing run. On a GPU this suite runs:" if not args.dry_run else "steps:")
        print_plan(steps, budget)
        if not args.only:
            print("extra steps (--only NAME): " + ", ".join(s.name for s in plan(wheels, raw) if s.extra))
        return 0
    if wheels is not None:
        print(f"[gpu_suite] {wheels}: {check_folder(wheels):.1f} MiB of pinned wheels", flush=True)

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(BENCH),
                                                                     os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1", "PIP_BREAK_SYSTEM_PACKAGES": "1"}
    adopted = adopt_orphans()
    started = time.monotonic()
    header = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (--tiny)",
              "command": " ".join(sys.argv), "budget": budget, "wall_s": 0.0,
              "budgets": {s.name: s.budget_s for s in steps if s.budget_s is not None}}
    deadline = started + budget - SUITE_S / 2  # the reports and the bundle after the last step
    records = [Record.of(s) for s in steps]
    try:
        for i, step in enumerate(steps):
            records[i] = Record.of(step, "running")
            header["wall_s"] = time.monotonic() - started
            write_report(out, header, records)
            print(f"[gpu_suite] {step.name}: {step.what} (cap {step.cap_s:.0f} s)", flush=True)
            try:
                records[i] = run_step(step, raw, deadline, env, adopted)
            except Exception as e:  # the suite's own failure on one step: recorded, the others still run
                records[i] = Record.of(step, "failed")
                records[i].note = f"the suite failed to run it: {type(e).__name__}: {e}"
            r = records[i]
            print(f"[gpu_suite] {step.name}: {r.status} in {r.seconds or 0:.0f} s {r.note}", flush=True)
            if r.status in ("failed", "timeout"):
                print("\n".join(r.error or r.output_tail[-25:]), flush=True)
            bundle(raw, out)
    finally:  # also when the suite itself is interrupted: the report says how far it got
        header["wall_s"] = time.monotonic() - started
        summary = write_report(out, header, records)
    print(f"{summary}\n\nreport: {out / 'report.md'} (and report.json; every log, result and pytest.xml in "
          "logs.tar.gz)")
    return 0 if all(r.status == "passed" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
