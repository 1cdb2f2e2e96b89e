"""The arbiter of the SNIP estimators: run one module in a format for real and measure.

* :func:`forward_ground_truth`: for every (module, format), only that module's
  fprop runs in the format (``Precision(fwd=f, bwd=bf16)``), everything else in
  bf16; the loss change against all-bf16, relative to the all-bf16 loss,
  averaged over the given batches and rounding seeds, and its exact linear part
  ``<G, Y_f - Y_ref>``: the rest is what the estimator's ``dL / loss`` predicts.
* :func:`backward_ground_truth`: only that module's dgrad and wgrad run in the
  format (``Precision(fwd=bf16, bwd=f)``); the drift of the update torch's Adam
  would take from the optimizer's current state (no step applied),
  ``||u(g_f) - u(g_ref)||^2 / ||u(g_ref)||^2`` over every parameter of the
  model, averaged likewise. Comparable with the estimator's ``dU / ||u||^2``,
  its first-order model.
* :func:`group_drift`: a whole group of modules (every layer's fc2, say) on one
  side in a format; its update drift split into the group's own weights and the
  rest (what the estimator's local and propagated parts estimate), and how much
  of it repeats from batch to batch, which Adam's momentum keeps and a one-step
  drift does not show (results/notebook.md, "Why SNIP ranks qkv and fc1 above fc2").
* :func:`equilibrium_costs`: a group's backward in a format, its exact gradient error split into the
  part that repeats over rounding draws and the part that does not, each priced by
  :func:`equilibrium_cost`, the loss it costs once training has run with it for a re-plan interval.

Every rank of the job calls these together (they drive megatron's schedule, so
they work under any TP/PP/DP layout) and every rank gets the full result.
Nothing is left behind: precisions, quantization states, RNG states and
parameters are as before; gradient buffers are zeroed.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_snip.model.quantized.controller import PrecisionController
from megatron_snip.model.quantized.layers import QuantizedLinearMixin
from megatron_snip.model.step import LOSS_KEY, forward_step
from megatron_snip.numerics.linear import QuantState
from megatron_snip.numerics.recipes import BF16, Precision
from megatron_snip.snip.adam_view import AdamSlice, AdamView
from megatron_snip.snip.estimators import second_moment as adam_second_moment
from megatron_snip.snip.module_probe import MicrobatchCounter, ModuleLayout, needs_grad
from megatron_snip.snip.noise import noise_key
from megatron_snip.snip.passes import ForwardStep, PassRunner, preserved_training_state

Table = dict[str, dict[str, float]]  # module -> format -> value


def _squared_norm64(t: torch.Tensor) -> torch.Tensor:
    """``||t||^2`` accumulated in fp64 (0-d): the ground truth's cosines compare drifts to 1e-9, which the probes'
    faster fp32 dot products (``module_probe.squared_norm``) would not resolve."""
    return torch.linalg.vector_norm(t.detach().float(), dtype=torch.float64).square()


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
            except ValueError:
                continue  # e.g. a TP slice off the format's block boundaries: no ground truth to measure
            ok.append(fmt)
        local.append((name, ok))
    group = parallel_state.get_pipeline_model_parallel_group()
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, local, group=group)
    return [item for part in parts for item in part]


@contextlib.contextmanager
def _only(modules: Mapping[str, QuantizedLinearMixin], names: Collection[str], precision: Precision,
          seed: int, operands: Collection[tuple[str, str]] | None = None) -> Iterator[None]:
    """Modules ``names`` (those on this rank) in ``precision``, each with a fresh quantization state
    for rounding seed ``seed`` (same Hadamard signs on every TP rank of a module, independent
    stochastic rounding per rank), only ``operands`` quantized where given; back to bf16 and their
    own states afterwards."""
    held = [n for n in names if n in modules]
    own = {n: modules[n].quant_state for n in held}
    rank = dist.get_rank() if dist.is_initialized() else 0
    for n in held:
        modules[n].quant_state = QuantState(noise_key("ground-truth", seed, n) & ((1 << 31) - 1), stream=rank)
        modules[n].precision = precision
        if operands is not None:
            modules[n].quantize_only(operands)
    try:
        yield
    finally:
        for n in held:
            modules[n].precision = BF16
            modules[n].quant_state = own[n]


def _runners(model, batches, seq_length, micro_batch_size, forward_step_func, loss_key) -> list[PassRunner]:
    step = forward_step_func
    return [PassRunner(list(model), iter(batch), num_microbatches=len(batch), seq_length=seq_length,
                       micro_batch_size=micro_batch_size, forward_step_func=step, loss_key=loss_key)
            for batch in batches]


@dataclass(frozen=True)
class ForwardTruth:
    """Measured forward divergences, module -> format -> value, each relative to the all-bf16 loss.

    Attributes:
        loss_change: ``(L_f - L_ref) / L_ref``, the loss change of the real run.
        first_order: ``<G, Y_f - Y_ref> / L_ref``, its linear part (G = dL/dY of the all-bf16
            run, Y_f - Y_ref the module's output change: both exact, on the same batch).
    """

    loss_change: Table
    first_order: Table

    @property
    def second_order(self) -> Table:
        """``loss_change - first_order``: the real run's change beyond the linear term, which is
        what the second-order estimator ``dL`` predicts (the linear term's sign follows the
        batch and averages out over training)."""
        return {m: {f: v - self.first_order[m][f] for f, v in row.items()} for m, row in self.loss_change.items()}


def forward_ground_truth(
    model: Sequence[torch.nn.Module],
    controller: PrecisionController,
    batches: Sequence[Sequence[dict]],
    formats: Sequence[str],
    *,
    seq_length: int,
    micro_batch_size: int,
    seeds: Sequence[int] = (0,),
    forward_step_func: ForwardStep = forward_step,
    loss_key: str = LOSS_KEY,
) -> ForwardTruth:
    """Measured loss change of running only module l's fprop in f, and its linear part.

    Per batch: one all-bf16 forward + backward (reference loss, module outputs and their
    gradients), then one forward per (module, format, seed).

    Args:
        model: this rank's model chunks (one, DDP-wrapped); controller: its controller.
        batches: this rank's batches, each a list of micro-batch dicts (one schedule call).
        formats: formats to measure; pairs a module cannot run are left out of the result.
        seeds: rounding seeds (quantization states) to average over.
    Returns:
        :class:`ForwardTruth` averaged over batches and seeds, on every rank.
    """
    chunks = list(model)
    runners = _runners(chunks, batches, seq_length, micro_batch_size, forward_step_func, loss_key)
    plan = _module_formats(controller, formats, "fwd")
    pairs = [(name, fmt) for name, fmts in plan for fmt in fmts]
    local = controller.modules()
    layouts = {name: ModuleLayout.of(m) for name, m in local.items()}
    counters = {name: MicrobatchCounter() for name in local}
    device = next(chunks[0].parameters()).device
    # Relative loss changes (non-zero on the last stage only) and relative linear parts (on the
    # module's stage only, TP shards and DP ranks not yet summed).
    loss_sum = torch.zeros(len(pairs), dtype=torch.float64, device=device)
    first_sum = torch.zeros(len(pairs), dtype=torch.float64, device=device)
    with preserved_training_state(chunks, local) as rng:
        for module in local.values():
            module.precision = BF16
        for runner in runners:
            outputs: dict[tuple[str, int], torch.Tensor] = {}
            grads: dict[tuple[str, int], torch.Tensor] = {}
            scale = runner.loss_scale

            def keep(name: str, out) -> None:
                if needs_grad(out):
                    key = name, counters[name]()
                    outputs[key] = out[0].detach().float().clone()
                    out[0].register_hook(lambda g, key=key: grads.__setitem__(key, g.detach().float() / scale))

            for counter in counters.values():
                counter.reset()
            rng.restore()
            with _taps(local, local, keep):
                ref = _on_every_stage(runner.run(forward_only=False), device)
            for i, (name, fmt) in enumerate(pairs):
                def linear_part(name: str, out, i=i) -> None:
                    key = name, counters[name]()
                    change = out[0].detach().float() - outputs[key]
                    first_sum[i] += layouts[name].y_weight * (grads[key] * change).sum(dtype=torch.float64) / ref

                for seed in seeds:
                    if name in counters:
                        counters[name].reset()
                    with _only(local, [name], Precision(fmt, "bf16"), seed), _taps(local, [name], linear_part):
                        rng.restore()
                        loss = runner.run(forward_only=True)
                    if loss is not None:
                        loss_sum[i] += (loss - ref) / ref
    n = len(runners) * len(seeds)
    first = _sum_over_shards(first_sum)
    dist.all_reduce(loss_sum, group=parallel_state.get_pipeline_model_parallel_group())
    return ForwardTruth(_table(pairs, (loss_sum / n).tolist()), _table(pairs, (first / n).tolist()))


def _on_every_stage(loss: float | None, device: torch.device) -> float:
    """The last stage's loss, on every pipeline stage."""
    t = torch.tensor(0.0 if loss is None else loss, dtype=torch.float64, device=device)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        if not parallel_state.is_pipeline_last_stage():
            t.zero_()
        dist.all_reduce(t, group=parallel_state.get_pipeline_model_parallel_group())
    return t.item()


def _sum_over_shards(t: torch.Tensor) -> torch.Tensor:
    """Per-rank partial sums completed over TP (replicas weighted 0), averaged over DP, and
    gathered from the stage that holds them (the others hold zeros)."""
    t = t.clone()
    dist.all_reduce(t, group=parallel_state.get_tensor_model_parallel_group())
    dist.all_reduce(t, group=parallel_state.get_data_parallel_group())
    t /= parallel_state.get_data_parallel_world_size()
    dist.all_reduce(t, group=parallel_state.get_pipeline_model_parallel_group())
    return t


def _table(pairs: Sequence[tuple[str, str]], values: Sequence[float]) -> Table:
    out: Table = {}
    for (name, fmt), v in zip(pairs, values):
        out.setdefault(name, {})[fmt] = v
    return out


@contextlib.contextmanager
def _taps(modules: Mapping[str, QuantizedLinearMixin], names, fn) -> Iterator[None]:
    """Call ``fn(name, output)`` after the forward of each of ``names`` held on this rank."""
    handles = [modules[n].register_forward_hook(lambda mod, args, out, n=n: fn(n, out))
               for n in names if n in modules]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


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
    metric: str = "fisher",
    forward_step_func: ForwardStep = forward_step,
    loss_key: str = LOSS_KEY,
) -> Table:
    """Measured ``||u(g_f) - u(g_ref)||^2 / ||u(g_ref)||^2`` of running only module l's backward in f.

    g are the data-parallel-reduced gradients of the whole model (every parameter the optimizer
    updates) and ``u(g)`` the update torch's Adam would take for g from the optimizer's current
    state (``estimators.adam_update``), so the drift is exact, not linearised; both norms in the
    update ``metric`` (``estimators.metric_scale``: weights at ``g_ref``).

    Args: as :func:`forward_ground_truth`, plus the megatron ``optimizer`` (Adam state) and the ``metric``.
    Returns:
        module -> format -> mean normalised update drift, on every rank.
    """
    chunks = list(model)
    runners = _runners(chunks, batches, seq_length, micro_batch_size, forward_step_func, loss_key)
    plan = _module_formats(controller, formats, "bwd")
    adam = AdamView(optimizer, chunks)
    local = controller.modules()
    sums: Table = {name: dict.fromkeys(fmts, 0.0) for name, fmts in plan}
    with preserved_training_state(chunks, local) as rng:
        for module in local.values():
            module.precision = BF16
        for runner in runners:
            ref, clean = _update(runner, adam, rng, metric)
            update_sq = adam.model_sum(lambda s: _squared_norm64(ref[s]))
            for name, fmts in plan:
                for fmt in fmts:
                    for seed in seeds:
                        with _only(local, [name], Precision("bf16", fmt), seed):
                            u, _ = _update(runner, adam, rng, metric, clean)
                        sums[name][fmt] += adam.model_sum(lambda s: _squared_norm64(u[s] - ref[s])) / update_sq
    return {name: {f: v / (len(runners) * len(seeds)) for f, v in row.items()} for name, row in sums.items()}


