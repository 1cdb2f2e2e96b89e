"""The run's precision flags: how each format is realised, and where the first plan comes from."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_snip.precision.recipes import RecipeConfig


@dataclass(frozen=True)
class PrecisionConfig:
    """``--precision``, the recipe flags (Megatron / Transformer Engine names), plans and schedules."""

    precision: str | None  # uniform precision of every linear module; None: the checkpoint's plan or bf16
    fp8_recipe: str
    fp8_format: str
    fp8_amax_history_len: int
    fp8_amax_compute_algo: str
    fp8_margin: int
    fp4_recipe: str  # nvfp4 or mxfp4: what "fp4" means
    fp4_disable_stochastic_rounding: bool
    nvfp4_disable_rht: bool
    nvfp4_disable_2d_quantization: bool
    first_last_layers_bf16: bool
    num_layers_at_start_in_bf16: int
    num_layers_at_end_in_bf16: int
    precision_plan: str | None  # a plan JSON file
    te_precision_config_file: str | None  # megatron-core per-module precision YAML: the plan, or SNIP's pins
    precision_schedule: tuple[str, ...] | None  # PASSES=PRECISION@START entries
    quant_kernels: str
    fp8_gemm: str
    gemm_speed_model: str
    precision_notes: tuple[str, ...]  # where a given recipe flag replaces a resumed checkpoint's (start-up log)

    def recipe(self) -> RecipeConfig:
        """How fp8 / nvfp4 / mxfp4 are realised."""
        return RecipeConfig(
            fp8_recipe=self.fp8_recipe,
            fp8_format=self.fp8_format,
            fp8_amax_history_len=self.fp8_amax_history_len,
            fp8_amax_compute_algo=self.fp8_amax_compute_algo,
            fp8_margin=self.fp8_margin,
            fp4_stochastic_rounding=not self.fp4_disable_stochastic_rounding,
            nvfp4_random_hadamard=not self.nvfp4_disable_rht,
            nvfp4_2d_weights=not self.nvfp4_disable_2d_quantization,
            kernels=self.quant_kernels,
            fp8_gemm=self.fp8_gemm,
        )

    def alias(self, name: str) -> str:
        """A precision name with "fp4" meaning ``--fp4-recipe``."""
        return self.fp4_recipe if name == "fp4" else name
