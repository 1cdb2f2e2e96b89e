"""Everything of the GPU path, checked and timed in one command on a CUDA machine, in at most 9 minutes.

    python bench/prepare_gpu_wheels.py             # with network: the wheels a machine without it lacks
    python bench/gpu_suite.py --wheels .gpu_wheels --out DIR           # on the GPU machine: everything
    python bench/gpu_suite.py --out DIR --only ours_tinyllama profile   # a subset (names from --dry-run)
    python bench/gpu_suite.py --dry-run            # the steps, their budgets and caps, their commands

Steps, each a subprocess with its own time cap (a hung or failing step costs its cap, not the
report), all inside ``--budget`` seconds; each step's budget is what it should take on an
H100/H200 (``--dry-run`` prints both, and their sum):

1. install: the wheels of ``--wheels`` (megatron-core, highspy, gurobipy, psutil, pytest, and
   torchao when present) with ``pip install --no-index``, then the GPU, driver, versions and what
   imports (without ``--wheels``: the environment alone);
2. at each of the two SHAPES (TinyLlama-1.1B; four Llama-3-8B layers at sequence 4096), 8
   micro-batches of 1 per iteration: ``peer_SHAPE``, bench/peer_step.py (a plain-PyTorch Llama as
   torchtitan writes it: eager, compiled per block, torchao float8 tensorwise and rowwise), then
   ``ours_SHAPE``, bench/step_time.py (our trainer and the plain megatron-core loop in bf16, our
   FP8 under each recipe, a SNIP cycle: at TinyLlama its cost and memory, at the 8B shape a
   ``--snip-time-target 0.85`` plan); the report sets them side by side (bench/side_by_side.py);
3. profile: torch.profiler on one step of our bf16 trainer at TinyLlama (its top operators);
4. gemm, quantize: FP8 ``_scaled_mm`` vs bf16 GEMMs; the fused quantize kernels;
5. tests: pytest on the cases marked ``cuda`` (Triton kernels, FP8 GEMMs, the quantized linear,
   SNIP's noise kernel, one-GPU training in FP8 and with SNIP), each under a per-test deadline;
   SLOW_CUDA_TESTS, each with its reason, are left to the extra ``tests_all`` step.

``--only`` also runs the EXTRA steps (the attention comparison, the full trainer's SNIP cycle,
every cuda test). ``--trainer-args`` appends flags to every command that runs our trainer (a
compile switch, say). ``report.md`` and ``report.json`` under ``--out`` are rewritten after every
step; every step's log, the benchmarks' JSON results and pytest's JUnit file go into
``logs.tar.gz`` beside them. Without CUDA the suite prints what it would run and exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prepare_gpu_wheels import OPTIONAL, TOP_LEVEL, WHEELS
from side_by_side import SHAPES, side_by_side

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
sys.path.insert(1, str(ROOT))  # megatron_snip, where it is not installed (a GPU machine's checkout)

CUDA_MARK = "pytest.mark.cuda"
BUDGET_S = 540  # the whole run: 9 minutes
TEST_DEADLINE_S = 60  # per test (bench/pytest_deadline.py): the longest, a one-GPU training launch, takes ~25 s
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


@dataclass
class Step:
    """One thing the suite runs: a command with its expected seconds (budget) and its time cap;
    ``result`` is the JSON file a benchmark writes; ``extra`` steps run only when --only names them."""

    name: str
    what: str
    cmd: list[str]
    cap_s: float
    result: str | None = None
    budget_s: float | None = None
    extra: bool = False


@dataclass
class Record:
    """What became of a step."""

    name: str
    what: str
    cmd: list[str]
    cap_s: float
    status: str = "pending"  # pending, passed, failed, timeout, skipped
    seconds: float | None = None
    returncode: int | None = None
    note: str = ""
    log: str | None = None
    result: dict | None = None
    tests: dict | None = None
    output_tail: list[str] = field(default_factory=list)


def cuda_test_files(tests: Path = ROOT / "tests") -> list[str]:
    """Test files with cases marked ``cuda`` (only these are collected: others may import what the GPU lacks)."""
    return sorted(str(p.relative_to(ROOT)) for p in tests.glob("test_*.py") if CUDA_MARK in p.read_text())


def fp8_recipes() -> list[str]:
    """Our FP8 recipes the ours_* steps time: tensorwise, rowwise where it exists, blockwise."""
    from megatron_snip.numerics.registry import FP8_RECIPE_SCHEMES

    return [r for r in ("tensorwise", "rowwise", "blockwise") if r in FP8_RECIPE_SCHEMES]


def plan(wheels: Path | None, raw: Path, trainer_args: list[str] = ()) -> list[Step]:
    """The steps, in order; benchmarks write their results and pytest its JUnit file into ``raw``.
    ``trainer_args``: appended to every command of our trainer."""
    py = sys.executable
    bench = str(BENCH)
    data = ["--data-dir", str(raw / "data")]  # built by the first trainer step, reused by the others
    ours = [*ONE_GPU, *data]
    trainer = [*TRAINER_FLAGS, *trainer_args]
    tinyllama, llama8 = SHAPES
    fp8 = [f"fp8:{r}" for r in fp8_recipes()]
    pytest = [py, "-m", "pytest", "-v", "-m", "cuda", "-p", "no:cacheprovider", "-rfE", "-p", "pytest_deadline",
              "--test-deadline", str(TEST_DEADLINE_S), "--durations", "15", "--junitxml", str(raw / "pytest.xml")]
    steps = [Step("install", "install the wheels (+ torchao if there); GPU, driver, versions, what imports",
                  [py, __file__, "--install", str(wheels)], 75, budget_s=20) if wheels is not None else
             Step("environment", "GPU, driver and package versions, what imports", [py, __file__, "--environment"],
                  45, budget_s=15)]
    for shape, (peer_budget, ours_budget) in zip(SHAPES, ((60, 115), (55, 100))):
        steps.append(Step(f"peer_{shape.name}", f"the plain-PyTorch peer, {shape.label}: eager, compiled per block, "
                          "torchao float8 tensorwise / rowwise", [
                              py, f"{bench}/peer_step.py", *shape.flags, "--micro-batch-size", "1",
                              "--num-microbatches", "8", "--iters", "6", "--warmup", "2",
                              "--json", str(raw / f"peer_{shape.name}.json")],
                          100, f"peer_{shape.name}.json", peer_budget))
        snip = ["--snip-time-target", SNIP_TIME_TARGET] if shape is llama8 else []
        steps.append(Step(f"ours_{shape.name}", f"our trainer, {shape.label}: bf16 vs the plain megatron-core loop, "
                          f"FP8 {', '.join(fp8_recipes())}, a SNIP cycle" + (
                              f" with --snip-time-target {SNIP_TIME_TARGET}" if snip else " (its cost and memory)"), [
                              py, f"{bench}/step_time.py", *shape.flags, *ours, "--iters", "5", "--warmup", "2",
                              "--repeats", "2", "--compare-precision", *fp8, "--snip-cycle", *snip,
                              "--json", str(raw / f"ours_{shape.name}.json"), *trainer],
                          170, f"ours_{shape.name}.json", ours_budget))
    steps += [
        Step("profile", f"where our bf16 step's time goes: torch.profiler on one step, {tinyllama.label}",
             [py, f"{bench}/step_time.py", *tinyllama.flags, *ours, "--iters", "4", "--warmup", "2",
              "--repeats", "0", "--profile", "ours", "--profile-steps", "1", *trainer], 90, budget_s=40),
        Step("gemm", "FP8 _scaled_mm vs bf16 matmul, Llama-3-8B/70B linear shapes",
             [py, f"{bench}/gemm_bench.py", "--json", str(raw / "gemm.json")], 40, "gemm.json", 12),
        Step("quantize", "fused quantize-dequantize kernels vs a copy of the same bytes",
             [py, f"{bench}/quantize_bench.py", "--size", "8192", "--reps", "20", "--json", str(raw / "quantize.json")],
             45, "quantize.json", 12),  # the first call of each of its 8 kernels compiles it
        Step("tests", "pytest -m cuda: kernels, FP8 GEMMs, quantized linear, SNIP noise, one-GPU training (fp8, SNIP), "
             f"{TEST_DEADLINE_S} s per test", [*pytest, *(a for t in SLOW_CUDA_TESTS for a in ("--deselect", t)),
                                               *cuda_test_files()], 150, budget_s=120),
        # Extras: only with --only.
        Step("tests_all", "pytest -m cuda, every case", [*pytest, *cuda_test_files()], 300, extra=True),
        Step("attention", f"core attention, SDPA vs DotProductAttention, alone and in the step ({tinyllama.label})",
             [py, f"{bench}/step_time.py", *tinyllama.flags, *ours, "--iters", "6", "--warmup", "2",
              "--compare-attention", "2048", "--json", str(raw / "attention.json"), *trainer], 120, "attention.json",
             extra=True),
        Step("cp_attention", "context parallelism's chunked attention (CP 2 layout) vs plain causal SDPA, "
             "sequence 8192, Llama-3-8B heads, bf16", [py, f"{bench}/cp_attention.py", "--json",
                                                     str(raw / "cp_attention.json")], 60, "cp_attention.json",
             extra=True),
        Step("snip_cycle", f"one SNIP cycle of the full trainer, {tinyllama.label}, as a share of 1000 iterations",
             [py, f"{bench}/snip_cycle.py", *tinyllama.flags, *ONE_GPU, *data, "--interval", "5", *trainer], 120,
             extra=True),
        Step("snip_cycle_fisher", "the same cycle with --snip-curvature fisher (no Hutchinson passes)",
             [py, f"{bench}/snip_cycle.py", *tinyllama.flags, *ONE_GPU, *data, "--interval", "5", "--curvature",
              "fisher", *trainer], 120, extra=True),
    ]
    # Issue 45's FP8 step per recipe against our bf16 step, the measured speed table and the step it
    # predicts, at both shapes; and quantization health's cost on logged steps (--only: the ours_* steps
    # already time every FP8 recipe, these add the table's prediction and the health figure).
    for shape in SHAPES:
        steps.append(Step(f"fp8_step_{shape.name}", f"our fp8 step per recipe vs bf16 and the measured speed table's "
                          f"prediction, {shape.label}", [
                              py, f"{bench}/fp8_step.py", *shape.flags, *ONE_GPU, "--iters", "6", "--warmup", "2",
                              "--recipes", *fp8_recipes(), "--json", str(raw / f"fp8_step_{shape.name}.json"),
                              *trainer], 180, f"fp8_step_{shape.name}.json", extra=True))
    steps.append(Step("health_overhead", f"--quant-health on vs off in fp8 on logged steps, {tinyllama.label}",
                      [py, f"{bench}/step_time.py", *tinyllama.flags, *ours, "--iters", "10", "--warmup", "2",
                       "--repeats", "2", "--health-overhead", "fp8", "--json", str(raw / "health_overhead.json"),
                       *trainer], 150, "health_overhead.json", extra=True))
    return steps


def junit_summary(path: Path, slowest: int = 10) -> dict | None:
    """Counts, the failed cases (with their first message line) and the ``slowest`` cases (name, seconds)
    of a pytest JUnit XML file."""
    if not path.exists():
        return None
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed, times = [], []
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        times.append((name, float(case.get("time", 0))))
        for bad in [*case.findall("failure"), *case.findall("error")]:
            message = (bad.get("message") or bad.text or "").strip().splitlines()
            failed.append(f"{name}: {message[0][:300] if message else ''}")
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "failed": failed, "slowest": sorted(times, key=lambda t: -t[1])[:slowest]}


def run_step(step: Step, raw: Path, deadline: float, env: dict) -> Record:
    """Run one step under min(its cap, the time left); its whole process group is killed at the cap.
    Its log goes to ``raw/logs/``, its result is read from ``raw``."""
    rec = Record(step.name, step.what, step.cmd, step.cap_s)
    cap = min(step.cap_s, deadline - time.monotonic() - 5)
    if cap < 10:
        rec.status, rec.note = "skipped", "out of time (--budget)"
        return rec
    logs = raw / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{step.name}.log"
    rec.log = str(log.relative_to(raw))
    start = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(step.cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own group: torchrun's workers die with it
        try:
            rec.returncode = proc.wait(timeout=cap)
            rec.status = "passed" if rec.returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rec.status, rec.note = "timeout", f"killed after {cap:.0f} s"
    rec.seconds = time.monotonic() - start
    rec.output_tail = log.read_text(errors="replace").splitlines()[-60:]
    if step.result and (raw / step.result).exists():
        rec.result = json.loads((raw / step.result).read_text())
    if step.name.startswith("tests"):
        rec.tests = junit_summary(raw / "pytest.xml")
    return rec


def goals_of(records: list[Record]) -> list[dict]:
    """Every benchmark's goals, each named after its step."""
    return [{**g, "name": f"{r.name}: {g['name']}"} for r in records if r.result for g in r.result.get("goals", [])]


