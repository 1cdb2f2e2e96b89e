"""Throughput of fake_quantize per format, relative to copying the same bytes.

    python bench/quantize_bench.py                 # 4096x4096, fp32 on CPU / bf16 on CUDA
    python bench/quantize_bench.py --size 2048 --reps 5 --device cpu

For each format: median wall time of fake_quantize(x, fmt) (activation role,
round-to-nearest), the effective bandwidth 2 * x.nbytes / time (the tensor is
read once and the result written once, the minimum any kernel must move), and
its throughput as a ratio of ``torch.clone(x)``'s, which moves exactly those
bytes (copy time / quantize time; 1.0 = as fast as a copy; goal on GPU >= 0.5).

On CUDA it then times the fused Triton kernels the quantized linear uses for
its operands (``numerics/triton_qdq.py``; per-tensor amaxes included). They
read the operand and write fp32, so their baseline is ``x.float()``, a copy
that moves the same bytes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from results import goal, write_json
from timing import device_name, median_seconds

from megatron_snip.numerics import FORMATS, fake_quantize

ROOT = Path(__file__).resolve().parents[1]

KERNEL_GOAL = 0.5  # fused kernel throughput / copy throughput, on a GPU


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096, help="tensor is size x size")
    parser.add_argument("--reps", type=int, default=3, help="timed calls per format (median)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", help="also write the results here (for bench/gpu_suite.py)")
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(args.size, args.size, device=device, dtype=dtype)
    moved = 2 * x.nbytes

    print(f"fake_quantize on {tuple(x.shape)} {dtype} ({device_name()}), torch {torch.__version__}")
    copy_s = median_seconds(lambda: torch.clone(x), device, args.reps)
    print(f"{'format':<10} {'ms':>9} {'GB/s':>8} {'vs copy':>8}")
    print(f"{'clone':<10} {copy_s * 1e3:9.2f} {moved / copy_s / 1e9:8.2f} {1.0:8.3f}")
    reference = {}
    for fmt in FORMATS:
        s = median_seconds(lambda: fake_quantize(x, fmt), device, args.reps)
        reference[fmt] = copy_s / s
        print(f"{fmt:<10} {s * 1e3:9.2f} {moved / s / 1e9:8.2f} {copy_s / s:8.3f}")
    result = {"benchmark": "quantize", "device": device_name(), "shape": list(x.shape), "dtype": str(dtype),
              "reference_vs_copy": reference, "kernels_vs_copy": {}, "goals": []}
    if device.type != "cuda":
        print("fused Triton kernels: need CUDA (their bits are checked on CPU by tests/test_triton_qdq.py)")
        write_json(args.json, result)
        return
    kernels = triton_operand_quantizers(x)
    moved = x.nbytes + 4 * x.numel()
    cast_s = median_seconds(lambda: x.float(), device, args.reps)
    print(f"fused Triton kernels, {dtype} in, fp32 out (goal >= {KERNEL_GOAL} of the copy)")
    print(f"{'x.float()':<10} {cast_s * 1e3:9.2f} {moved / cast_s / 1e9:8.2f} {1.0:8.3f}")
    for name, fn in kernels.items():
        s = median_seconds(fn, device, args.reps)
        result["kernels_vs_copy"][name] = cast_s / s
        result["goals"].append(goal(f"fused {name} kernel throughput vs copy", cast_s / s, at_least=KERNEL_GOAL))
        print(f"{name:<10} {s * 1e3:9.2f} {moved / s / 1e9:8.2f} {cast_s / s:8.3f}")
    write_json(args.json, result)


def triton_operand_quantizers(x: torch.Tensor) -> dict:
    """Format name -> a call of its fused kernel on ``x`` (activation role, as in fprop)."""
    from megatron_snip.numerics import triton_qdq
    from megatron_snip.numerics.blocks import tensor_amax
    from megatron_snip.numerics.formats import E2M1, E4M3, E5M2
    from megatron_snip.numerics.fp8 import fp8_scale_from_amax

    generator = torch.Generator(device=x.device).manual_seed(0)

    def tensorwise(fmt):
        return lambda: triton_qdq.qdq_fp8_tensorwise(x, fp8_scale_from_amax(tensor_amax(x).float(), fmt), fmt)

    return {
        "fp8_e4m3": tensorwise(E4M3),
        "fp8_e5m2": tensorwise(E5M2),
        "fp8_block": lambda: triton_qdq.qdq_fp8_block(x),
        "mxfp8": lambda: triton_qdq.qdq_mx(x, E4M3, scale_rule="ceil"),
        "nvfp4": lambda: triton_qdq.qdq_nvfp4(x, block=(1, 16), global_amax=tensor_amax(x).float()),
        "mxfp4": lambda: triton_qdq.qdq_mx(x, E2M1, scale_rule="ocp"),
        # Gradients: stochastic rounding (the random numbers are drawn by the kernel call too).
        "nvfp4_sr": lambda: triton_qdq.qdq_nvfp4(x, block=(1, 16), global_amax=tensor_amax(x).float(),
                                                 stochastic=True, generator=generator),
        "mxfp4_sr": lambda: triton_qdq.qdq_mx(x, E2M1, scale_rule="ocp", stochastic=True, generator=generator),
    }


if __name__ == "__main__":
    main()
