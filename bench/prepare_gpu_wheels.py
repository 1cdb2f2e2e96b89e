"""Download the wheels a lent GPU machine lacks into ``.gpu_wheels/``, for bench/gpu_suite.py to install there.

    python bench/prepare_gpu_wheels.py            # then the device call it prints (docs/benchmarks.md)

The lent machines (H100 / H200) have Python 3.12 on x86-64 with torch (CUDA), triton,
sentencepiece, tensorboard and transformers, and no network. What the project needs
beyond that travels with the working tree as wheels (64 MiB per call, the tree
included): the pins below, each downloaded without its dependencies, so nothing
large (torch) is pulled in; the pure-Python dependencies that may be missing there
are pinned too. bench/gpu_suite.py installs the top-level ones with ``--no-index``;
pip takes the rest from the folder only when the machine lacks them.
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
CARRY_LIMIT_MIB = 60  # the device call carries 64 MiB with the working tree (~1 MiB)

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


def normalise(name: str) -> str:
    """A distribution name as wheel file names spell it (PEP 427)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def wheel_pin(path: Path) -> tuple[str, str]:
    """(normalised name, version) of a wheel file."""
    name, version = path.name.split("-")[:2]
    return normalise(name), version


def download_command(dest: Path) -> list[str]:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", PYTHON,
            *platforms, "--dest", str(dest), *(f"{name}=={version}" for name, version in WHEELS.items())]


def check_folder(dest: Path) -> float:
    """MiB of the folder's wheels; raises unless it holds exactly one wheel per pin and fits the carry limit."""
    found = {wheel_pin(p): p for p in dest.glob("*.whl")}
    want = {(normalise(n), v) for n, v in WHEELS.items()}
    missing, extra = want - set(found), set(found) - want
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
    want = {(normalise(n), v) for n, v in WHEELS.items()}
    for stale in args.dest.glob("*.whl"):  # other versions would ride along and count against the limit
        if wheel_pin(stale) not in want:
            stale.unlink()
    subprocess.run(download_command(args.dest), check=True)
    mib = check_folder(args.dest)
    rel = args.dest.resolve().relative_to(ROOT) if args.dest.resolve().is_relative_to(ROOT) else args.dest
    print(f"{rel}: {len(WHEELS)} wheels, {mib:.1f} MiB (limit {CARRY_LIMIT_MIB} MiB). The device call:")
    print(f'  run(command="PYTHONUNBUFFERED=1 python3 bench/gpu_suite.py --wheels {rel} --out $OUT", '
          f'carry=["{rel}"], timeout_s=600)')


if __name__ == "__main__":
    main()