def write_report(out: Path, header: dict, records: list[Record]) -> str:
    """report.json (everything) and report.md (for docs/benchmarks.md), written whole each time.
    Returns the summary part of report.md (steps, the side-by-side comparison and the goals)."""
    out.mkdir(parents=True, exist_ok=True)
    compared, compared_goals = side_by_side({r.name: r.result for r in records if r.result})
    goals = compared_goals + goals_of(records)
    (out / "report.json").write_text(json.dumps({**header, "steps": [asdict(r) for r in records],
                                                 "side_by_side": compared, "goals": goals}, indent=1))
    md = [f"# GPU suite report, {header['date']}", "", f"Device: {header['device']}. Command: `{header['command']}`",
          ""]
    md += ["| step | status | seconds | budget | cap | note |", "|---|---|---:|---:|---:|---|"]
    for r in records:
        secs = "" if r.seconds is None else f"{r.seconds:.0f}"
        budget = header.get("budgets", {}).get(r.name)
        md.append(f"| {r.name} | {r.status} | {secs} | {'' if budget is None else f'{budget:.0f}'} | "
                  f"{r.cap_s:.0f} | {r.note} |")
    total = sum(r.seconds or 0 for r in records)
    md += ["", f"Steps took {total:.0f} s together (budget {header.get('budget', BUDGET_S):.0f} s)."]
    if compared:
        md += ["", "## Side by side", "", "```text", *compared, "```"]
    if goals:
        md += ["", "## Goals", "", "| goal | measured | target | met |", "|---|---:|---|---|"]
        for g in goals:
            value = "n/a" if g["value"] is None else f"{g['value']:.3f}"
            met = {True: "yes", False: "**no**", None: "n/a"}[g["met"]]
            md.append(f"| {g['name']} | {value} | {g['goal']} | {met} |")
    summary = "\n".join(md)
    for r in records:
        if r.status == "pending":
            continue
        md += ["", f"## {r.name}: {r.what}", ""]
        if r.tests:
            t = r.tests
            md.append(f"{t['passed']} passed, {t['failures'] + t['errors']} failed, {t['skipped']} skipped; slowest: "
                      + ", ".join(f"{name.rsplit('.', 1)[-1]} {secs:.1f} s" for name, secs in t["slowest"][:5]))
            md += [f"- {line}" for line in t["failed"]]
        md += ["", "```text", *(r.output_tail[-40:]), "```"]
    (out / "report.md").write_text("\n".join(md) + "\n")
    return summary


