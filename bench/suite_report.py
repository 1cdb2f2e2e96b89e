"""bench/gpu_suite.py's report: ``report.md`` (to read, and for docs/benchmarks.md), ``report.json``
(everything) and ``logs.tar.gz`` (every log, result and JUnit file), rewritten whole after every step.

What it says, in order: each step's status, seconds, budget and cap; the side-by-side comparison of
our trainer and the peer (bench/side_by_side.py); every goal with its verdict, the suite's own two
among them (every step inside its cap, the whole run inside its budget); for each missed goal, the
profiles that show where the time of what it measures went (the top operators torch.profiler saw in
the steps that measured it); then, step by step, its failed tests, the first traceback of a step that
failed or was stopped, and the tail of its log. Nothing a step wrote can keep the report from being
written: a comparison that cannot be made is said in its place.
"""

from __future__ import annotations

import json
import os
import tarfile
import traceback
from dataclasses import asdict
from pathlib import Path

from results import goal
from side_by_side import side_by_side
from suite_run import Record

PROFILE_ROWS = 22  # lines of each profile table in report.md (its header and top operators; all in report.json)


def goals_of(records: list[Record]) -> list[dict]:
    """Every benchmark's goals, each named after its step, its profiles named ``STEP/PHASE``."""
    out = []
    for r in records:
        for g in (r.result or {}).get("goals", []):
            profiles = [p if "/" in p else f"{r.name}/{p}" for p in g.get("profiles", [])]
            out.append({**g, "name": f"{r.name}: {g['name']}", **({"profiles": profiles} if profiles else {})})
    return out


def suite_goals(records: list[Record], header: dict) -> list[dict]:
    """The suite's own: no step stopped at its cap, and the run inside its budget (issue 52)."""
    ran = [r for r in records if r.status not in ("pending", "running")]
    if not ran:
        return []
    return [goal("suite: steps stopped at their cap", sum(r.status == "timeout" for r in ran), at_most=0),
            goal(f"suite: wall seconds (--budget {header.get('budget', 0):g})", header.get("wall_s"),
                 at_most=header.get("budget", 0))]


def profile_table(records: list[Record], ref: str) -> str | None:
    """The profile ``STEP/PHASE`` (a bench/step_time.py phase, or a bench/peer_step.py variant), or None."""
    step, _, phase = ref.partition("/")
    result = next((r.result for r in records if r.name == step and r.result), None) or {}
    return result.get("profiles", {}).get(phase) or result.get("variants", {}).get(phase, {}).get("profile")


def missed(goals: list[dict], records: list[Record]) -> list[str]:
    """For each missed goal (or one refused for differing conditions), the profiles that explain it."""
    md = []
    for g in goals:
        if g["met"] is not False and not g.get("note"):
            continue
        value = "n/a" if g["value"] is None else f"{g['value']:.3f}"
        md += ["", f"### {g['name']}: {value} (goal {g['goal']})"]
        if g.get("note"):
            md.append(g["note"])
        if not g.get("profiles"):
            md.append("No profile measures this goal's step in this run.")
        for ref in g.get("profiles", []):
            table = profile_table(records, ref)
            if table is None:
                md.append(f"- `{ref}`: not profiled (its step did not run, failed or was stopped before it)")
            else:
                md += ["", f"`{ref}`, top operators:", "", "```text", *table.splitlines()[:PROFILE_ROWS], "```"]
    return ["", "## Missed goals: where the time went", *md] if md else []


def write_report(out: Path, header: dict, records: list[Record]) -> str:
    """report.json (everything) and report.md, written whole each time. Returns the summary part of
    report.md (steps, the side-by-side comparison and the goals)."""
    out.mkdir(parents=True, exist_ok=True)
    try:
        compared, compared_goals = side_by_side({r.name: r.result for r in records if r.result})
    except Exception:  # a result of a shape no one foresaw: said, and the rest of the report written
        compared, compared_goals = ["the side-by-side comparison failed:", *traceback.format_exc().splitlines()], []
    goals = compared_goals + goals_of(records) + suite_goals(records, header)
    report = {**header, "steps": [asdict(r) for r in records], "side_by_side": compared, "goals": goals}
    (out / "report.json.tmp").write_text(json.dumps(report, indent=1, default=str))
    os.replace(out / "report.json.tmp", out / "report.json")
    md = [f"# GPU suite report, {header['date']}", "", f"Device: {header['device']}. Command: `{header['command']}`",
          ""]
    md += ["| step | status | seconds | budget | cap | note |", "|---|---|---:|---:|---:|---|"]
    for r in records:
        secs = "" if r.seconds is None else f"{r.seconds:.0f}"
        budget = header.get("budgets", {}).get(r.name)
        md.append(f"| {r.name} | {r.status} | {secs} | {'' if budget is None else f'{budget:.0f}'} | "
                  f"{r.cap_s:.0f} | {r.note} |")
    total = sum(r.seconds or 0 for r in records)
    md += ["", f"Steps took {total:.0f} s together; the run {header.get('wall_s') or 0:.0f} s "
               f"(budget {header.get('budget', 0):.0f} s)."]
    if compared:
        md += ["", "## Side by side", "", "```text", *compared, "```"]
    if goals:
        md += ["", "## Goals", "", "| goal | measured | target | met |", "|---|---:|---|---|"]
        for g in goals:
            value = "n/a" if g["value"] is None else f"{g['value']:.3f}"
            met = {True: "yes", False: "**no**", None: "n/a"}[g["met"]]
            md.append(f"| {g['name']}{' (' + g['note'] + ')' if g.get('note') else ''} | {value} | {g['goal']} | "
                      f"{met} |")
    summary = "\n".join(md)
    md += missed(goals, records)
    for r in records:
        if r.status in ("pending", "running"):
            continue
        md += ["", f"## {r.name}: {r.what}", ""]
        if r.tests:
            t = r.tests
            md.append(f"{t['passed']} passed, {t['failures'] + t['errors']} failed, {t['skipped']} skipped; slowest: "
                      + ", ".join(f"{name.rsplit('.', 1)[-1]} {secs:.1f} s" for name, secs in t["slowest"][:5]))
            md += [f"- {line}" for line in t["failed"]]
        if r.error:
            md += ["", "First error in its log:", "", "```text", *r.error, "```", "", "Its log ends:"]
        md += ["", "```text", *(r.output_tail[-40:]), "```"]
    (out / "report.md.tmp").write_text("\n".join(md) + "\n")
    os.replace(out / "report.md.tmp", out / "report.md")
    return summary


def bundle(raw: Path, out: Path) -> None:
    """``out/logs.tar.gz``: every step's log, the benchmarks' JSON results and pytest's JUnit file, in one
    file, so the output folder holds three: the report (.md, .json) and this bundle."""
    with tarfile.open(out / "logs.tar.gz.tmp", "w:gz") as tar:
        for path in sorted([*(raw / "logs").glob("*.log"), *raw.glob("*.json"), *raw.glob("pytest.xml")]):
            tar.add(path, arcname=str(path.relative_to(raw)))
    os.replace(out / "logs.tar.gz.tmp", out / "logs.tar.gz")