def _gradients(runner: PassRunner, adam: AdamView, rng) -> dict[AdamSlice, torch.Tensor]:
    """Every slice's (flat, data-parallel-reduced) gradient of one forward + backward over ``runner``'s
    batch, RNG states restored first."""
    rng.restore()
    runner.run(forward_only=False)
    scale = runner.loss_scale
    return {s: s.flat(s.param.main_grad).float() / scale for s in adam.slices.values()}


def _update(runner: PassRunner, adam: AdamView, rng, metric: str,
            clean: Mapping[AdamSlice, torch.Tensor] | None = None) -> tuple[dict, dict]:
    """(update, gradient): the update torch's Adam would take (``estimators.adam_update``, no step
    applied) for the gradient of one pass over ``runner``'s batch, in the update ``metric``
    (``AdamSlice.in_metric``) at the ``clean`` gradient (None: this pass's own), and that gradient."""
    grads = _gradients(runner, adam, rng)
    clean = grads if clean is None else clean
    return {s: s.in_metric(s.update(g), clean[s], metric) for s, g in grads.items()}, grads


@dataclass(frozen=True)
class GroupDrift:
    """The exact update drift of running a group of modules' GEMMs on one side in a format.

    Attributes:
        own: ``||u(g_f) - u(g_ref)||^2 / ||u(g_ref)||^2`` over the group's own weights (what
            SNIP's local part estimates, for the backward side), mean over the batches.
        other: the same over every other parameter of the model (its propagated part).
        persistence: mean cosine between the drift vectors (whole model) of different batches:
            how much of the error repeats from step to step. Adam's first moment keeps a
            repeated error whole and averages an independent one down to ``(1 - beta1) /
            (1 + beta1)`` of its square; a one-step drift cannot tell them apart. NaN with
            one batch.
        own_persistence, other_persistence: the same over the group's own weights and over the
            other parameters: which of the two parts repeats.
    """

    own: float
    other: float
    persistence: float
    own_persistence: float
    other_persistence: float


