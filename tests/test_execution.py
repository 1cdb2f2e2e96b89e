"""Which kernel runs each precision's GEMMs on each device (the start-up line's claims)."""

from __future__ import annotations

import pytest

from megatron_snip.numerics.recipes import RecipeConfig
from megatron_snip.precision.execution import SIMULATED, describe_execution, gemm_execution

ALL = ("bf16", "fp8", "nvfp4", "mxfp4")
CPU, A100, H100, B200 = None, (8, 0), (9, 0), (10, 0)


def test_on_cpu_every_low_precision_gemm_is_simulated():
    got = gemm_execution(ALL, RecipeConfig(), "local", CPU)
    assert got == {"bf16": "real: fp32/bf16 GEMM on the CPU", "fp8": SIMULATED, "nvfp4": SIMULATED, "mxfp4": SIMULATED}


SCALED_MM = "real: torch._scaled_mm FP8 tensor cores"
BLOCK_GEMM = ("real where torch's block-scaled GEMM agrees with the emulation at first use (checked per shape), else "
              "simulated")


@pytest.mark.parametrize("capability,fp8_recipe,fp8_gemm,fp8", [
    (H100, "tensorwise", "auto", SCALED_MM),
    (H100, "delayed", "auto", SCALED_MM),
    (H100, "rowwise", "auto", SCALED_MM),
    (H100, "blockwise", "auto", BLOCK_GEMM),  # cuBLAS's 1x128 / 128x128 scales: sm_90 only
    (B200, "blockwise", "auto", SIMULATED),
    (H100, "mxfp8", "auto", SIMULATED),
    (H100, "tensorwise", "emulated", SIMULATED),
    (A100, "tensorwise", "auto", SIMULATED),  # no FP8 tensor cores
])
def test_local_backend_runs_per_tensor_fp8_on_scaled_mm_only(capability, fp8_recipe, fp8_gemm, fp8):
    got = gemm_execution(ALL, RecipeConfig(fp8_recipe=fp8_recipe, fp8_gemm=fp8_gemm), "local", capability)
    assert got["fp8"] == fp8
    assert got["nvfp4"] == got["mxfp4"] == SIMULATED and got["bf16"] == "real: bf16 GEMM"


def test_transformer_engine_runs_what_the_gpu_has_tensor_cores_for():
    hopper = gemm_execution(ALL, RecipeConfig(), "transformer_engine", H100)
    assert hopper["fp8"] == "real: Transformer Engine fp8 (tensorwise) tensor cores"
    assert hopper["nvfp4"] == "not run by Transformer Engine on this GPU (needs compute capability 10.0)"
    assert hopper["mxfp4"] == "not run by Transformer Engine"
    blackwell = gemm_execution(ALL, RecipeConfig(fp8_recipe="mxfp8"), "transformer_engine", B200)
    assert blackwell["nvfp4"] == "real: Transformer Engine nvfp4 tensor cores"
    assert blackwell["fp8"] == "real: Transformer Engine fp8 (mxfp8) tensor cores"
    assert "needs compute capability 10.0" in gemm_execution(
        ["fp8"], RecipeConfig(fp8_recipe="mxfp8"), "transformer_engine", H100)["fp8"]


def test_the_line_names_each_precision_once():
    line = describe_execution(gemm_execution(["bf16", "nvfp4", "nvfp4"], RecipeConfig(), "local", CPU))
    assert line == f"GEMM kernels on this device: bf16 real: fp32/bf16 GEMM on the CPU; nvfp4 {SIMULATED}"
