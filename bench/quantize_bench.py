"""Throughput of fake_quantize per format, relative to copying the same bytes.

    python bench/quantize_bench.py                 # 4096x4096, fp32 on CPU / bf16 on CUDA
    python bench/quantize_bench.py --size 2048 --reps 5 --device cpu

For each format: median wall time of fake_quantize(x, fmt) (activation role,
round-to-nearest), the effective bandwidth 2 * x.nbytes / time (the tensor is
read once and the result written once, the minimum any kernel must move), and
its throughput as a ratio of ``torch.clone(x)``'s, which moves exactly those
bytes (copy time / quantize time; 1.0 = as fast as a copy; goal on GPU >= 0.5).

On CUDA it then times the fused Triton kernels the quantized linear uses for
its operands (``precision/triton_qdq.py``; per-tensor amaxes included). They
read the operand and write fp32, so their baseline is ``x.float()``, a copy
that moves the same bytes.
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
    if device.type != "cuda":
        print("fused Triton kernels: need CUDA (their bits are checked on CPU by tests/test_triton_qdq.py)")
        return
    kernels = triton_operand_quantizers(x)
    moved = x.nbytes + 4 * x.numel()
    cast_s = timed(lambda: x.float(), device, args.reps)
    print(f"fused Triton kernels, {dtype} in, fp32 out")
    print(f"{'x.float()':<10} {cast_s * 1e3:9.2f} {moved / cast_s / 1e9:8.2f} {1.0:8.3f}")
    for name, fn in kernels.items():
        s = timed(fn, device, args.reps)
        print(f"{name:<10} {s * 1e3:9.2f} {moved / s / 1e9:8.2f} {cast_s / s:8.3f}")


def triton_operand_quantizers(x: torch.Tensor) -> dict:
    """Format name -> a call of its fused kernel on ``x`` (activation role, as in fprop)."""
    from megatron_snip.precision import triton_qdq
    from megatron_snip.precision.blocks import tensor_amax
    from megatron_snip.precision.formats import E2M1, E4M3, E5M2
    from megatron_snip.precision.fp8 import fp8_scale_from_amax

    def tensorwise(fmt):
        return lambda: triton_qdq.qdq_fp8_tensorwise(x, fp8_scale_from_amax(tensor_amax(x).float(), fmt), fmt)

    return {
        "fp8_e4m3": tensorwise(E4M3),
        "fp8_e5m2": tensorwise(E5M2),
        "fp8_block": lambda: triton_qdq.qdq_fp8_block(x),
        "mxfp8": lambda: triton_qdq.qdq_mx(x, E4M3, scale_rule="ceil"),
        "nvfp4": lambda: triton_qdq.qdq_nvfp4(x, block=(1, 16), global_amax=tensor_amax(x).float()),
        "mxfp4": lambda: triton_qdq.qdq_mx(x, E2M1, scale_rule="ocp"),
    }


if __name__ == "__main__":
    main()
