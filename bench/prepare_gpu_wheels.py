"""Download the wheels a GPU machine without network lacks into ``.gpu_wheels/``, for bench/gpu_suite.py.

    python bench/prepare_gpu_wheels.py      # here, with network
    python bench/gpu_suite.py --wheels .gpu_wheels --out DIR     # there (docs/benchmarks.md)

For a CUDA machine with Python 3.12 on x86-64, torch (CUDA), triton, sentencepiece,
tensorboard and transformers, but no network. What the project needs beyond that is
copied there as wheels, in a folder kept under CARRY_LIMIT_MIB: the pins below, each
downloaded without its dependencies, so nothing large (torch) is pulled in; the
pure-Python dependencies that may be missing there are pinned too. bench/gpu_suite.py
installs the top-level ones with ``--no-index``; pip takes the rest from the folder only
when the machine lacks them. OPTIONAL wheels (torchao, for bench/peer_step.py's float8
variants) are fetched when the index serves them; without them the suite skips what
needs them.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEST = ROOT / ".gpu_wheels"
PYTHON = "3.12"
# megatron-core and highspy ship manylinux_2_28 wheels, gurobipy manylinux2014 ones: pip needs both named.
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux2014_x86_64")
CARRY_LIMIT_MIB = 60  # small enough to copy along with the working tree (~1 MiB)

# Installed on the device by name (bench/gpu_suite.py); versions equal the CPU environment's.
TOP_LEVEL = {
    "megatron-core": "0.16.1",
    "highspy": "1.16.0",
    "gurobipy": "13.0.3",
    "psutil": "7.2.2",  # megatron-core's checkpoint saving imports it (undeclared)
    "pytest": "9.2.0",
}
# Dependencies of those the device may lack or have too old (torch and numpy it has).
DEPENDENCIES = {
    "packaging": "26.3",  # megatron-core wants >= 24.2
    "pluggy": "1.7.0",
    "iniconfig": "2.3.1",
    "pygments": "2.21.0",
}
WHEELS = {**TOP_LEVEL, **DEPENDENCIES}
# Installed when present, without dependencies (it has none); the CPU environment does not need them.
OPTIONAL = {
    "torchao": "0.18.0",  # torchao-0.18.0-cp310-abi3-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl, 3.4 MB
}


def normalise(name: str) -> str:
    """A distribution name as wheel file names spell it (PEP 427)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def wheel_pin(path: Path) -> tuple[str, str]:
    """(normalised name, version) of a wheel file."""
    name, version = path.name.split("-")[:2]
    return normalise(name), version


def download_command(dest: Path, pins: dict[str, str] = WHEELS) -> list[str]:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", PYTHON,
            *platforms, "--dest", str(dest), *(f"{name}=={version}" for name, version in pins.items())]


def check_folder(dest: Path) -> float:
    """MiB of the folder's wheels; raises unless it holds exactly one wheel per pin (OPTIONAL ones may be
    missing) and fits the carry limit."""
    found = {wheel_pin(p): p for p in dest.glob("*.whl")}
    want = {(normalise(n), v) for n, v in WHEELS.items()}
    optional = {(normalise(n), v) for n, v in OPTIONAL.items()}
    missing, extra = want - set(found), set(found) - want - optional
    if missing or extra:
        raise SystemExit(f"{dest}: missing {sorted(missing)}, unpinned {sorted(extra)}; run "
                         "python bench/prepare_gpu_wheels.py again")
    mib = sum(p.stat().st_size for p in found.values()) / 2**20
    if mib > CARRY_LIMIT_MIB:
        raise SystemExit(f"{dest}: {mib:.1f} MiB of wheels exceeds the {CARRY_LIMIT_MIB} MiB a device call carries")
    return mib


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dest", type=Path, default=DEST, help="wheel folder (default .gpu_wheels, git-ignored)")
    args = p.parse_args()
    args.dest.mkdir(parents=True, exist_ok=True)
    want = {(normalise(n), v) for n, v in {**WHEELS, **OPTIONAL}.items()}
    for stale in args.dest.glob("*.whl"):  # other versions would ride along and count against the limit
        if wheel_pin(stale) not in want:
            stale.unlink()
    subprocess.run(download_command(args.dest), check=True)
    if subprocess.run(download_command(args.dest, OPTIONAL)).returncode:
        print(f"optional wheels not fetched ({', '.join(OPTIONAL)}): the suite skips what needs them")
    mib = check_folder(args.dest)
    count = len(list(args.dest.glob("*.whl")))
    rel = args.dest.resolve().relative_to(ROOT) if args.dest.resolve().is_relative_to(ROOT) else args.dest
    print(f"{rel}: {count} wheels, {mib:.1f} MiB (limit {CARRY_LIMIT_MIB} MiB). On the GPU machine, from the "
          f"repository root:\n  python3 bench/gpu_suite.py --wheels {rel} --out DIR")


if __name__ == "__main__":
    main()
