"""SNIP's flags (``--snip-*``), validated once by ``arguments.py``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SnipConfig:
    """Whether and how SNIP re-plans (docs/snip.md)."""

    enabled: bool = field(metadata={"flag": "snip"})
    snip_fp4_target: float | None  # share of linear FLOPs in FP4 (None without --snip)
    snip_time_target: float | None  # estimated linear-GEMM time / all-bf16
    snip_interval: int | None  # iterations between re-plans
    snip_warmup_plan: str | None
    snip_solver: str
    snip_formats: tuple[str, ...]  # candidate precisions
    snip_budget: str  # "per-stage" or "global"
    snip_split_passes: bool
    snip_loss_weight: float  # alpha
    snip_update_weight: float  # beta
    snip_switch_penalty: float
    snip_probe_passes: int

    def due(self, iteration: int) -> bool:
        """Whether a cycle runs after ``iteration``."""
        return self.enabled and iteration % self.snip_interval == 0