def group_drift(
    model: Sequence[torch.nn.Module],
    optimizer,
    controller: PrecisionController,
    batches: Sequence[Sequence[dict]],
    groups: Mapping[str, Collection[str]],
    precision: Precision,
    *,
    seq_length: int,
    micro_batch_size: int,
    seed: int = 0,
    operands: Collection[tuple[str, str]] | None = None,
    metric: str = "fisher",
    forward_step_func: ForwardStep = forward_step,
    loss_key: str = LOSS_KEY,
) -> dict[str, GroupDrift]:
    """Measured update drift of running every module of a group (e.g. every layer's ``linear_fc2``)
    in ``precision`` at once, the rest in bf16, split into the group's own weights and the others,
    with its persistence between batches (:class:`GroupDrift`).

    ``Precision("bf16", f)`` measures what SNIP's update term estimates; ``Precision(f, "bf16")``
    the update drift that the forward GEMMs cause, which the update term leaves out.

    ``operands`` quantizes only those of the GEMMs' operands (``{("dgrad", "w")}``: the error the
    input gradient takes from the quantized weight alone, the same at every step for a weight that
    barely moves; results/notebook.md, "Why SNIP ranks qkv and fc1 above fc2", point 3).

    Args: as :func:`backward_ground_truth`, plus ``groups`` (group name -> global module names),
        the rounding ``seed`` and ``operands`` ((gemm, operand) pairs; None: all of ``precision``'s);
        drifts in the update ``metric``.
        Costs one forward + backward per (group, batch), plus one per batch.
    Returns:
        group name -> :class:`GroupDrift`, on every rank.
    """
    chunks = list(model)
    runners = _runners(chunks, batches, seq_length, micro_batch_size, forward_step_func, loss_key)
    adam = AdamView(optimizer, chunks)
    local = controller.modules()
    out = {}
    with preserved_training_state(chunks, local) as rng:
        for module in local.values():
            module.precision = BF16
        refs, cleans = zip(*(_update(runner, adam, rng, metric) for runner in runners))
        norms = [adam.model_sum(lambda s, r=r: _squared_norm64(r[s])) for r in refs]
        for group, names in groups.items():
            weights = {f"{n}.weight" for n in names}
            mine = {"own": lambda s: s.name in weights, "other": lambda s: s.name not in weights}
            drifts, sq = [], []  # per batch: the drift, and its squared norm over each part
            for runner, ref, clean in zip(runners, refs, cleans):
                with _only(local, names, precision, seed, operands):
                    u, _ = _update(runner, adam, rng, metric, clean)
                d = {s: u[s] - ref[s] for s in ref}
                drifts.append(d)
                sq.append({p: adam.model_sum(lambda s, keep=keep: _squared_norm64(d[s]) * keep(s))
                           for p, keep in mine.items()})
            # inner products between batches, per part; the whole model's are their sums
            dots = {(i, j): {p: adam.model_sum(lambda s, keep=keep: (drifts[i][s].double()
                                                                     * drifts[j][s].double()).sum() * keep(s))
                             for p, keep in mine.items()}
                    for i, j in itertools.combinations(range(len(drifts)), 2)}

            def persistence(parts: tuple[str, ...]) -> float:
                cosines = []
                for (i, j), dot in dots.items():
                    ni, nj = sum(sq[i][p] for p in parts), sum(sq[j][p] for p in parts)
                    if ni * nj > 0:
                        cosines.append(sum(dot[p] for p in parts) / math.sqrt(ni * nj))
                return sum(cosines) / len(cosines) if cosines else math.nan

            own = sum(q["own"] / norm for q, norm in zip(sq, norms)) / len(runners)
            other = sum(q["other"] / norm for q, norm in zip(sq, norms)) / len(runners)
            out[group] = GroupDrift(own, other, persistence(("own", "other")), persistence(("own",)),
                                    persistence(("other",)))
    return out


