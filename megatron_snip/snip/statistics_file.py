"""A SNIP cycle's statistics file (``snip_iter_N.json``) and the ILP it defines at a budget.

A ``--snip`` run writes one file per cycle next to its checkpoints (docs/snip.md, "The statistics
file"). ``tools/snip_report.py`` plots it, ``tools/snip_solve.py`` re-solves it at other budgets, and
the comparisons in ``snip_lab/`` build every policy's plan from it.

The file is a contract between the run that writes it and every reader: each block is a typed record
from where it is made to where it is read (``run``: :class:`RunSettings`; ``cycle``:
``decisions.CycleReport``; ``statistics``: ``statistics.ProbeStatistics``; ``divergences``:
``estimators.Divergence``), versioned by ``schema_version`` (``statistics.STATISTICS_SCHEMA_VERSION``).
Files of older versions still load: what they lack takes the value the run had then.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_snip.numerics.recipes import Precision, RecipeConfig
from megatron_snip.precision.flops import LlamaLinearDims
from megatron_snip.precision.gemm_speed import peak_speed_model
from megatron_snip.precision.pipeline_layout import PipelineLayout
from megatron_snip.snip.decisions import CycleReport
from megatron_snip.snip.estimators import Divergence, cost_tables
from megatron_snip.snip.ilp import SnipProblem
from megatron_snip.snip.planner import PlannerConfig, build_problem, linear_modules
from megatron_snip.snip.statistics import STATISTICS_SCHEMA_VERSION, ProbeStatistics


@dataclass(frozen=True)
class Budget:
    """An FP4 target (share of linear FLOPs in FP4, at least) or a time target (estimated
    linear-GEMM time / all-BF16 time, at most; the FP4 share is then free)."""

    fp4_target: float = 0.0
    time_target: float | None = None

    @property
    def tag(self) -> str:
        """File-name tag: ``fp4-0.75`` or ``time-0.400``."""
        return f"fp4-{self.fp4_target:.2f}" if self.time_target is None else f"time-{self.time_target:.3f}"

    @property
    def label(self) -> str:
        return (f"FP4 target {self.fp4_target:.2f}" if self.time_target is None
                else f"time target {self.time_target:.3f} x bf16")


@dataclass(frozen=True)
class SpeedModelRecord:
    """The GEMM speed model a run planned with: its name, each format's throughput relative to bf16, and
    where the figures come from (``precision.gemm_speed.GemmSpeedModel``, as recorded)."""

    name: str
    throughput: dict[str, float]
    source: str


@dataclass(frozen=True)
class RunSettings:
    """The statistics file's ``run``: the settings the cycle measured and planned under.

    Attributes:
        dims: the model's linear-layer dimensions.
        tokens: tokens per global batch (the FLOPs of a module scale with them).
        layout: the pipeline layout the per-stage budgets follow (each module's stage; in the file
            ``pipeline_stages``, ``virtual_stages``, ``first_stage_layers``, ``last_stage_layers``).
        formats: the candidate precisions (``--snip-formats``).
        budget: "per-stage" or "global" (``--snip-budget``).
        fp4_target, time_target: the run's budget (``--snip-fp4-target``, ``--snip-time-target``).
        split_passes: forward and backward chosen separately (``--snip-split-passes``).
        speed_model: the GEMM speed model (None in files that predate it).
        speeds: candidate -> GEMM throughput relative to bf16 the ILP used (None: predates it).
        recipe: the numerics recipe (files that predate it: the defaults, as runs then had).
        pins: module -> precision no cycle re-plans (``--first-last-layers-bf16``, a precision config).
    """

    dims: LlamaLinearDims
    tokens: int
    layout: PipelineLayout
    formats: tuple[str, ...]
    budget: str
    fp4_target: float = 0.0
    time_target: float | None = None
    split_passes: bool = False
    speed_model: SpeedModelRecord | None = None
    speeds: dict[str, float] | None = None
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    pins: Mapping[str, Precision] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """The JSON form, its keys in the order the file has always had them (later ones last)."""
        lay = self.layout
        return {"dims": asdict(self.dims), "tokens": self.tokens, "pipeline_stages": lay.pipeline_stages,
                "virtual_stages": lay.virtual_stages, "formats": list(self.formats), "budget": self.budget,
                "fp4_target": self.fp4_target, "time_target": self.time_target, "split_passes": self.split_passes,
                "speed_model": None if self.speed_model is None else asdict(self.speed_model),
                "speeds": self.speeds, "recipe": asdict(self.recipe),
                "pins": {n: str(p) for n, p in self.pins.items()},
                "first_stage_layers": lay.first_stage_layers, "last_stage_layers": lay.last_stage_layers}

    @classmethod
    def from_dict(cls, d: Mapping) -> RunSettings:
        """The inverse of :meth:`to_dict`; keys an older file lacks take their defaults."""
        speed = d.get("speed_model")
        dims = LlamaLinearDims(**d["dims"])
        layout = PipelineLayout(dims.num_layers, d["pipeline_stages"], d.get("virtual_stages", 1),
                                d.get("first_stage_layers"), d.get("last_stage_layers"))
        return cls(dims=dims, tokens=d["tokens"], layout=layout,
                   formats=tuple(d["formats"]), budget=d["budget"], fp4_target=d.get("fp4_target", 0.0),
                   time_target=d.get("time_target"), split_passes=d.get("split_passes", False),
                   speed_model=None if speed is None else SpeedModelRecord(**speed), speeds=d.get("speeds"),
                   recipe=RecipeConfig(**d["recipe"]) if "recipe" in d else RecipeConfig(),
                   pins={n: Precision.parse(p) for n, p in d.get("pins", {}).items()})


@dataclass(frozen=True)
class StatisticsFile:
    """A ``snip_iter_*.json``: the gathered statistics, the run settings they were taken under, and (when
    the cycle finished) what it decided and the divergences it estimated."""

    path: str
    stats: ProbeStatistics
    run: RunSettings
    cycle: CycleReport | None = None
    divergences: dict[str, dict[str, Divergence]] | None = None

    @classmethod
    def load(cls, path: str | Path) -> StatisticsFile:
        """Raises ValueError naming the file when it is not a SNIP statistics file."""
        try:
            record = json.loads(Path(path).read_text())
            version = record.get("schema_version", 0)
        except (OSError, ValueError, AttributeError) as e:
            raise ValueError(f"{path}: not a SNIP statistics file written by a --snip run "
                             f"({type(e).__name__}: {e})") from e
        if version > STATISTICS_SCHEMA_VERSION:
            raise ValueError(f"{path}: statistics file schema version {version} is newer than this program's "
                             f"{STATISTICS_SCHEMA_VERSION}; read it with the megatron-snip that wrote it")
        try:
            cycle, div = record.get("cycle"), record.get("divergences")
            return cls(str(path), ProbeStatistics.from_dict(record["statistics"], source=str(path)),
                       RunSettings.from_dict(record["run"]), CycleReport.from_dict(cycle) if cycle else None,
                       {n: {f: Divergence(**d) for f, d in per.items()} for n, per in div.items()} if div else None)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}: not a SNIP statistics file written by a --snip run "
                             f"({type(e).__name__}: {e})") from e

    def problem(self, budget: Budget, *, formats: Sequence[str] | None = None, per_stage: bool | None = None,
                loss_weight: float = 1.0, update_weight: float = 1.0, solver: str = "auto",
                speed_model: str | None = None) -> SnipProblem:
        """The ILP at ``budget`` with the run's candidates, budget scope and speeds unless given, and
        the run's pins (``--first-last-layers-bf16``, ``--te-precision-config-file`` under ``--snip``).

        Raises :class:`InfeasibleBudgetError` when no plan can meet the budget.
        """
        run = self.run
        formats = tuple(formats or run.formats)
        per_stage = run.budget == "per-stage" if per_stage is None else per_stage
        modules = linear_modules(run.dims, run.tokens, run.layout)
        costs = cost_tables(self.stats, loss_weight, update_weight, formats=formats)
        config = PlannerConfig(formats=formats, fp4_target=budget.fp4_target, per_stage=per_stage, solver=solver,
                               speed=self.speeds(formats, speed_model), time_target=budget.time_target,
                               pins=dict(run.pins))
        return build_problem(modules, costs, config)

    def speeds(self, formats: Sequence[str], speed_model: str | None = None) -> dict[str, float]:
        """precision -> GEMM throughput relative to bf16: the run's, or a published-peak model's."""
        speeds = self.run.speeds
        if speed_model is None and speeds is not None and all(f in speeds for f in formats):
            return {f: speeds[f] for f in formats}
        model = peak_speed_model(speed_model or "auto")
        return dict(model.precision_speeds(RecipeConfig(), formats))  # offline plans use the default recipe

    def speed_model_name(self, speed_model: str | None = None) -> str:
        if speed_model is None and self.run.speed_model is not None:
            return self.run.speed_model.name
        return peak_speed_model(speed_model or "auto").name
