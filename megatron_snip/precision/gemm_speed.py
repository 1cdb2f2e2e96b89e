"""How fast each format's GEMMs run, relative to BF16: the cost model behind time budgets.

A :class:`GemmSpeedModel` gives the GEMM throughput of every quantization scheme
(``registry.SCHEMES``) relative to BF16 on one class of device. A linear module's GEMM
of F FLOPs in precision p then takes an estimated ``F / speed(p)`` BF16-FLOP units of
time, and a plan's estimated linear-GEMM time relative to all-BF16 is
``sum F_i / speed(p_i) / sum F_i`` (``flops.estimated_time_ratio``). These are
*estimates*: peak tensor-core throughput ratios (dense, published by NVIDIA), or ratios
measured at the model's shapes on this device (:func:`measure_gemm_speed`); they leave
out everything that is not a linear GEMM.

Published dense peaks behind the tables (TFLOP/s, per GPU; docs/ilp.md cites them):

======== ======== ======== ============== ============================================
model    BF16     FP8      FP4            devices
======== ======== ======== ============== ============================================
hopper   989      1979     - (emulated)   H100 / H200 SXM (sm_90): no FP4, no MX formats
blackwell 2250    4500     9000           B200 (sm_100): FP8, MXFP8, NVFP4, MXFP4
ada      362      733      - (emulated)   L40S (sm_89): FP8 tensor cores, no FP4
ampere   312      -        -              A100 (sm_80): no FP8 tensor cores
======== ======== ======== ============== ============================================

A scheme the device has no tensor cores for runs emulated (quantize-dequantize, then a
BF16-or-wider GEMM): no gain, ratio 1.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from megatron_snip.compat.device import has_cuda
from megatron_snip.numerics.recipes import PRECISION_NAMES, Precision, RecipeConfig, operand_quantizer
from megatron_snip.numerics.registry import SCHEME_NAMES, SCHEMES, precision_format
from megatron_snip.precision.config import SPEED_MODELS


@dataclass(frozen=True)
class GemmSpeedModel:
    """GEMM throughput per quantization scheme, relative to BF16 (= 1).

    Attributes:
        name: "hopper", "blackwell", ..., or "measured".
        throughput: scheme name -> relative throughput (> 0) for every registered scheme.
        source: where the numbers come from (for the start-up log and reports).
    """

    name: str
    throughput: Mapping[str, float]
    source: str
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self):
        missing = [s for s in SCHEME_NAMES if s not in self.throughput]
        if missing:
            raise ValueError(f"GEMM speed model {self.name!r}: no throughput for scheme(s) {missing}")
        bad = {s: v for s, v in self.throughput.items() if not v > 0}
        if bad:
            raise ValueError(f"GEMM speed model {self.name!r}: throughputs must be > 0, got {bad}")
        object.__setattr__(self, "throughput", MappingProxyType(dict(self.throughput)))

    def precision_speed(self, name: str, recipe: RecipeConfig) -> float:
        """Relative throughput of precision ``name``'s GEMMs under ``recipe`` (the scheme of its
        fprop operands decides: a recipe uses one scheme family for all three GEMMs)."""
        return self.throughput[operand_quantizer(name, "fprop", "x", recipe).scheme]

    def precision_speeds(self, recipe: RecipeConfig, names: Iterable[str] = PRECISION_NAMES) -> dict[str, float]:
        """Precision name -> relative throughput, the form the ILP's ``speed`` takes."""
        return {n: self.precision_speed(n, recipe) for n in names}

    def describe(self) -> str:
        table = ", ".join(f"{s} {v:.3g}" for s, v in self.throughput.items() if SCHEMES[s].quantized)
        return f"{self.name} ({self.source}): GEMM throughput vs bf16: {table}"


def _peak_model(name: str, fp8: float, fp8_block: float, mx8: float, fp4: float, source: str) -> GemmSpeedModel:
    return GemmSpeedModel(name, {"bf16": 1.0, "fp8_tensorwise": fp8, "fp8_delayed": fp8, "fp8_block": fp8_block,
                                 "mxfp8": mx8, "nvfp4": fp4, "mxfp4": fp4}, source)


