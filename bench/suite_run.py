"""One step of bench/gpu_suite.py: a command run under its time cap, and what became of it.

A step is a subprocess (its own session) whose output goes to a log. At its cap less STOP_GRACE_S
every process of its tree gets SIGINT, so that a benchmark can still write what it measured
(bench/step_time.py and bench/peer_step.py keep their figures of the phases and variants they
finished) and pytest its JUnit file; at the cap, whatever is left is killed. The tree is read from
/proc before anything is signalled, and the suite makes itself the subreaper of its descendants, so
processes that left the step's process group (torchrun starts each worker in a session of its own)
are found and killed too: none of a step's processes outlives it to run beside the next step's timing.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STOP_GRACE_S = 8  # SIGINT this long before a step's cap, SIGKILL at the cap
MIN_CAP_S = 10  # a step with less time than this left is skipped
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
TRACEBACK = "Traceback (most recent call last):"


@dataclass
class Step:
    """One thing the suite runs: a command with its expected seconds (``budget_s``) and its time cap;
    ``result``: the JSON file a benchmark writes; ``extra`` steps run only when --only names them; a
    ``fill`` step takes the time the others leave of the suite's budget, at most its cap."""

    name: str
    what: str
    cmd: list[str]
    cap_s: float
    result: str | None = None
    budget_s: float | None = None
    extra: bool = False
    fill: bool = False


@dataclass
class Record:
    """What became of a step. ``error``: the first traceback of a failed or stopped step's log."""

    name: str
    what: str
    cmd: list[str]
    cap_s: float
    status: str = "pending"  # pending, running, passed, failed, timeout, skipped
    seconds: float | None = None
    returncode: int | None = None
    note: str = ""
    log: str | None = None
    result: dict | None = None
    tests: dict | None = None
    output_tail: list[str] = field(default_factory=list)
    error: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, step: Step, status: str = "pending") -> Record:
        return cls(step.name, step.what, step.cmd, step.cap_s, status=status)


def adopt_orphans() -> bool:
    """Make this process the subreaper of its descendants (Linux), so that a step's process whose parent
    died is re-parented here, where :func:`descendants` finds it; False where the kernel refuses."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def descendants(pid: int) -> list[int]:
    """The processes below ``pid``, read from /proc (parents before their children)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):  # a process that ended meanwhile
            children.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(0), [])
        found += below
        todo += below
    return found


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def reap() -> None:
    """Collect the exit status of adopted processes that ended (they stay zombies until then)."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def run_step(step: Step, raw: Path, deadline: float, env: dict, adopted: bool = False) -> Record:
    """Run one step under min(its cap, the time left before ``deadline``, a ``time.monotonic()``); see the
    module's docstring for how it is stopped. Its log goes to ``raw/logs/``, its result is read from ``raw``
    (also when it failed or was stopped: what a benchmark wrote before is kept). ``adopted``: this process
    is the subreaper of its descendants (:func:`adopt_orphans`) and runs nothing else, so every descendant
    left when the step ends is the step's, and is killed and reaped."""
    rec = Record.of(step)
    cap = min(step.cap_s, deadline - time.monotonic())
    if cap < MIN_CAP_S:
        rec.status, rec.note = "skipped", "out of time (--budget)"
        return rec
    logs = raw / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{step.name}.log"
    rec.log = str(log.relative_to(raw))
    start = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(step.cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        tree = []
        try:
            rec.returncode = proc.wait(timeout=max(cap - STOP_GRACE_S, 1))
            rec.status = "passed" if rec.returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            tree = [proc.pid, *descendants(proc.pid)]
            signal_all(tree, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=STOP_GRACE_S)
            rec.status, rec.note = "timeout", f"stopped at its cap, {cap:.0f} s"
        finally:  # nothing of the step outlives it: its tree, its group, what was re-parented here
            signal_all([*tree, *descendants(proc.pid)], signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if adopted:
                signal_all(descendants(os.getpid()), signal.SIGKILL)
                reap()
    rec.seconds = time.monotonic() - start
    lines = log.read_text(errors="replace").splitlines()
    rec.output_tail = lines[-60:]
    if rec.status != "passed":
        rec.error = first_traceback(lines)
    if step.result and (raw / step.result).exists():
        try:
            rec.result = json.loads((raw / step.result).read_text())
        except ValueError as e:
            rec.note += f"; its result {step.result} does not parse ({e})"
    if step.name.startswith("tests"):
        rec.tests = junit_summary(raw / "pytest.xml")
    return rec


def first_traceback(lines: list[str], most: int = 40) -> list[str]:
    """The first Python traceback in a log, up to ``most`` lines (a torchrun launch prints the worker's
    error first, each line maybe prefixed with its rank, then its own summary, which the log's tail holds)."""
    start = next((i for i, line in enumerate(lines) if TRACEBACK in line), None)
    if start is None:
        return []
    prefix = lines[start][:lines[start].index(TRACEBACK)]  # "[rank0]: ", or nothing
    end = start + 1
    while end < min(len(lines), start + most):
        body = lines[end].removeprefix(prefix)
        end += 1
        if body and not body[0].isspace():  # the exception's own line closes the traceback
            break
    return lines[start:end]


def junit_summary(path: Path, slowest: int = 10) -> dict | None:
    """Counts, the failed cases (with their first message line) and the ``slowest`` cases (name, seconds)
    of a pytest JUnit XML file."""
    if not path.exists():
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:  # written while the step was killed
        return None
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