def bundle(raw: Path, out: Path) -> None:
    """``out/logs.tar.gz``: every step's log, the benchmarks' JSON results and pytest's JUnit file, in one
    file, so the output folder holds three: the report (.md, .json) and this bundle."""
    with tarfile.open(out / "logs.tar.gz.tmp", "w:gz") as tar:
        for path in sorted([*(raw / "logs").glob("*.log"), *raw.glob("*.json"), *raw.glob("pytest.xml")]):
            tar.add(path, arcname=str(path.relative_to(raw)))
    os.replace(out / "logs.tar.gz.tmp", out / "logs.tar.gz")


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
        print(f"  {s.name:<{width}} ({planned}cap {s.cap_s:.0f} s) {s.what}\n      {shlex.join(s.cmd)}")
    planned = sum(s.budget_s or s.cap_s for s in steps)
    print(f"budgeted {planned:.0f} s of --budget {budget:.0f} s (a step without a budget counts its cap)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--wheels", type=Path, help="folder of wheels to install first (bench/prepare_gpu_wheels.py)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "runs" / "gpu_suite")),
                   help="report folder (default $OUT, else runs/gpu_suite)")
    p.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all steps together")
    p.add_argument("--only", nargs="+", metavar="STEP", help="run only these steps (names as --dry-run lists them; "
                                                             "the extra steps too)")
    p.add_argument("--trainer-args", default="", help="flags appended to every command of our trainer, one string "
                                                      "(e.g. --trainer-args='--num-workers 0')")
    p.add_argument("--dry-run", action="store_true", help="print the steps and exit")
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
    out = args.out.resolve()
    import torch

    run = not args.dry_run and torch.cuda.is_available()
    # logs and results, bundled into out/logs.tar.gz
    raw = Path(tempfile.mkdtemp(prefix="gpu_suite_")) if run else Path(tempfile.gettempdir()) / "gpu_suite_RUN"
    steps = plan(wheels, raw, shlex.split(args.trainer_args))
    if args.only:
        unknown = set(args.only) - {s.name for s in steps}
        if unknown:
            p.error(f"--only {' '.join(sorted(unknown))}: no such step; steps: {', '.join(s.name for s in steps)}")
    steps = select(steps, args.only)
    if not run:
        print("no CUDA device: nothing run. On a GPU this suite runs:" if not args.dry_run else "steps:")
        print_plan(steps, args.budget)
        if not args.only:
            print("extra steps (--only NAME): " + ", ".join(s.name for s in plan(wheels, raw) if s.extra))
        return 0

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(BENCH),
                                                                     os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1", "PIP_BREAK_SYSTEM_PACKAGES": "1"}
    header = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
              "device": torch.cuda.get_device_name(), "command": " ".join(sys.argv), "budget": args.budget,
              "budgets": {s.name: s.budget_s for s in steps if s.budget_s is not None}}
    deadline = time.monotonic() + args.budget
    records = [Record(s.name, s.what, s.cmd, s.cap_s) for s in steps]
    summary = write_report(out, header, records)
    for i, step in enumerate(steps):
        print(f"[gpu_suite] {step.name}: {step.what} (cap {step.cap_s:.0f} s)", flush=True)
        records[i] = run_step(step, raw, deadline, env)
        r = records[i]
        print(f"[gpu_suite] {step.name}: {r.status} in {r.seconds or 0:.0f} s {r.note}", flush=True)
        if r.status in ("failed", "timeout"):
            print("\n".join(r.output_tail[-25:]), flush=True)
        summary = write_report(out, header, records)
        bundle(raw, out)
    print(f"{summary}\n\nreport: {out / 'report.md'} (and report.json; every log, result and pytest.xml in "
          "logs.tar.gz)")
    return 0 if all(r.status == "passed" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
