"""The run's precision flags: how each format is realised, and where the first plan comes from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_snip.flags import derived, flag, flag_values
from megatron_snip.numerics.registry import FP4_NAMES, FP8_RECIPE_SCHEMES, PRECISION_NAMES

if TYPE_CHECKING:  # numerics.recipes imports torch; --help does not
    from megatron_snip.numerics.recipes import RecipeConfig

# --gemm-speed-model: whose GEMM throughputs the estimated time uses (gemm_speed.py).
SPEED_MODELS = ("auto", "hopper", "blackwell", "ada", "ampere", "measured")

# What the recipe flags mean when neither given nor kept by a resumed checkpoint (validation fills
# them in); the same as RecipeConfig's own defaults (tests/test_config_file.py checks).
RECIPE_DEFAULTS = {"fp8_recipe": "tensorwise", "fp8_format": "hybrid", "fp8_amax_history_len": 1,
                   "fp8_amax_compute_algo": "most_recent", "fp8_margin": 0, "fp4_recipe": "nvfp4",
                   "fp4_disable_stochastic_rounding": False, "nvfp4_disable_rht": False,
                   "nvfp4_disable_2d_quantization": False}


@dataclass(frozen=True)
class PrecisionConfig:
    """``--precision``, the recipe flags (Megatron / Transformer Engine names), plans and schedules.

    The recipe flags default to None: on resume the checkpoint's values are kept unless a flag is
    given (then it wins, and the start-up log says so); otherwise :data:`RECIPE_DEFAULTS`."""

    precision: str | None = flag(
        None, "Uniform precision of every linear module's GEMMs (default bf16, or on resume the checkpoint's plan; "
        "given, it replaces the checkpoint's plan; fp4 means --fp4-recipe). Embedding, output layer, norms and "
        "attention stay high precision.", choices=(*PRECISION_NAMES, "fp4"), ours=True)
    fp8_recipe: str | None = flag(
        None, "How fp8 is scaled (default tensorwise, not Megatron-LM's delayed: stateless, so a module that switches "
        "to fp8 mid-run is scaled right from its first step; a start-up notice says so where Megatron-LM's flags "
        "would mean delayed scaling). rowwise (ours, torchao's float8 rowwise: a power-of-two scale per row of each "
        "GEMM's reduction dim, E4M3 throughout) runs on torch._scaled_mm like tensorwise; Transformer Engine has no "
        "rowwise recipe. It is what precision fp8 means; fp8:RECIPE (in plans, --precision, --snip-formats) runs "
        "RECIPE in that module whatever this says.", choices=tuple(FP8_RECIPE_SCHEMES))
    fp8_format: str | None = flag(
        None, "E4M3 forward / E5M2 gradients (hybrid, default) or E4M3 everywhere. As in Megatron, giving it without "
        "--precision selects --precision fp8.", choices=("hybrid", "e4m3"))
    fp8_amax_history_len: int | None = flag(
        None, "Delayed scaling (--fp8-recipe delayed): amaxes kept per operand (default 1, as in Megatron-LM).")
    fp8_amax_compute_algo: str | None = flag(
        None, "Delayed scaling (--fp8-recipe delayed): the scale follows the history's max or its most recent amax "
        "(default most_recent, as in Megatron-LM).", choices=("max", "most_recent"))
    fp8_margin: int | None = flag(None, "Delayed scaling (--fp8-recipe delayed): headroom in binades (default 0).")
    fp4_recipe: str | None = flag(
        None, "The 4-bit format that --precision fp4, --fp4-format and SNIP use (default nvfp4). Given on resume, the "
        "checkpoint plan's FP4 modules run in it.", choices=FP4_NAMES)
    fp4_format: str | None = flag(
        None, "Megatron-LM's FP4 switch: as --precision fp4 (the format --fp4-recipe names); not with --fp8-format.",
        choices=("e2m1",))
    # Transformer Engine's NVFP4 switches (NVTE_NVFP4_DISABLE_*), honoured by every backend and by
    # SNIP's probes, which measure each candidate format exactly as it will run.
    fp4_disable_stochastic_rounding: bool | None = flag(
        None, "Round FP4 gradients (dY) to nearest instead of stochastically (TE: "
        "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING=1). Default: stochastic, as TE's recipe.", negatable=True, ours=True)
    nvfp4_disable_rht: bool | None = flag(
        None, "No random Hadamard transform of the NVFP4 wgrad operands (TE: NVTE_NVFP4_DISABLE_RHT=1).",
        negatable=True, ours=True)
    nvfp4_disable_2d_quantization: bool | None = flag(
        None, "1x16 NVFP4 weight blocks along each GEMM's reduction dim instead of 16x16 tiles (TE: "
        "NVTE_NVFP4_DISABLE_2D_QUANTIZATION=1).", negatable=True, ours=True)
    first_last_layers_bf16: bool = flag(
        False, "Keep the first/last layers' linear modules in bf16 (see the next two flags); with --snip they are "
        "pins SNIP never re-plans, counted in its budgets.")
    num_layers_at_start_in_bf16: int = flag(1, "Layers at the start kept in bf16 by --first-last-layers-bf16.")
    num_layers_at_end_in_bf16: int = flag(1, "Layers at the end kept in bf16 by --first-last-layers-bf16.")
    precision_plan: str | None = flag(
        None, "JSON plan: precision per module (replaces a checkpoint's plan; not with --precision).", ours=True)
    te_precision_config_file: str | None = flag(
        None, "Megatron-LM's per-module precision config (megatron-core quantization/quant_config.py: glob matchers "
        "over stage-local module paths -> Transformer Engine recipes; docs/snip.md). Read by megatron-core's parser "
        "on either --transformer-impl. Without --snip it sets the plan (not with --precision-plan) over --precision "
        "(default bf16) and --first-last-layers-bf16, as in Megatron-LM; with --snip the modules it sets are pins "
        "SNIP never re-plans.", metavar="FILE.yaml")
    precision_schedule: tuple[str, ...] | None = flag(
        None, "From a step on, fix some GEMMs of every module, e.g. fwd=bf16@0.82 (the NVFP4 recipe's last 18%% of "
        "training with bf16 forward GEMMs), all=fp8@9000, bwd=fp8@90%%. PASSES: fwd, bwd or all; START: a step or a "
        "fraction of --train-iters. Overrides the plan for those passes; SNIP plans the rest. Saved in checkpoints "
        "(given on resume, it replaces theirs).", metavar="PASSES=PRECISION@START", ours=True)
    quant_kernels: str = flag(
        "auto", "Who quantizes the GEMM operands: fused Triton kernels (bit-identical to the torch reference) or the "
        "torch reference; auto = triton on CUDA when it imports.", choices=("auto", "triton", "torch"), ours=True)
    fp8_gemm: str = flag(
        "auto", "Per-tensor and rowwise FP8 GEMMs on the FP8 bytes with torch._scaled_mm (tensor cores) or emulated in "
        "fp32; auto = scaled_mm on GPUs with FP8 tensor cores (sm_89+).", choices=("auto", "scaled_mm", "emulated"),
        ours=True)
    gemm_speed_model: str = flag(
        "measured", "GEMM throughput of each format relative to bf16, for the GEMM time ratio the logs report and "
        "--snip-time-target budgets: measured (default): every linear shape of the model timed forward and backward "
        "in every precision on this device at start-up, through the path training runs (real kernels or emulation; "
        "cached in $MEGATRON_SNIP_CACHE, default ~/.cache/megatron_snip); or, to plan ahead for hardware one does "
        "not have, the published dense peaks of hopper (FP8 2x, FP4 emulated 1x), blackwell (FP8 2x, FP4 4x), ada "
        "(FP8 2x), ampere (1x), or auto (from the GPU; blackwell without one), labelled estimates.",
        choices=SPEED_MODELS, ours=True)
    precision_notes: tuple[str, ...] = derived(())  # where a given recipe flag replaces a resumed checkpoint's

    def recipe(self) -> RecipeConfig:
        """How fp8 / nvfp4 / mxfp4 are realised."""
        from megatron_snip.numerics.recipes import RecipeConfig

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

    def file_values(self) -> dict:
        """The flag values a config file states. --fp8-format is a switch as well as a format in
        Megatron-LM (given alone it turns fp8 on; it excludes --fp4-format): without a uniform
        --precision, or with --fp4-format, it was not given, so its filled-in value is left out."""
        values = flag_values(self)
        if self.precision is None or self.fp4_format is not None:
            del values["fp8_format"]
        return values

    def alias(self, name: str) -> str:
        """A precision name with "fp4" meaning ``--fp4-recipe``."""
        return self.fp4_recipe if name == "fp4" else name
