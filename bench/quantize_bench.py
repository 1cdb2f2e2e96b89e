"""Throughput of fake_quantize per format, relative to copying the same bytes.

    python bench/quantize_bench.py                 # 4096x4096, fp32 on CPU / bf16 on CUDA
    python bench/quantize_bench.py --size 2048 --reps 5 --device cpu

For each format: median wall time of fake_quantize(x, fmt) (activation role,
round-to-nearest), the effective bandwidth 2 * x.nbytes / time (the tensor is
read once and the result written once, the minimum any kernel must move), and
its throughput as a ratio of ``torch.clone(x)``'s, which moves exactly those
bytes (copy time / quantize time; 1.0 = as fast as a copy; goal on GPU >= 0.5).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_snip.precision import FORMATS, fake_quantize


def timed(fn, device: torch.device, reps: int) -> float:
    """Median seconds per call after one warm-up call."""

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096, help="tensor is size x size")
    parser.add_argument("--reps", type=int, default=3, help="timed calls per format (median)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(args.size, args.size, device=device, dtype=dtype)
    moved = 2 * x.nbytes

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(f"fake_quantize on {tuple(x.shape)} {dtype} ({where}), torch {torch.__version__}")
    copy_s = timed(lambda: torch.clone(x), device, args.reps)
    print(f"{'format':<10} {'ms':>9} {'GB/s':>8} {'vs copy':>8}")
    print(f"{'clone':<10} {copy_s * 1e3:9.2f} {moved / copy_s / 1e9:8.2f} {1.0:8.3f}")
    for fmt in FORMATS:
        s = timed(lambda: fake_quantize(x, fmt), device, args.reps)
        print(f"{fmt:<10} {s * 1e3:9.2f} {moved / s / 1e9:8.2f} {copy_s / s:8.3f}")


if __name__ == "__main__":
    main()
