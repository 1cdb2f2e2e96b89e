"""Everything of the GPU path, checked and timed in one command on a lent CUDA machine.

    python bench/prepare_gpu_wheels.py        # here: the wheels the machine lacks, into .gpu_wheels/
    # then, through the device tool (docs/benchmarks.md):
    #   run(command="PYTHONUNBUFFERED=1 python3 bench/gpu_suite.py --wheels .gpu_wheels --out $OUT",
    #       carry=[".gpu_wheels"], timeout_s=600)

Steps, each a subprocess with its own time cap (a hung or failing step costs its
cap, not the report), all inside ``--budget`` seconds (one 10-minute device call):

1. install: the carried wheels (megatron-core, highspy, gurobipy, psutil, pytest)
   with ``pip install --no-index --find-links``;
2. environment: GPU, driver, torch / CUDA / triton versions, and what imports;
3. tests: pytest on every test case marked ``cuda`` (the Triton kernels bit-identical to
   the torch reference on the GPU, ``_scaled_mm`` GEMMs, the quantized linear under every
   recipe, one-GPU training in each precision and with SNIP);
4. gemm: ``bench/gemm_bench.py`` (FP8 ``_scaled_mm`` vs bf16 at Llama-3-8B/70B shapes);
5. quantize: ``bench/quantize_bench.py`` (fused quantize-dequantize kernels vs a copy);
6. step_time: ``bench/step_time.py`` on a TinyLlama-1.1B-shaped model, one GPU;
7. attention: ``bench/step_time.py --compare-attention 2048``, SDPA vs DotProductAttention;
8. snip_cycle: ``bench/snip_cycle.py``, a SNIP cycle's cost in iterations and as a share of 1000;
   snip_cycle_fisher, the same with ``--curvature fisher``;
9. profile: ``bench/step_time.py --profile``, the top operators of our bf16 and fp8 steps.

``report.md`` and ``report.json`` under ``--out`` are rewritten after every step, with
every step's log (and pytest's JUnit file) in ``logs.tar.gz``: the device tool brings back at
most 8 files, and the report, the benchmarks' results and the bundle are 7. Without CUDA the
suite prints what it would run and exits 0 (``--dry-run`` does the same on a GPU).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prepare_gpu_wheels import TOP_LEVEL, WHEELS

ROOT = Path(__file__).resolve().parents[1]

CUDA_MARK = "pytest.mark.cuda"


@dataclass
class Step:
    """One thing the suite runs: a command with a time cap; ``result`` is the JSON a benchmark writes."""

    name: str
    what: str
    cmd: list[str]
    cap_s: float
    result: str | None = None


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


def plan(wheels: Path | None, out: Path, raw: Path | None = None) -> list[Step]:
    """The steps; benchmarks write their results into ``out``, pytest its JUnit file into ``raw``."""
    raw = raw or out
    py = sys.executable
    bench = str(ROOT / "bench")
    # The TinyLlama-1.1B shape on one GPU, as every training bench below runs it.
    tinyllama = ["--nproc", "1", "--tp", "1", "--pp", "1", "--preset", "tinyllama-1.1b", "--bf16",
                 "--micro-batch-size", "1", "--global-batch-size", "8"]
    steps = []
    if wheels is not None:
        steps.append(Step("install", "install the carried wheels", [py, __file__, "--install", str(wheels)], 90))
    steps += [
        Step("environment", "GPU, driver and package versions", [py, __file__, "--environment"], 45),
        Step("tests", "pytest -m cuda: kernels, FP8 GEMMs, quantized linear, one-GPU training", [
            # -v: one line per case in the log, so a run cut at its cap still shows how far it got
            py, "-m", "pytest", "-v", "-m", "cuda", "-p", "no:cacheprovider", "-rfE",
            "--junitxml", str(raw / "pytest.xml"), *cuda_test_files()], 300),
        Step("gemm", "FP8 _scaled_mm vs bf16 matmul, Llama-3-8B/70B linear shapes",
             [py, f"{bench}/gemm_bench.py", "--json", str(out / "gemm.json")], 60, "gemm.json"),
        Step("quantize", "fused quantize-dequantize kernels vs a copy of the same bytes",
             [py, f"{bench}/quantize_bench.py", "--size", "8192", "--reps", "20", "--json", str(out / "quantize.json")],
             90, "quantize.json"),  # the first call of each of its 8 kernels compiles it
        Step("step_time", "training step, TinyLlama-1.1B shape, one GPU: overhead, precisions, MFU, SNIP, memory",
             [py, f"{bench}/step_time.py", *tinyllama, "--iters", "10", "--warmup", "3",
              "--repeats", "2", "--compare-precision", "fp8", "nvfp4", "--snip-cycle",
              "--json", str(out / "step_time.json")], 200, "step_time.json"),
        Step("attention", "core attention, SDPA vs DotProductAttention, alone and in the step (TinyLlama shape)",
             [py, f"{bench}/step_time.py", *tinyllama, "--iters", "6", "--warmup", "2",
              "--compare-attention", "2048", "--json", str(out / "attention.json")], 120, "attention.json"),
        Step("snip_cycle", "one SNIP cycle at the TinyLlama-1.1B shape as a share of 1000 iterations",
             [py, f"{bench}/snip_cycle.py", *tinyllama, "--interval", "5"], 120),
        Step("snip_cycle_fisher", "the same cycle with --snip-curvature fisher (no Hutchinson passes)",
             [py, f"{bench}/snip_cycle.py", *tinyllama, "--interval", "5", "--curvature", "fisher"], 120),
        Step("profile", "where the step's time goes: torch.profiler on our bf16 and fp8 steps (TinyLlama shape)",
             [py, f"{bench}/step_time.py", *tinyllama, "--iters", "3", "--warmup", "1",
              "--repeats", "1", "--profile", "ours", "fp8"], 150),
        # issue 45: our FP8 step per recipe vs our bf16 step, the measured speed table and its prediction
        Step("fp8_step", "our fp8 step per recipe vs our bf16 step; measured speed table (TinyLlama shape)",
             [py, f"{bench}/fp8_step.py", *tinyllama, "--iters", "8", "--warmup", "3", "--recipes", "tensorwise",
              "rowwise", "blockwise", "--json", str(out / "fp8_step.json")], 180, "fp8_step.json"),
    ]
    return steps


def junit_summary(path: Path) -> dict | None:
    """Counts and the failed cases (with their first message line) of a pytest JUnit XML file."""
    if not path.exists():
        return None
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = []
    for case in root.iter("testcase"):
        for bad in [*case.findall("failure"), *case.findall("error")]:
            message = (bad.get("message") or bad.text or "").strip().splitlines()
            failed.append(f"{case.get('classname')}::{case.get('name')}: {message[0][:300] if message else ''}")
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "failed": failed}


def run_step(step: Step, out: Path, deadline: float, env: dict, raw: Path | None = None) -> Record:
    """Run one step under min(its cap, the time left); its whole process group is killed at the cap.
    Its log goes to ``raw/logs/`` (``raw`` defaults to ``out``), its result is read from ``out``."""
    raw = raw or out
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
    if step.result and (out / step.result).exists():
        rec.result = json.loads((out / step.result).read_text())
    if step.name == "tests":
        rec.tests = junit_summary(raw / "pytest.xml")
    return rec


def goals_of(records: list[Record]) -> list[dict]:
    return [g for r in records if r.result for g in r.result.get("goals", [])]


def write_report(out: Path, header: dict, records: list[Record]) -> str:
    """report.json (everything) and report.md (for docs/benchmarks.md), written whole each time.
    Returns the summary part of report.md (steps and goals)."""
    out.mkdir(parents=True, exist_ok=True)
    goals = goals_of(records)
    (out / "report.json").write_text(json.dumps({**header, "steps": [asdict(r) for r in records], "goals": goals},
                                                indent=1))
    md = [f"# GPU suite report, {header['date']}", "", f"Command: `{header['command']}`", ""]
    md += ["| step | status | seconds | cap | note |", "|---|---|---:|---:|---|"]
    for r in records:
        secs = "" if r.seconds is None else f"{r.seconds:.0f}"
        md.append(f"| {r.name} | {r.status} | {secs} | {r.cap_s:.0f} | {r.note} |")
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
            md.append(f"{t['passed']} passed, {t['failures'] + t['errors']} failed, {t['skipped']} skipped")
            md += [f"- {line}" for line in t["failed"]]
        md += ["", "```text", *(r.output_tail[-40:]), "```"]
    (out / "report.md").write_text("\n".join(md) + "\n")
    return summary


def bundle(raw: Path, out: Path) -> None:
    """``out/logs.tar.gz``: every step's log and pytest's JUnit file, in one file (the device tool
    brings back at most 8 files from its output folder)."""
    with tarfile.open(out / "logs.tar.gz.tmp", "w:gz") as tar:
        for path in sorted([*(raw / "logs").glob("*.log"), *raw.glob("pytest.xml")]):
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
    machine lacks, and what then fails to import shows in the environment step."""
    if pip_install(wheels, *(f"{n}=={v}" for n, v in TOP_LEVEL.items())) == 0:
        return 0
    import importlib.metadata

    def missing(name: str) -> bool:
        try:
            importlib.metadata.version(name)
            return False
        except importlib.metadata.PackageNotFoundError:
            return True

    lacking = [f"{n}=={v}" for n, v in WHEELS.items() if n in TOP_LEVEL or missing(n)]
    print("[gpu_suite] dependency resolution failed: installing the pins without their dependencies", flush=True)
    return pip_install(wheels, "--no-deps", *lacking)


