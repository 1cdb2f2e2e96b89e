"""The arbiter of the SNIP estimators: run one module in a format for real and measure.

* :func:`forward_ground_truth`: for every (module, format), only that module's
  fprop runs in the format (``Precision(fwd=f, bwd=bf16)``), everything else in
  bf16; the loss change against all-bf16, relative to the all-bf16 loss,
  averaged over the given batches and rounding seeds. Comparable with the
  estimator's ``dL / loss``.
* :func:`backward_ground_truth`: only that module's dgrad and wgrad run in the
  format (``Precision(fwd=bf16, bwd=f)``); the drift of the update an Adam
  step would take from the optimizer's current state (preconditioner from
  ``exp_avg_sq``, no step applied), ``||P~ (g_f - g_ref)||^2 / ||u_ref||^2``
  over every parameter of the model, averaged likewise. Comparable with the
  estimator's ``dU / ||u||^2``.

Every rank of the job calls these together (they drive megatron's schedule, so
they work under any TP/PP/DP layout) and every rank gets the full result.
Nothing is left behind: precisions, quantization states, RNG states and
parameters are as before; gradient buffers are zeroed.

Plus the comparison tools: :func:`spearman` (ranks with ties averaged; no
scipy needed) and :func:`rank_correlations`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_snip.model.precision_control import PrecisionController
from megatron_snip.model.quantized_layers import QuantizedLinearMixin
from megatron_snip.precision.linear import QuantState
from megatron_snip.precision.recipes import BF16, Precision

from .probes import AdamView, ForwardStep, PassRunner, default_forward_step, noise_key, preserved_training_state

Table = dict[str, dict[str, float]]  # module -> format -> value


def _module_formats(controller: PrecisionController, formats: Sequence[str], side: str) -> list[tuple[str, list[str]]]:
    """(global name, formats it can run on ``side``) for every module of every pipeline stage,
    in stage order: every rank loops over the same list."""
    local = []
    for name, module in controller.modules().items():
        ok = []
        for fmt in formats:
            precision = Precision(fmt, "bf16") if side == "fwd" else Precision("bf16", fmt)
            try:
                module.check_precision(precision, module.recipe)
                ok.append(fmt)
            except ValueError:
                pass
        local.append((name, ok))
    group = parallel_state.get_pipeline_model_parallel_group()
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, local, group=group)
    return [item for part in parts for item in part]


@contextlib.contextmanager
def _only(modules: Mapping[str, QuantizedLinearMixin], name: str, precision: Precision, seed: int) -> Iterator[None]:
    """Module ``name`` (if on this rank) in ``precision`` with a fresh quantization state for
    rounding seed ``seed`` (same Hadamard signs on every TP rank of the module, independent
    stochastic rounding per rank); back to bf16 and its own state afterwards."""
    module = modules.get(name)
    if module is None:
        yield
        return
    own = module.quant_state
    rank = dist.get_rank() if dist.is_initialized() else 0
    module.quant_state = QuantState(noise_key("ground-truth", seed, name) & ((1 << 31) - 1), stream=rank)
    module.precision = precision
    try:
        yield
    finally:
        module.precision = BF16
        module.quant_state = own


def _runners(model, batches, seq_length, micro_batch_size, forward_step_func, loss_key) -> list[PassRunner]:
    step = forward_step_func or default_forward_step()
    return [PassRunner(list(model), iter(batch), num_microbatches=len(batch), seq_length=seq_length,
                       micro_batch_size=micro_batch_size, forward_step_func=step, loss_key=loss_key)
            for batch in batches]


def forward_ground_truth(
    model: Sequence[torch.nn.Module],
    controller: PrecisionController,
    batches: Sequence[Sequence[dict]],
    formats: Sequence[str],
    *,
    seq_length: int,
    micro_batch_size: int,
    seeds: Sequence[int] = (0,),
    forward_step_func: ForwardStep | None = None,
    loss_key: str = "lm loss",
) -> Table:
    """Measured ``(L_f - L_ref) / L_ref`` of running only module l's fprop in f.

    Args:
        model: this rank's model chunks (one, DDP-wrapped); controller: its controller.
        batches: this rank's batches, each a list of micro-batch dicts (one schedule call).
        formats: formats to measure; pairs a module cannot run are left out of the result.
        seeds: rounding seeds (quantization states) to average over.
    Returns:
        module -> format -> mean relative loss change, on every rank.
    """
    chunks = list(model)
    runners = _runners(chunks, batches, seq_length, micro_batch_size, forward_step_func, loss_key)
    plan = _module_formats(controller, formats, "fwd")
    local = controller.modules()
    sums: Table = {name: dict.fromkeys(fmts, 0.0) for name, fmts in plan}
    with preserved_training_state(chunks, local) as rng:
        for module in local.values():
            module.precision = BF16
        for runner in runners:
            rng.restore()
            ref = runner.run(forward_only=True)
            for name, fmts in plan:
                for fmt in fmts:
                    for seed in seeds:
                        with _only(local, name, Precision(fmt, "bf16"), seed):
                            rng.restore()
                            loss = runner.run(forward_only=True)
                        if loss is not None:
                            sums[name][fmt] += (loss - ref) / ref
    result = {name: {f: v / (len(runners) * len(seeds)) for f, v in row.items()} for name, row in sums.items()}
    # The loss lives on the last pipeline stage: hand its table to every stage.
    holder = [result]
    dist.broadcast_object_list(holder, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                               group=parallel_state.get_pipeline_model_parallel_group())
    return holder[0]


def backward_ground_truth(
    model: Sequence[torch.nn.Module],
    optimizer,
    controller: PrecisionController,
    batches: Sequence[Sequence[dict]],
    formats: Sequence[str],
    *,
    seq_length: int,
    micro_batch_size: int,
    seeds: Sequence[int] = (0,),
    forward_step_func: ForwardStep | None = None,
    loss_key: str = "lm loss",
) -> Table:
    """Measured ``||P~ (g_f - g_ref)||^2 / ||u_ref||^2`` of running only module l's backward in f.

    g are the data-parallel-reduced gradients of the whole model (every parameter the optimizer
    updates), ``P~`` Adam's update sensitivity and ``u_ref`` the update from the all-bf16
    gradient, both from the optimizer's current state (see ``estimators.adam_*``).

    Args: as :func:`forward_ground_truth`, plus the megatron ``optimizer`` (Adam state).
    Returns:
        module -> format -> mean normalised update drift, on every rank.
    """
    chunks = list(model)
    runners = _runners(chunks, batches, seq_length, micro_batch_size, forward_step_func, loss_key)
    plan = _module_formats(controller, formats, "bwd")
    adam = AdamView(optimizer, chunks)
    local = controller.modules()
    sums: Table = {name: dict.fromkeys(fmts, 0.0) for name, fmts in plan}
    sensitivity = {s: s.sensitivity() for s in adam.slices.values()}
    with preserved_training_state(chunks, local) as rng:
        for module in local.values():
            module.precision = BF16
        for runner in runners:
            scale = runner.loss_scale
            rng.restore()
            runner.run(forward_only=False)
            ref = {s: s.flat(s.param.main_grad).float() / scale for s in adam.slices.values()}
            update_sq = adam.model_sum(lambda s: _sq(s.update(ref[s])))
            for name, fmts in plan:
                for fmt in fmts:
                    for seed in seeds:
                        with _only(local, name, Precision("bf16", fmt), seed):
                            rng.restore()
                            runner.run(forward_only=False)
                        drift = adam.model_sum(
                            lambda s: _sq(sensitivity[s] * (s.flat(s.param.main_grad).float() / scale - ref[s])))
                        sums[name][fmt] += drift / update_sq
    return {name: {f: v / (len(runners) * len(seeds)) for f, v in row.items()} for name, row in sums.items()}


def _sq(t: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(t, dtype=torch.float64).square()


# -- rank correlation ------------------------------------------------------------------------------

def rank_with_ties(values: Sequence[float]) -> list[float]:
    """1-based ranks; tied values share the mean of the ranks they span."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the tie-averaged ranks
    (NaN when either side is constant or there are fewer than 2 values)."""
    if len(x) != len(y):
        raise ValueError(f"spearman: {len(x)} vs {len(y)} values")
    if len(x) < 2:
        return math.nan
    rx, ry = rank_with_ties(x), rank_with_ties(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = sum((a - mx) ** 2 for a in rx)
    vy = sum((b - my) ** 2 for b in ry)
    return cov / math.sqrt(vx * vy) if vx > 0 and vy > 0 else math.nan


def rank_correlations(estimate: Mapping[str, Mapping[str, float]], truth: Mapping[str, Mapping[str, float]]
                      ) -> dict[str, float]:
    """Spearman correlation of an estimate with the ground truth over the (module, format) pairs
    both hold: ``"all"`` pairs, and per format (across modules: the ranking the ILP needs most,
    as formats alone separate by orders of magnitude)."""
    pairs = [(m, f) for m in truth for f in truth[m] if f in estimate.get(m, {})]
    out = {"all": spearman([estimate[m][f] for m, f in pairs], [truth[m][f] for m, f in pairs])}
    for fmt in dict.fromkeys(f for _, f in pairs):
        sub = [(m, f) for m, f in pairs if f == fmt]
        out[fmt] = spearman([estimate[m][f] for m, f in sub], [truth[m][f] for m, f in sub])
    return out