def equilibrium_cost(bias_sq: torch.Tensor, noise_var: torch.Tensor, second_moment: torch.Tensor, *, tokens: int,
                     lr: float, eps: float, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss (nats) that a gradient error costs after ``steps`` steps of Adam with it, element by element, on a
    loss that is locally quadratic with the empirical Fisher's curvature ``h = tokens * second_moment`` (the
    second moment is the batch-mean gradient's, ``F / tokens``) and Adam's per-element rate
    ``eta = lr / (sqrt(second_moment) + eps)``:

    * a repeated error ``b`` (``bias_sq = b^2``) moves the minimum by ``b / h``; the parameter gets there or,
      where ``eta h steps < 1``, drifts ``steps eta b``: cost ``0.5 h d^2`` with ``d = b min(1 / h, steps eta)``;
    * an independent one of variance ``noise_var`` leaves the stationary variance ``eta noise_var / (2 h)``,
      or a random walk's ``steps eta^2 noise_var`` before it gets there: cost ``0.5 h`` times the smaller.

    What a one-step drift (SNIP's update term) leaves out is that the error persists over the interval.
    Args: tensors of one parameter's elements (fp64); ``tokens`` of the global batch.
    Returns:
        (the repeated error's cost, the independent error's cost), 0-d: sums over the elements.
    """
    h = tokens * second_moment
    eta = lr / (second_moment.sqrt() + eps)
    reach = torch.minimum(1.0 / h, steps * eta)  # h = 0: 1 / h = inf, the drift's bound decides
    bias = 0.5 * h * bias_sq * reach ** 2
    noise = 0.5 * h * torch.minimum(eta * noise_var / (2.0 * h), steps * eta ** 2 * noise_var)
    return bias.nan_to_num(0.0).sum(), noise.nan_to_num(0.0).sum()


def equilibrium_costs(
    model: Sequence[torch.nn.Module],
    optimizer,
    controller: PrecisionController,
    batches: Sequence[Sequence[dict]],
    groups: Mapping[str, Collection[str]],
    fmt: str,
    *,
    seq_length: int,
    micro_batch_size: int,
    steps: int,
    tokens: int,
    seeds: tuple[int, int] = (0, 1),
    forward_step_func: ForwardStep = forward_step,
    loss_key: str = LOSS_KEY,
) -> dict[str, tuple[float, float]]:
    """Each group's backward GEMMs in ``fmt`` (the rest, and every forward, in bf16): the exact gradient error of
    every parameter the optimizer updates under two rounding ``seeds``; their mean's square less its noise is
    the repeated part ``b^2``, half their squared difference the independent part's variance, each priced by
    :func:`equilibrium_cost` at Adam's state (its second moment with the clean gradient folded in).

    Args: as :func:`group_drift`, plus the interval's ``steps`` and the global batch's ``tokens``.
        Costs one forward + backward per batch, plus two per (group, batch).
    Returns:
        group name -> (repeated error's cost, independent error's cost) in nats, mean over the batches, on
        every rank.
    """
    chunks = list(model)
    runners = _runners(chunks, batches, seq_length, micro_batch_size, forward_step_func, loss_key)
    adam = AdamView(optimizer, chunks)
    local = controller.modules()
    sums = {group: [0.0, 0.0] for group in groups}
    with preserved_training_state(chunks, local) as rng:
        for module in local.values():
            module.precision = BF16
        for runner in runners:
            ref = _gradients(runner, adam, rng)
            moments = {s: adam_second_moment(s.state["exp_avg_sq"].view(-1), ref[s], s.hyper).double() for s in ref}
            for group, names in groups.items():
                errors = []
                for seed in seeds:
                    with _only(local, names, Precision("bf16", fmt), seed):
                        grads = _gradients(runner, adam, rng)
                    errors.append({s: (grads[s] - ref[s]).double() for s in ref})
                costs = {}
                for s in ref:
                    mean, noise_var = (errors[0][s] + errors[1][s]) / 2, (errors[0][s] - errors[1][s]) ** 2 / 2
                    # E[mean^2] = b^2 + var / 2: unbiased element by element, so their weighted sum is too (no
                    # clamp at 0, which would count every element's noise as a repeated error)
                    bias_sq = mean ** 2 - noise_var / 2
                    costs[s] = equilibrium_cost(bias_sq, noise_var, moments[s], tokens=tokens, lr=s.hyper.lr,
                                                eps=s.hyper.eps, steps=steps)
                for i in range(2):
                    sums[group][i] += adam.model_sum(lambda s, i=i: costs[s][i])
    return {group: (b / len(runners), n / len(runners)) for group, (b, n) in sums.items()}
