"""What one SNIP probe cycle measures: plain dataclasses, serialisable to JSON.

A cycle (``probes.run_probe_cycle``) produces one :class:`ProbeStatistics` per
pipeline stage holding that stage's modules; ``probes.gather_across_pipeline``
merges them into one for the whole model. All sums run over the probe batch
(every micro-batch of one data-parallel rank), are complete over the
tensor-parallel shards of a module, and are averaged over data-parallel ranks.
Names are global plan names (``decoder.layers.{i}.mlp.linear_fc1``).

Units: X, Y, W in their own units; ``dY = dL/dY`` (loss / Y-unit) of the loss the
schedule backpropagates (the micro-batch mean divided by the number of
micro-batches, loss scaling removed). See ``docs/snip.md``.

JSON form (``version`` 3; version 2 lacks ``FormatErrors.propagated``, version 1 also
``operand_sq``)::

    {"version": 3, "iteration": 1200, "formats": ["fp8", "nvfp4", "mxfp4"],
     "loss": 3.21, "update_sq": 1.7e-3, "data_parallel_size": 8, ...,
     "modules": {"decoder.layers.0.self_attention.linear_qkv": {...}, ...}}
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from megatron_snip.precision.plan import LINEAR_MODULES, parse_module_name

# Version of the snip_iter_N.json layout a --snip run writes (docs/snip.md, "The statistics file");
# files without the field are version 0 (the same layout, without "decisions" in the cycle report).
STATISTICS_SCHEMA_VERSION = 1

# 2: FormatErrors.operand_sq; 3: FormatErrors.propagated and settings["update_metric"] (older files load:
# their update terms are the paper's metric, their propagated part the isotropic gain's)
STATS_VERSION = 3
READABLE_STATS_VERSIONS = (1, 2, 3)


@dataclass
class FormatErrors:
    """Exact quantization errors of one module in one format, on the clean pass's tensors.

    Attributes:
        output_sq: ``||E_f||^2``, ``E_f = Q(X) Q(W)^T - X W^T`` (fprop error; Y-units^2).
        first_order: ``<dY, E_f>``, the exact first-order loss change on the probe batch (loss
            units). A diagnostic: its sign follows the batch and the step, so it averages out
            over training and is left out of the cost.
        input_grad_sq: ``||eX_f||^2``, ``eX_f = Q(dY) Q(W) - dY W`` (dgrad error; (loss/X)^2).
        update_sq: ``||R * eW_f||^2``, ``eW_f = Q(dY)^T Q(X) - dY^T X`` (wgrad error) weighted
            by ``R``, Adam's response ``P~ = du/dg`` in the update metric (``settings["update_metric"]``;
            ``P~`` itself in the paper's): the squared drift of this module's weight update.
        operand_sq: the operands' own quantization errors, ``{"x": ||Q(X) - X||^2, "w": ||Q(W) - W||^2,
            "dy": ||Q(dY) - dY||^2}`` with fprop's X and W quantizers and dgrad's dY quantizer
            (X and dY summed over the probe micro-batches like ``input_sq`` and ``output_grad_sq``;
            W once, like ``weight_sq``): what the SNIP paper's quantization-error baselines sum.
            None in statistics version 1, which did not measure them.
        propagated: the drift of the lower parameters' update that the dgrad error eX_f causes,
            ``||R * J^T eX_f||^2`` (J = dX / d(parameters below), R the update metric's response, the
            error of the batch's data-parallel-mean gradient), the mean of ``propagated_probes``: the
            squared ``<J R w_k, e>`` of each parameter perturbation draw k (docs/snip.md), for e all of eX_f
            where dgrad rounds dY to nearest, and its mean over the rounding, ``dY (Q(W) - W)``, where it rounds
            dY stochastically. None in statistics before version 3, whose propagated part was
            ``gain * ||eX||^2 / numel(X)``.
        input_grad_noise_sq: where dgrad rounds dY stochastically, ``||eX_f - dY (Q(W) - W)||^2``: the part of
            the dgrad error drawn afresh at every step, independent from element to element, whose propagated
            drift is ``gain * input_grad_noise_sq / numel(X)``; None where dY rounds to nearest.
    """

    output_sq: float
    first_order: float
    input_grad_sq: float
    update_sq: float
    operand_sq: dict[str, float] | None = None
    propagated: float | None = None
    propagated_probes: list[float] = field(default_factory=list)
    input_grad_noise_sq: float | None = None


@dataclass
class ModuleStatistics:
    """One linear module's probe statistics.

    Attributes:
        name: global plan name.
        layer: 0-based global layer index.
        stage: pipeline stage holding it.
        in_features, out_features: unsharded weight shape (out, in).
        input_numel, output_numel: elements of X and Y over the probe batch.
        input_sq, weight_sq, output_sq, output_grad_sq: ``||X||^2``, ``||W||^2``, ``||Y||^2``,
            ``||dY||^2`` of the clean pass.
        curvature: estimate of ``tr(d^2 L / dY^2)`` (loss / Y-unit^2): the Hutchinson one, the
            mean of ``curvature_probes`` (one value per noise draw), or with
            ``settings["curvature"]`` "fisher" the empirical Fisher's (``curvature_probes`` empty).
        gain: estimate of ``||J R||_F^2``, J = dX / d(parameters below), the preconditioned
            gain of lower layers' updates w.r.t. the module input (R: ``FormatErrors.update_sq``); the
            mean of ``gain_probes``. Versions 3 on, a diagnostic: the propagated part is
            ``FormatErrors.propagated``, which, unlike ``gain * ||eX||^2 / numel(X)``, assumes nothing of
            eX's direction.
        errors: format -> :class:`FormatErrors` for each measured format.
        unsupported: format -> why this module cannot run it (not measured).
    """

    name: str
    layer: int
    stage: int
    in_features: int
    out_features: int
    input_numel: float
    output_numel: float
    input_sq: float
    weight_sq: float
    output_sq: float
    output_grad_sq: float
    curvature: float
    curvature_probes: list[float]
    gain: float
    gain_probes: list[float]
    errors: dict[str, FormatErrors]
    unsupported: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict) -> ModuleStatistics:
        data = dict(data)
        data["errors"] = {f: FormatErrors(**e) for f, e in data["errors"].items()}
        return cls(**data)


@dataclass
class ProbeStatistics:
    """One probe cycle's statistics (one pipeline stage's modules, or all after gathering).

    Attributes:
        modules: global name -> :class:`ModuleStatistics`.
        formats: the candidate formats measured (bf16, the reference, is never measured).
        loss: the clean loss (mean over micro-batches and data-parallel ranks); None on
            stages other than the last until gathered.
        update_sq: ``||u||^2`` of the clean Adam update of the whole model (all stages and
            shards; weight decay excluded), in the update metric (:attr:`update_metric`).
        data_parallel_size: D, the number of data-parallel ranks averaged.
        num_microbatches, micro_batch_size, seq_length: the probe batch per rank.
        iteration: training iteration of the cycle (None if not given).
        settings: the probe settings used (``ProbeConfig`` as a dict, plus the noise scales).
        stages: pipeline stages whose modules are held.
        version: format version of the JSON form.
    """

    modules: dict[str, ModuleStatistics]
    formats: list[str]
    loss: float | None
    update_sq: float
    data_parallel_size: int
    num_microbatches: int
    micro_batch_size: int
    seq_length: int
    iteration: int | None = None
    settings: dict = field(default_factory=dict)
    stages: list[int] = field(default_factory=list)
    version: int = STATS_VERSION

    @property
    def tokens(self) -> int:
        """Tokens of the global batch: the probe batch of every data-parallel replica."""
        return self.num_microbatches * self.micro_batch_size * self.seq_length * self.data_parallel_size

    @property
    def update_metric(self) -> str:
        """How the update terms measure a drift (``estimators.metric_scale``): the probe setting, "paper"
        for statistics before version 3, which had no other."""
        return self.settings.get("update_metric", "paper")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, source: str = "statistics") -> ProbeStatistics:
        if data.get("version") not in READABLE_STATS_VERSIONS:
            raise ValueError(f"{source}: unsupported statistics version {data.get('version')!r} "
                             f"(this program reads versions {', '.join(map(str, READABLE_STATS_VERSIONS))})")
        data = dict(data)
        data["modules"] = {n: ModuleStatistics.from_dict(m) for n, m in data["modules"].items()}
        return cls(**data)

    def to_json(self) -> str:
        # allow_nan: a diverged cycle must still be recorded (json writes NaN/Infinity).
        return json.dumps(self.to_dict(), indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str = "<string>") -> ProbeStatistics:
        return cls.from_dict(json.loads(text), source)

    @classmethod
    def merge(cls, parts: Iterable[ProbeStatistics]) -> ProbeStatistics:
        """One :class:`ProbeStatistics` from the parts of different pipeline stages.

        Raises:
            ValueError: two parts hold the same module, or disagree on the cycle's settings.
        """
        parts = sorted(parts, key=lambda p: min(p.stages, default=0))
        if not parts:
            raise ValueError("nothing to merge")
        first = parts[0]
        modules: dict[str, ModuleStatistics] = {}
        for part in parts:
            for key in ("formats", "data_parallel_size", "num_microbatches", "iteration"):
                if getattr(part, key) != getattr(first, key):
                    raise ValueError(f"statistics of stages {first.stages} and {part.stages} differ in {key}: "
                                     f"{getattr(first, key)!r} vs {getattr(part, key)!r}")
            twice = sorted(set(modules) & set(part.modules))
            if twice:
                raise ValueError(f"module {twice[0]} appears in more than one part")
            modules.update(part.modules)
        losses = [p.loss for p in parts if p.loss is not None]
        return cls(
            modules=dict(sorted(modules.items(), key=lambda item: _execution_order(item[0]))),
            formats=list(first.formats), loss=losses[-1] if losses else None, update_sq=first.update_sq,
            data_parallel_size=first.data_parallel_size, num_microbatches=first.num_microbatches,
            micro_batch_size=first.micro_batch_size, seq_length=first.seq_length, iteration=first.iteration,
            settings=dict(first.settings), stages=sorted({s for p in parts for s in p.stages}),
        )


def _execution_order(name: str) -> tuple[int, int]:
    layer, module = parse_module_name(name)
    return layer, LINEAR_MODULES.index(module)
