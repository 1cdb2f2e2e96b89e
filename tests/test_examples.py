"""Every flag in every example launch script is accepted by pretrain_llama.py.

The scripts run for real under bash with stand-ins for torchrun/srun/scontrol
(exported shell functions) that record the arguments instead of launching anything; those
arguments are then parsed and validated (without the data files) as the
training program would, for the world size the script launches.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT

from megatron_snip.arguments import parse_args, resolve

pytestmark = pytest.mark.integration  # every test here launches processes

FAKES = {
    # torchrun: record argv (one file per call), then succeed.
    "torchrun": 'n=$(date +%s%N); printf "%s\\0" "$@" > "$RECORD_DIR/torchrun.$n"; echo $n >> "$RECORD_DIR/calls"',
    "srun": 'while [[ "$1" == --* ]]; do shift; done; "$@"',
    "scontrol": 'if [ "$1" = show ]; then echo node001; fi',
}

SCRIPTS = sorted((ROOT / "examples").glob("**/*.sh")) + sorted((ROOT / "examples").glob("**/*.sbatch"))


def recorded_launches(script: Path, tmp_path: Path, env: dict | None = None) -> list[list[str]]:
    """The argument lists of every torchrun the script calls (``env``: more of its environment)."""
    # Exported bash functions win over PATH, even after the script activates a venv.
    stand_ins = "".join(f"{name}() {{ {body}; }}; export -f {name}; " for name, body in FAKES.items())
    out = tmp_path / "out"
    (out / "data").mkdir(parents=True)
    (out / "data" / "stdlib_text_document.idx").touch()  # the quickstart then skips building its data
    env = {**os.environ, "RECORD_DIR": str(tmp_path), "OUT": str(out), "CKPT_DIR": str(tmp_path / "ckpt"),
           "DATA_PATH": "/data/corpus_text_document", "TOKENIZER_MODEL": "/data/tok.model",
           "SLURM_JOB_NODELIST": "node[001-002]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "42",
           # Scripts that run tools (conversion, preprocessing) call them through $PYTHON: a no-op here.
           "HF_DIR": "/models/TinyLlama", "CORPUS": "/data/corpus.jsonl", "PYTHON": "true", **(env or {})}
    proc = subprocess.run(["bash", "-c", f'{stand_ins} bash "$0"', str(script)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pids = (tmp_path / "calls").read_text().split()
    return [(tmp_path / f"torchrun.{pid}").read_text().split("\0")[:-1] for pid in pids]


def world_size(torchrun_args: list[str]) -> int:
    opts = dict(zip(torchrun_args[::2], torchrun_args[1::2]))
    return int(opts.get("--nproc-per-node", 1)) * int(opts.get("--nnodes", 1))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_example_flags_are_accepted(script, tmp_path):
    launches = recorded_launches(script, tmp_path)
    assert launches, f"{script} launched nothing"
    for argv in launches:
        entry = argv.index("pretrain_llama.py")
        resolve(parse_args(argv[entry + 1:]), world_size=world_size(argv[:entry]), cuda=True,
                check_files=False)


@pytest.mark.parametrize("decision, status, said", [
    (78, 78, "configuration error (the problems are listed above): fix the flags; not requeueing"),
    (75, 0, "requeueing job 42"),
    (1, 1, "training stopped without a clean exit save"),
])
def test_the_slurm_script_never_requeues_a_configuration_error(tmp_path, decision, status, said):
    """The requeue decision's exit status (python -m megatron_snip.training.requeue, stood in for here) decides:
    78 (refused flags) ends the job with 78, 75 requeues, a crash ends it."""
    script = ROOT / "examples" / "slurm" / "pretrain_llama.sbatch"
    decide = tmp_path / "decide.sh"
    decide.write_text(f"#!/bin/bash\nexit {decision}\n")
    decide.chmod(0o755)
    stand_ins = "".join(f"{name}() {{ {body}; }}; export -f {name}; " for name, body in FAKES.items())
    env = {**os.environ, "RECORD_DIR": str(tmp_path), "CKPT_DIR": str(tmp_path / "ckpt"), "PYTHON": str(decide),
           "DATA_PATH": "/data/corpus_text_document", "TOKENIZER_MODEL": "/data/tok.model",
           "SLURM_JOB_NODELIST": "node001", "SLURM_NNODES": "1", "SLURM_JOB_ID": "42"}
    proc = subprocess.run(["bash", "-c", f'{stand_ins} bash "$0"', str(script)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == status and said in proc.stdout + proc.stderr, proc.stdout + proc.stderr