def print_environment() -> None:
    import importlib
    import platform

    import torch

    print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda)
    if torch.cuda.is_available():
        print("device", torch.cuda.get_device_name(), "| capability", torch.cuda.get_device_capability(),
              f"| memory {torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB")
    for name in ("triton", "megatron.core", "highspy", "gurobipy", "psutil", "pytest", "sentencepiece",
                 "tensorboard", "transformers", "apex", "transformer_engine"):
        try:
            print(f"{name}: {getattr(importlib.import_module(name), '__version__', 'imports')}")
        except Exception as e:
            print(f"{name}: not importable ({type(e).__name__}: {e})")
    try:
        print(subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout)
    except (OSError, subprocess.TimeoutExpired) as e:
        print("nvidia-smi:", e)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--wheels", type=Path, help="folder of wheels to install first (bench/prepare_gpu_wheels.py)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "runs" / "gpu_suite")),
                   help="report folder (default $OUT, the device tool's output folder)")
    p.add_argument("--budget", type=float, default=560, help="seconds for all steps together")
    p.add_argument("--only", nargs="+", help="run only these steps (names as listed)")
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
    raw = Path(tempfile.mkdtemp(prefix="gpu_suite_"))  # logs, bundled into out/logs.tar.gz
    steps = plan(wheels, out, raw)
    if args.only:
        unknown = set(args.only) - {s.name for s in steps}
        if unknown:
            p.error(f"--only {' '.join(sorted(unknown))}: no such step; steps: {', '.join(s.name for s in steps)}")
        steps = [s for s in steps if s.name in args.only]

    import torch

    if args.dry_run or not torch.cuda.is_available():
        print("no CUDA device: nothing run. On a GPU this suite runs:" if not args.dry_run else "steps:")
        for s in steps:
            print(f"  {s.name:<12} (cap {s.cap_s:.0f} s) {s.what}\n      {' '.join(s.cmd)}")
        return 0

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1", "PIP_BREAK_SYSTEM_PACKAGES": "1"}
    header = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
              "device": torch.cuda.get_device_name(), "command": " ".join(sys.argv)}
    deadline = time.monotonic() + args.budget
    records = [Record(s.name, s.what, s.cmd, s.cap_s) for s in steps]
    write_report(out, header, records)
    for i, step in enumerate(steps):
        print(f"[gpu_suite] {step.name}: {step.what} (cap {step.cap_s:.0f} s)", flush=True)
        records[i] = run_step(step, out, deadline, env, raw)
        r = records[i]
        print(f"[gpu_suite] {step.name}: {r.status} in {r.seconds or 0:.0f} s {r.note}", flush=True)
        if r.status in ("failed", "timeout"):
            print("\n".join(r.output_tail[-25:]), flush=True)
        summary = write_report(out, header, records)
        bundle(raw, out)
    print(f"{summary}\n\nreport: {out / 'report.md'} (and report.json; every log and pytest.xml in logs.tar.gz)")
    return 0 if all(r.status == "passed" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