PEAK_MODELS: dict[str, GemmSpeedModel] = {m.name: m for m in (
    _peak_model("hopper", 2.0, 2.0, 1.0, 1.0, "published dense peaks of H100/H200: FP8 1979 vs BF16 989 TFLOP/s; "
                "no FP4 or MX tensor cores (emulated: no gain)"),
    _peak_model("blackwell", 2.0, 2.0, 2.0, 4.0, "published dense peaks of B200: FP4 9, FP8/MXFP8 4.5, BF16 2.25 "
                "PFLOP/s"),
    _peak_model("ada", 2.0, 2.0, 1.0, 1.0, "published dense peaks of L40S: FP8 733 vs BF16 362 TFLOP/s; no FP4 or MX "
                "tensor cores"),
    _peak_model("ampere", 1.0, 1.0, 1.0, 1.0, "A100: no FP8 or FP4 tensor cores (every quantized GEMM emulated)"),
)}


def detect_speed_model(device: torch.device | None = None) -> tuple[str, str]:
    """(model name, why) for ``--gemm-speed-model auto``: from the CUDA compute capability; without
    a GPU, blackwell (the hardware FP4 plans are made for)."""
    if not has_cuda():
        return "blackwell", "no CUDA device here: estimating for blackwell, the hardware with FP4 tensor cores"
    major, minor = torch.cuda.get_device_capability(device)
    name = torch.cuda.get_device_name(device)
    if major >= 10:
        return "blackwell", f"{name} (sm_{major}{minor})"
    if major == 9:
        return "hopper", f"{name} (sm_{major}{minor})"
    if (major, minor) >= (8, 9):
        return "ada", f"{name} (sm_{major}{minor})"
    return "ampere", f"{name} (sm_{major}{minor}): no FP8 tensor cores"


def peak_speed_model(name: str) -> GemmSpeedModel:
    """A published-peak model by name ("auto" detects the device)."""
    if name == "auto":
        name, why = detect_speed_model()
        model = PEAK_MODELS[name]
        return GemmSpeedModel(model.name, model.throughput, model.source, notes=(f"auto: {why}",))
    if name not in PEAK_MODELS:
        raise ValueError(f"unknown GEMM speed model {name!r}; valid: {', '.join(SPEED_MODELS)}")
    return PEAK_MODELS[name]


def _time_gemms(fn, repeats: int, device: torch.device) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs, after one warm-up."""
    fn()
    seconds = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    return sorted(seconds)[len(seconds) // 2]


def measure_gemm_speed(shapes: Iterable[tuple[int, int, int]], recipe: RecipeConfig, *,
                       device: torch.device, dtype: torch.dtype = torch.bfloat16, repeats: int = 3,
                       names: Iterable[str] = PRECISION_NAMES) -> GemmSpeedModel:
    """Time each precision's three GEMMs (fprop, dgrad, wgrad: the layers' own quantized code) at
    ``shapes`` on ``device`` and return the FLOP-weighted throughputs relative to BF16.

    Args:
        shapes: (tokens, in_features, out_features) of each linear GEMM to time, e.g. every module
            type's per-rank shape for one micro-batch.
        dtype: the activations' and weights' dtype (the training dtype); BF16 is timed as a plain
            linear layer in it (megatron-core's path for a bf16 module).
    Returns:
        a model named "measured"; schemes not among ``names``' fprop schemes copy BF16 (ratio 1).
    """
    from megatron_snip.numerics.linear import QuantState, quantized_linear

    shapes = list(shapes)
    generator = torch.Generator(device="cpu").manual_seed(0)
    tensors = []
    for tokens, fan_in, fan_out in shapes:
        x, w, dy = (torch.randn(*s, generator=generator).to(device=device, dtype=dtype)
                    for s in ((tokens, fan_in), (fan_out, fan_in), (tokens, fan_out)))
        tensors.append((x.requires_grad_(), w.requires_grad_(), dy))

    def run(name: str):
        def once():
            for x, w, dy in tensors:
                if not precision_format(name).quantized:
                    y = torch.nn.functional.linear(x, w)
                else:
                    y = quantized_linear(x, w, Precision.uniform(name), recipe, state)
                torch.autograd.grad(y, (x, w), dy)
        state = QuantState(seed=0)
        return once

    seconds = {n: _time_gemms(run(n), repeats, device) for n in names}
    throughput = dict.fromkeys(SCHEME_NAMES, 1.0)
    for n in names:
        throughput[operand_quantizer(n, "fprop", "x", recipe).scheme] = seconds["bf16"] / seconds[n]
    kind = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (emulated formats)"
    return GemmSpeedModel("measured", throughput, f"measured on {kind} at {len(shapes)} GEMM shape(s), "
                          f"median of {repeats}")
