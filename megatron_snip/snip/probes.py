"""The SNIP probe cycle: measure, on a probe batch, what the estimators need.

:func:`run_probe_cycle` runs on every rank of the job at once (it drives
megatron-core's pipeline schedule, so all tensor-, pipeline- and data-parallel
ranks must call it together) and returns this pipeline stage's
:class:`ProbeStatistics`; :func:`gather_across_pipeline` merges the stages.
All passes run every linear module in bf16 (the reference) and on the same
micro-batches, with the RNG reset before each pass so dropout draws the same
masks:

1. **clean pass** (forward + backward): per module ``||X||^2, ||W||^2,
   ||Y||^2, ||dY||^2`` and, per candidate format f, the exact errors
   ``||E_f||^2, ||eX_f||^2, ||P~ * eW_f||^2``: the quantized GEMMs are
   re-run on the captured X, W, dY through
   :func:`megatron_snip.precision.linear.quantized_linear` (the layers' own
   code); plus the clean Adam update ``||u||^2`` from the reduced gradients;
2. **Hutchinson passes** (2K forward + backward): antithetic Rademacher noise
   ``+-sigma_l Z_l`` at every module output at once; ``<Z_l, G+ - G->`` gives
   ``tr(H_l)`` for every module;
3. **perturbation passes** (2K forward only): every parameter moved by
   ``+-sigma P~ * w``; ``||X+ - X-||^2`` at every module input gives the
   propagated gains ``g_l``.

Noise is a counter-based hash of (seed, pass, tensor name, global element
index), so it is the same for every tensor-/pipeline-parallel layout and
needs no storage. Side effects: none on parameters, precisions, quantization
states or RNG states; the DDP gradient buffers are zeroed (or restored with
``ProbeConfig.restore_grads``); the caller's data iterator is read for exactly
``num_microbatches`` micro-batches.

Adam's state comes from the megatron optimizer: :class:`AdamView` maps each
model parameter to the slice of its fp32 main parameter and optimizer state
held on this rank (the whole parameter for ``FP32Optimizer`` /
``Float16OptimizerWithFloat16Params``, a shard of the flat buffer for the
``DistributedOptimizer``, whose sums then run over the data-parallel group).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import ChainedOptimizer, Float16OptimizerWithFloat16Params, FP32Optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import param_is_not_shared
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import get_model_config, get_pg_size

from megatron_snip.model.precision_control import PrecisionController
from megatron_snip.model.quantized_layers import QuantizedLinearMixin
from megatron_snip.precision.linear import QuantState, quantized_linear
from megatron_snip.precision.plan import parse_module_name
from megatron_snip.precision.recipes import BF16, Precision

from .estimators import (
    REFERENCE_FORMAT,
    adam_preconditioner,
    adam_step_scale,
    adam_update,
    hutchinson_trace,
    perturbation_gain,
)
from .statistics import FormatErrors, ModuleStatistics, ProbeStatistics

ForwardStep = Callable  # (data_iterator, model) -> (output, loss_func), as megatron's schedules call it


@dataclass(frozen=True)
class ProbeConfig:
    """Settings of a probe cycle.

    Attributes:
        formats: candidate formats to measure; bf16, the reference (cost 0), may be listed
            and is dropped: it needs no measurement.
        hutchinson_probes: K noise draws for the curvatures, each an antithetic pair of
            forward + backward passes (2K passes).
        perturbation_probes: K parameter-perturbation draws for the gains, each an
            antithetic pair of forward-only passes (2K passes).
        output_noise: Hutchinson noise scale relative to each module's output RMS.
        param_noise: parameter perturbation size relative to the parameter norm,
            ``||sigma P~ w|| = param_noise * ||theta||``; None: 1e-3 for fp32 parameters,
            3e-2 for 16-bit ones (a smaller step would round away in bf16).
        seed: seed of the noise.
        restore_grads: put the DDP gradient buffers back as they were (costs a copy of them);
            otherwise they are left zeroed, as every training step begins anyway.
    """

    formats: tuple[str, ...] = ("fp8", "nvfp4", "mxfp4")
    hutchinson_probes: int = 3
    perturbation_probes: int = 3
    output_noise: float = 0.05
    param_noise: float | None = None
    seed: int = 0
    restore_grads: bool = False

    def __post_init__(self):
        for f in self.formats:
            Precision.uniform(f)
        object.__setattr__(self, "formats", tuple(f for f in self.formats if f != REFERENCE_FORMAT))
        if self.hutchinson_probes < 1 or self.perturbation_probes < 1:
            raise ValueError("hutchinson_probes and perturbation_probes must be >= 1")
        if not self.output_noise > 0 or (self.param_noise is not None and not self.param_noise > 0):
            raise ValueError("output_noise and param_noise must be > 0")


# -- layout-invariant noise ------------------------------------------------------------------------

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2^32`` for x in [0, 2^32) held in int64, without overflowing int64."""
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & _M32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' ``lowbias32`` integer hash on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def noise_key(*parts) -> int:
    """A 64-bit key for one noise tensor from its description (seed, pass, name, ...)."""
    return int.from_bytes(hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest(), "little")


def rademacher(index: torch.Tensor, key: int) -> torch.Tensor:
    """+-1 (fp32) for each global element index (int64), a hash of (key, index): the same value
    for an element whichever rank holds it and in whatever order it is drawn."""
    h = _hash32((index & _M32) ^ (key & _M32))
    h = _hash32(h ^ (index >> 32) ^ ((key >> 32) & _M32))
    return 1.0 - 2.0 * (h >> 31).float()


def global_flat_index(shape: Sequence[int], *, partition_dim: int | None = None, stride: int = 1, rank: int = 0,
                      size: int = 1, start: int = 0, end: int | None = None,
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """Indices, in the unsharded tensor, of elements ``start:end`` of a flattened shard.

    The shard is megatron's tensor-parallel split of dim ``partition_dim`` (None: not split):
    the full dim is cut into chunks of ``shape[dim] / stride`` and rank r holds chunks
    r, r + size, r + 2 size, ... (``_initialize_affine_weight_cpu``; SwiGLU's fc1 has stride 2).

    Returns:
        int64 tensor of ``end - start`` flat indices into the full tensor (row-major).
    """
    numel = math.prod(shape)
    end = numel if end is None else end
    local = torch.arange(start, end, dtype=torch.int64, device=device)
    if partition_dim is None or size == 1:
        return local
    dim = partition_dim % len(shape)
    n_local, inner = shape[dim], math.prod(shape[dim + 1:])
    chunk = n_local // stride
    outer, rest = local // (n_local * inner), local % (n_local * inner)
    d, within = rest // inner, rest % inner
    d_full = ((d // chunk) * size + rank) * chunk + d % chunk
    return (outer * (n_local * size) + d_full) * inner + within


def param_global_index(param: torch.nn.Parameter, start: int = 0, end: int | None = None) -> torch.Tensor:
    """:func:`global_flat_index` of elements ``start:end`` of this rank's (flattened) shard of a
    megatron parameter, from its tensor-parallel attributes."""
    split = getattr(param, "tensor_model_parallel", False)
    return global_flat_index(param.shape, partition_dim=param.partition_dim if split else None,
                             stride=getattr(param, "partition_stride", 1),
                             rank=parallel_state.get_tensor_model_parallel_rank(),
                             size=parallel_state.get_tensor_model_parallel_world_size(),
                             start=start, end=end, device=param.device)


# -- the optimizer's view of each parameter --------------------------------------------------------

@dataclass(eq=False)
class AdamSlice:
    """The elements ``start:end`` of a flattened model parameter that this rank's optimizer
    updates, with their Adam state.

    Attributes:
        param: the model parameter; name: its global name (layout-independent).
        start, end: the slice of ``param.view(-1)``.
        state: the inner optimizer's state of the main parameter (``exp_avg``, ``exp_avg_sq``,
            ``step``), each holding ``end - start`` elements.
        group: the inner optimizer's param group (lr, betas, eps).
        dp_sharded: held by one data-parallel rank only (distributed optimizer).
        counted: counts in model-wide sums on this rank (not a tensor-parallel duplicate
            held by a rank other than TP rank 0, not a shared copy).
    """

    param: torch.nn.Parameter
    name: str
    start: int
    end: int
    state: dict
    group: dict
    dp_sharded: bool
    counted: bool

    @property
    def step(self) -> float:
        return float(self.state["step"])

    @property
    def lr(self) -> float:
        """The group's learning rate, or 1 when the schedule is at 0 (warm-up start, decay to 0).

        Every divergence SNIP uses is normalised by the clean update, and the LR
        enters numerator and denominator squared, so its scale cancels; only a
        zero LR would leave nothing to normalise by.
        """
        return self.group["lr"] or 1.0

    def sensitivity(self) -> torch.Tensor:
        """``P~ = c P`` on the slice (flat): d(update) / d(gradient)."""
        return adam_step_scale(self.lr, self.group["betas"][0], self.step) * self.preconditioner()

    def preconditioner(self) -> torch.Tensor:
        """Adam's ``P = 1 / (sqrt(v_hat) + eps)`` on the slice (flat)."""
        return adam_preconditioner(self.state["exp_avg_sq"].view(-1), self.step, self.group["betas"][1],
                                   self.group["eps"])

    def update(self, grad: torch.Tensor) -> torch.Tensor:
        """The Adam update this slice would take for (flat) gradient ``grad``."""
        return adam_update(self.state["exp_avg"].view(-1), grad, self.preconditioner(), self.lr,
                           self.group["betas"][0], self.step)

    def flat(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor.view(-1)[start:end]`` (tensor shaped like the parameter)."""
        return tensor.view(-1)[self.start:self.end]


class AdamView:
    """Model parameter -> :class:`AdamSlice` for every parameter this rank's optimizer updates.

    Supported: megatron's ``FP32Optimizer``, ``Float16OptimizerWithFloat16Params`` and
    ``DistributedOptimizer`` (alone or chained) around torch Adam/AdamW.

    Raises:
        ValueError: another optimizer, a precision-aware distributed optimizer (main params
            held inside the fused optimizer), AMSGrad, or no Adam state yet.
    """

    def __init__(self, optimizer, chunks: Sequence[torch.nn.Module]):
        names = global_parameter_names(chunks)
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.slices: dict[torch.nn.Parameter, AdamSlice] = {}
        parts = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
        for opt in parts:
            groups = {id(p): g for g in opt.optimizer.param_groups for p in g["params"]}
            for param, main, start, end, sharded in _main_params(opt):
                if main is None:
                    raise ValueError(f"{names.get(param, 'a parameter')}: the optimizer keeps no fp32 main "
                                     "parameter (precision-aware distributed optimizer); SNIP probes need "
                                     "its Adam state: run without --use-precision-aware-optimizer")
                group = groups[id(main)]
                if group.get("amsgrad", False):
                    raise ValueError("SNIP probes model Adam without AMSGrad; the optimizer uses amsgrad=True")
                state = opt.optimizer.state.get(main, {})
                if "exp_avg_sq" not in state:
                    raise ValueError(f"{names.get(param, 'a parameter')}: no Adam state (exp_avg_sq): "
                                     f"the optimizer is {type(opt.optimizer).__name__} or has not stepped yet; "
                                     "SNIP probes need Adam/AdamW after at least one optimizer step")
                counted = (param_is_not_shared(param)
                           and (tensor_parallel.param_is_not_tensor_parallel_duplicate(param) or tp_rank == 0))
                self.slices[param] = AdamSlice(param, names[param], start, end, state, group, sharded, counted)

    @property
    def dp_sharded(self) -> bool:
        return any(s.dp_sharded for s in self.slices.values())

    def model_sum(self, per_slice: Callable[[AdamSlice], torch.Tensor]) -> float:
        """``sum over every parameter element of the model`` of a per-slice fp64 sum, complete over
        tensor-, pipeline- and (distributed optimizer) data-parallel shards; the same on every rank."""
        device = next(iter(self.slices)).device if self.slices else _default_device()
        sharded = torch.zeros((), dtype=torch.float64, device=device)
        replicated = torch.zeros((), dtype=torch.float64, device=device)
        for s in self.slices.values():
            if s.counted:
                if s.dp_sharded:
                    sharded += per_slice(s)
                else:
                    replicated += per_slice(s)
        if parallel_state.get_data_parallel_world_size() > 1:
            dist.all_reduce(sharded, group=parallel_state.get_data_parallel_group())
        total = sharded + replicated
        dist.all_reduce(total, group=parallel_state.get_model_parallel_group())
        return total.item()


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _main_params(opt):
    """(model param, main param or None, start, end, dp_sharded) for one megatron optimizer."""
    if isinstance(opt, DistributedOptimizer):
        if opt.data_parallel_group.size() != parallel_state.get_data_parallel_world_size():
            raise ValueError("SNIP probes sum the distributed optimizer's shards over the whole data-parallel "
                             "group; several distributed-optimizer instances (partial sharding) are not supported")
        pairs = [*zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups),
                 *zip(opt.model_fp32_groups, opt.shard_fp32_groups)]
        for model_group, main_group in pairs:
            for param, main in zip(model_group, main_group):
                r = opt._get_model_param_range_map(param)["param"]
                yield param, main, r.start, r.end, True
    elif isinstance(opt, Float16OptimizerWithFloat16Params):
        for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups):
            for param, main in zip(model_group, main_group):
                yield param, main, 0, param.numel(), False
        for group in opt.fp32_from_fp32_groups:
            for param in group:
                yield param, param, 0, param.numel(), False
    elif isinstance(opt, FP32Optimizer):
        for group in opt.optimizer.param_groups:
            for param in group["params"]:
                yield param, param, 0, param.numel(), False
    else:
        raise ValueError(f"SNIP probes support megatron's FP32Optimizer, Float16OptimizerWithFloat16Params and "
                         f"DistributedOptimizer; got {type(opt).__name__}")


def global_parameter_names(chunks: Sequence[torch.nn.Module]) -> dict[torch.nn.Parameter, str]:
    """Parameter -> name independent of the parallel layout: wrapper prefixes (``module.``)
    dropped, transformer layers numbered globally (``decoder.layers.{layer_number - 1}``)."""
    names = {}
    for chunk in chunks:
        layers = {prefix: m.layer_number - 1 for prefix, m in chunk.named_modules() if isinstance(m, TransformerLayer)}
        for name, param in chunk.named_parameters():
            for prefix, layer in layers.items():
                if name.startswith(prefix + "."):
                    name = f"decoder.layers.{layer}" + name[len(prefix):]
                    break
            while name.startswith("module."):
                name = name[len("module."):]
            names[param] = name
    return names


# -- leaving no trace ------------------------------------------------------------------------------

class RngStates:
    """The torch CPU/CUDA RNG states and megatron's RNG tracker states, captured once."""

    def __init__(self):
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        tracker = tensor_parallel.get_cuda_rng_tracker()
        self.tracker = {k: v.clone() for k, v in tracker.get_states().items()} if tracker.is_initialized() else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        if self.tracker is not None:
            tensor_parallel.get_cuda_rng_tracker().set_states({k: v.clone() for k, v in self.tracker.items()})


@contextlib.contextmanager
def preserved_training_state(chunks: Sequence[torch.nn.Module], modules: dict[str, QuantizedLinearMixin],
                             restore_grads: bool = False) -> Iterator[RngStates]:
    """Run probe passes without leaving a trace: on exit every module's precision and quantization
    state, every RNG state and every ``param.grad`` reference are back, the DDP gradient buffers
    zeroed (or restored).

    Yields:
        the captured :class:`RngStates`; restore them before each pass so every pass draws the
        same dropout masks.
    """
    for chunk in chunks:
        if not hasattr(chunk, "zero_grad_buffer"):
            raise ValueError(f"the model chunk is a {type(chunk).__name__}; SNIP probes need it wrapped in "
                             "megatron-core's DistributedDataParallel (as the trainer does)")
    rng = RngStates()
    precisions = {n: m.precision for n, m in modules.items()}
    states = {n: m.quant_state for n, m in modules.items()}
    buffers = [b for chunk in chunks for b in chunk.buffers + chunk.expert_parallel_buffers]
    grads = [b.grad_data.clone() for b in buffers] if restore_grads else None
    # After an optimizer step megatron's FP32Optimizer leaves ``param.grad`` aliasing
    # ``param.main_grad`` (the trainer's optimizer.zero_grad() drops it at the next step); a
    # backward would then accumulate into the buffer twice. Detach the references meanwhile.
    params = [p for chunk in chunks for p in chunk.parameters()]
    grad_refs = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield rng
    finally:
        for name, module in modules.items():
            module.quant_state = states[name]
            module.precision = precisions[name]
        for chunk in chunks:
            chunk.zero_grad_buffer()
        if grads is not None:
            for b, g in zip(buffers, grads):
                b.grad_data.copy_(g)
        for p, g in zip(params, grad_refs):
            p.grad = g
        rng.restore()


# -- running passes --------------------------------------------------------------------------------

class PassRunner:
    """Runs forward(-backward) passes over the same recorded micro-batches through megatron's
    schedule (any pipeline layout). The first pass reads ``num_microbatches`` micro-batches
    from the caller's iterator; later passes replay them."""

    def __init__(self, chunks: Sequence[torch.nn.Module], data_iterator: Iterator | None, *, num_microbatches: int,
                 seq_length: int, micro_batch_size: int, forward_step_func: ForwardStep, loss_key: str):
        if len(chunks) != 1:
            raise ValueError(f"SNIP probes run one model chunk per rank; got {len(chunks)} "
                             "(virtual pipeline stages are not supported)")
        config = get_model_config(chunks[0])
        if config.sequence_parallel:
            raise ValueError("SNIP probes do not support sequence parallelism (nor do the quantized layers)")
        if config.calculate_per_token_loss:
            raise ValueError("SNIP probes need the loss averaged per micro-batch; calculate_per_token_loss is set")
        if parallel_state.get_context_parallel_world_size() > 1:
            raise ValueError("SNIP probes do not support context parallelism")
        self.chunks = list(chunks)
        self.config = config
        self.num_microbatches = num_microbatches
        self.seq_length, self.micro_batch_size = seq_length, micro_batch_size
        self.forward_step_func, self.loss_key = forward_step_func, loss_key
        self._source, self._batches = data_iterator, None
        self._schedule = get_forward_backward_func()

    @property
    def loss_scale(self) -> float:
        """The factor the schedule multiplies the loss by before backward (1 without a grad scaler)."""
        f = self.config.grad_scale_func
        device = next(self.chunks[0].parameters()).device
        return 1.0 if f is None else float(f(torch.ones(1, device=device)).item())

    def _data(self) -> Iterator | None:
        if self._source is None:
            return None
        if self._batches is None:
            self._batches = []
            return self._record()
        return iter(self._batches)

    def _record(self) -> Iterator:
        for i in range(self.num_microbatches):
            try:
                batch = next(self._source)
            except StopIteration:
                raise ValueError(f"the probe data iterator ran out after {i} of {self.num_microbatches} "
                                 "micro-batches") from None
            self._batches.append(batch)
            yield batch

    def run(self, forward_only: bool) -> float | None:
        """One pass; returns the mean loss on the last stage (None elsewhere)."""
        if not forward_only:
            for chunk in self.chunks:
                chunk.zero_grad_buffer()
        with torch.no_grad() if forward_only else contextlib.nullcontext():
            out = self._schedule(forward_step_func=self.forward_step_func, data_iterator=self._data(),
                                 model=self.chunks, num_microbatches=self.num_microbatches,
                                 seq_length=self.seq_length, micro_batch_size=self.micro_batch_size,
                                 forward_only=forward_only)
        if not out:
            return None
        return sum(float(d[self.loss_key]) for d in out) / len(out)


def default_forward_step() -> ForwardStep:
    """The trainer's forward step (imported late: the trainer imports much more)."""
    from megatron_snip.training.trainer import forward_step

    return forward_step


# -- per-module measurement ------------------------------------------------------------------------

def squared_norm(t: torch.Tensor) -> torch.Tensor:
    """``||t||^2`` as an fp64 0-d tensor (no host sync)."""
    return torch.linalg.vector_norm(t.float(), dtype=torch.float64).square()


@dataclass(frozen=True)
class ModuleLayout:
    """How a linear module is split over its tensor-parallel group.

    Attributes:
        tp, tp_rank: size of the module's TP group and this rank's place in it.
        row: row-parallel (X and W split along in; Y all-reduced, replicated) rather than
            column-parallel (W split along out; X replicated, Y split).
        x_weight, y_weight: 1 where this rank's X- / Y-shaped values are a distinct shard of
            the module's (so they add over TP ranks), 0 on TP ranks > 0 where they are a
            replica (row-parallel Y and its all-reduced errors; column-parallel X and its
            all-reduced dgrad error): one SUM over the TP group then completes every sum.
    """

    tp: int
    tp_rank: int
    row: bool
    x_weight: float
    y_weight: float

    @classmethod
    def of(cls, module: QuantizedLinearMixin) -> ModuleLayout:
        tp = get_pg_size(module.tp_group)
        tp_rank = module.tp_group.rank() if tp > 1 else 0
        row = "x" in module.sharded_operands
        return cls(tp, tp_rank, row, x_weight=1.0 if row or tp_rank == 0 else 0.0,
                   y_weight=1.0 if not row or tp_rank == 0 else 0.0)


class MicrobatchCounter:
    """Index of the micro-batch now in a module's forward, from the order of its forwards.

    Forwards run in micro-batch order within a pass; forwards without grad (the first run of a
    recomputed layer) count separately from those with it (its recomputation), so both runs
    of a micro-batch get the same index.
    """

    def __init__(self):
        self._counts: dict[bool, int] = {}

    def __call__(self) -> int:
        grad = torch.is_grad_enabled()
        m = self._counts.get(grad, 0)
        self._counts[grad] = m + 1
        return m

    def reset(self) -> None:
        """Start a new pass."""
        self._counts.clear()


@dataclass(eq=False)
class _Probe:
    """One module's measurement state on this rank (sums before the TP / DP reduction)."""

    name: str
    module: QuantizedLinearMixin
    layout: ModuleLayout
    formats: list[str]
    unsupported: dict[str, str]
    adam: AdamSlice | None
    states: dict[str, QuantState] = field(default_factory=dict)
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    next_microbatch: MicrobatchCounter = field(default_factory=MicrobatchCounter)
    sigma: float = 0.0

    def add(self, key: str, value: torch.Tensor) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value

    def output_noise(self, y: torch.Tensor, key: int) -> torch.Tensor:
        """Layout-invariant Rademacher noise shaped like this rank's output (column-parallel
        outputs are split along features like the weight's rows)."""
        index = global_flat_index(y.shape, partition_dim=None if self.layout.row else -1,
                                  stride=getattr(self.module.weight, "partition_stride", 1),
                                  rank=self.layout.tp_rank, size=self.layout.tp,
                                  device=y.device)
        return rademacher(index, key).view(y.shape)

    def quantized_gemms(self, fmt: str, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor):
        """(Y, dX, dW) of the module's GEMMs in ``fmt`` on fp32 (tokens, in) x, (out, in) w,
        (tokens, out) dy: the layer's own autograd function, quantizers and TP amax reduction."""
        split = self.layout.tp > 1
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            w = w.detach().requires_grad_()
            y = quantized_linear(x, w, Precision.uniform(fmt), self.module.recipe, self.states[fmt],
                                 amax_reduce=self.module._amax_all_reduce if split else None,
                                 sharded=self.module.sharded_operands if split else frozenset())
            dx, dw = torch.autograd.grad(y, (x, w), dy)
        return y.detach(), dx, dw

    def measure_errors(self, x: torch.Tensor, dy: torch.Tensor, loss_scale: float) -> None:
        """Clean-pass backward: ``||dY||^2`` and every format's exact GEMM errors."""
        w = self.module.weight.detach().float()
        x = x.detach().reshape(-1, x.shape[-1]).float()
        dy = dy.detach().reshape(-1, dy.shape[-1]).float() / loss_scale
        self.add("output_grad_sq", self.layout.y_weight * squared_norm(dy))
        y_ref, dx_ref, dw_ref = x @ w.t(), dy @ w, dy.t() @ x
        sensitivity = None if self.adam is None else self.adam.sensitivity()
        for fmt in self.formats:
            y, dx, dw = self.quantized_gemms(fmt, x, w, dy)
            e_out, e_in = y - y_ref, dx - dx_ref
            # Partial sums over a split reduction dim: the error of the sum is the sum of errors.
            if self.layout.tp > 1 and self.layout.row:
                dist.all_reduce(e_out, group=self.module.tp_group)
            if self.layout.tp > 1 and not self.layout.row:
                dist.all_reduce(e_in, group=self.module.tp_group)
            self.add(f"{fmt}.output_sq", self.layout.y_weight * squared_norm(e_out))
            self.add(f"{fmt}.first_order", self.layout.y_weight * (e_out * dy).sum(dtype=torch.float64))
            self.add(f"{fmt}.input_grad_sq", self.layout.x_weight * squared_norm(e_in))
            if sensitivity is not None:
                self.add(f"{fmt}.update_sq", squared_norm(sensitivity * self.adam.flat(dw - dw_ref)))


# Fields of a module's statistics that are sums of squares over the module's weight update
# (P~-weighted): under the distributed optimizer each data-parallel rank holds the preconditioner
# of its shard only, so these add over data-parallel ranks instead of averaging.
def _dp_sharded_field(key: str) -> bool:
    return key.endswith(".update_sq") or key.startswith("gain.")


def _reduce(probes: list[_Probe], keys: list[str], dp_sharded: bool) -> dict[str, dict[str, float]]:
    """Complete the sums ``keys`` of every probe over TP (SUM; replicas were weighted 0) and
    average them over DP (P~-weighted sums under the distributed optimizer: SUM)."""
    if not probes:
        return {}
    device = probes[0].module.weight.device
    table = torch.stack([torch.stack([torch.as_tensor(p.sums.get(k, 0.0), dtype=torch.float64, device=device)
                                      for k in keys]) for p in probes])
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(table, group=parallel_state.get_tensor_model_parallel_group())
    dp = parallel_state.get_data_parallel_world_size()
    if dp > 1:
        dist.all_reduce(table, group=parallel_state.get_data_parallel_group())
        divisor = torch.tensor([1.0 if dp_sharded and _dp_sharded_field(k) else dp for k in keys],
                               dtype=torch.float64, device=device)
        table = table / divisor
    values = table.tolist()
    return {p.name: dict(zip(keys, row)) for p, row in zip(probes, values)}


@contextlib.contextmanager
def _hooks(probes: list[_Probe], hook: Callable) -> Iterator[None]:
    """``hook(probe, input, output)`` after every probed module's forward (its return value, if
    not None, replaces the output)."""
    handles = [p.module.register_forward_hook(lambda mod, args, kwargs, out, p=p: hook(p, _input(args, kwargs), out),
                                              with_kwargs=True) for p in probes]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _input(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["input_"]


def needs_grad(out) -> bool:
    """Whether a linear's forward output (output, bias) will receive a gradient."""
    return torch.is_grad_enabled() and out[0].requires_grad


# -- the cycle -------------------------------------------------------------------------------------

def run_probe_cycle(
    model: Sequence[torch.nn.Module],
    optimizer,
    controller: PrecisionController,
    data_iterator: Iterator | None,
    *,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    config: ProbeConfig = ProbeConfig(),
    forward_step_func: ForwardStep | None = None,
    loss_key: str = "lm loss",
    iteration: int | None = None,
) -> ProbeStatistics:
    """Measure this pipeline stage's modules on one probe batch (call on every rank at once).

    Args:
        model: this rank's model chunks (one, DDP-wrapped), as the trainer holds them.
        optimizer: the megatron optimizer (Adam state after >= 1 step).
        controller: the :class:`PrecisionController` of ``model`` (names the modules).
        data_iterator: yields this rank's probe micro-batches (dicts the forward step reads);
            exactly ``num_microbatches`` are read. Not the training iterator.
        num_microbatches, seq_length, micro_batch_size: the probe batch, as for the schedule.
        config: probe settings.
        forward_step_func: megatron forward step (default: the trainer's).
        loss_key: key of the reported loss in the loss function's dict.
        iteration: recorded in the statistics.
    Returns:
        this stage's :class:`ProbeStatistics` (``loss`` only on the last stage); pass it to
        :func:`gather_across_pipeline`.
    """
    chunks = list(model)
    runner = PassRunner(chunks, data_iterator, num_microbatches=num_microbatches, seq_length=seq_length,
                        micro_batch_size=micro_batch_size,
                        forward_step_func=forward_step_func or default_forward_step(), loss_key=loss_key)
    adam = AdamView(optimizer, chunks)
    modules = controller.modules()
    probes = [_make_probe(name, module, config.formats, adam) for name, module in modules.items()]
    with preserved_training_state(chunks, modules, config.restore_grads) as rng:
        for module in modules.values():
            module.precision = BF16
        loss_scale = runner.loss_scale
        rng.restore()
        loss = _clean_pass(runner, probes, loss_scale)
        update_sq = adam.model_sum(lambda s: squared_norm(s.update(s.flat(s.param.main_grad) / loss_scale)))
        clean_keys = ["input_numel", "output_numel", "input_sq", "weight_sq", "output_sq", "output_grad_sq",
                      *[f"{f}.{k}" for f in config.formats
                        for k in ("output_sq", "first_order", "input_grad_sq", "update_sq")]]
        clean = _reduce(probes, clean_keys, adam.dp_sharded)
        for p in probes:
            rms = math.sqrt(clean[p.name]["output_sq"] / clean[p.name]["output_numel"])
            p.sigma = config.output_noise * (rms if rms > 0 else 1.0)
        for k in range(config.hutchinson_probes):
            _hutchinson_pair(runner, probes, rng, noise_key(config.seed, "output", k), k, loss_scale)
        param_sigma = _param_sigma(adam, config)
        _perturbation_pairs(runner, probes, rng, adam, param_sigma, config)
        noise_keys = ([f"curvature.{k}" for k in range(config.hutchinson_probes)]
                      + [f"gain.{k}" for k in range(config.perturbation_probes)])
        noisy = _reduce(probes, noise_keys, adam.dp_sharded)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    stats = {p.name: _module_statistics(p, {**clean[p.name], **noisy[p.name]}, config, param_sigma, stage)
             for p in probes}
    return ProbeStatistics(
        modules=stats, formats=list(config.formats), loss=loss, update_sq=update_sq,
        data_parallel_size=parallel_state.get_data_parallel_world_size(), num_microbatches=num_microbatches,
        micro_batch_size=micro_batch_size, seq_length=seq_length, iteration=iteration,
        settings={**asdict(config), "formats": list(config.formats), "param_sigma": param_sigma,
                  "optimizer_dp_sharded": adam.dp_sharded},
        stages=[stage],
    )


def _make_probe(name: str, module: QuantizedLinearMixin, formats: Sequence[str], adam: AdamView) -> _Probe:
    supported, unsupported = [], {}
    for fmt in formats:
        try:
            module.check_precision(Precision.uniform(fmt), module.recipe)
            supported.append(fmt)
        except ValueError as e:
            unsupported[fmt] = str(e)
    probe = _Probe(name, module, ModuleLayout.of(module), supported, unsupported, adam=adam.slices.get(module.weight))
    # Private quantization states: the module's own RNG stream and delayed-scaling history stay
    # untouched; the same seed gives the same Hadamard signs the module uses.
    for fmt in supported:
        state = QuantState(module.quant_state.seed, module.quant_state.stream)
        state.delayed = copy.deepcopy(module.quant_state.delayed)
        probe.states[fmt] = state
    return probe


def _clean_pass(runner: PassRunner, probes: list[_Probe], loss_scale: float) -> float | None:
    def hook(p: _Probe, x: torch.Tensor, out):
        if not needs_grad(out):
            return None
        y = out[0]
        p.add("input_numel", p.layout.x_weight * x.numel())
        p.add("output_numel", p.layout.y_weight * y.numel())
        p.add("input_sq", p.layout.x_weight * squared_norm(x))
        p.add("output_sq", p.layout.y_weight * squared_norm(y))
        y.register_hook(lambda dy: p.measure_errors(x, dy, loss_scale))
        return None

    for p in probes:
        p.add("weight_sq", squared_norm(p.module.weight))
    with _hooks(probes, hook):
        return runner.run(forward_only=False)


def _hutchinson_pair(runner: PassRunner, probes: list[_Probe], rng: RngStates, key: int, k: int,
                     loss_scale: float) -> None:
    """Passes with ``+sigma_l Z`` and ``-sigma_l Z`` at every module output (Z drawn per module
    and micro-batch); accumulates ``<Z, G+ - G->`` as ``curvature.k``."""
    for sign in (1.0, -1.0):
        def hook(p: _Probe, x: torch.Tensor, out, sign=sign):
            y = out[0]
            m_key = noise_key(key, p.name, p.next_microbatch())
            # In the output's dtype: a bf16 model must stay bf16 downstream (and across stages).
            noisy = y + ((sign * p.sigma) * p.output_noise(y, m_key)).to(y.dtype)
            if needs_grad(out):
                def read(g, p=p, m_key=m_key):
                    # Z is +-1, so the products are exact in fp32; the sum runs in fp64.
                    dot = (p.output_noise(g, m_key) * g.float()).sum(dtype=torch.float64)
                    p.add(f"curvature.{k}", (sign * p.layout.y_weight / loss_scale) * dot)
                noisy.register_hook(read)
            return (noisy, *out[1:])

        for p in probes:
            p.next_microbatch.reset()
        rng.restore()
        with _hooks(probes, hook):
            runner.run(forward_only=False)


def _param_sigma(adam: AdamView, config: ProbeConfig) -> float:
    """The perturbation scale sigma with ``||sigma P~ w|| = rel * ||theta||`` over the whole model
    (Rademacher w: ``||P~ w|| = ||P~||`` exactly)."""
    rel = config.param_noise
    if rel is None:
        dtypes = {s.param.dtype for s in adam.slices.values()}
        rel = 1e-3 if dtypes <= {torch.float32, torch.float64} else 3e-2
    theta_sq = adam.model_sum(lambda s: squared_norm(s.flat(s.param.detach())))
    sens_sq = adam.model_sum(lambda s: squared_norm(s.sensitivity()))
    return rel * math.sqrt(theta_sq / sens_sq)


def _perturbation_pairs(runner: PassRunner, probes: list[_Probe], rng: RngStates, adam: AdamView, sigma: float,
                        config: ProbeConfig) -> None:
    """For each draw k, forward passes with every parameter at ``theta +- sigma P~ w_k``; accumulates
    every module's ``||X+ - X-||^2`` as ``gain.k``. The parameters are restored bit for bit."""
    saved = {s: s.flat(s.param.detach()).clone() for s in adam.slices.values()}
    plus: dict[tuple[str, int], torch.Tensor] = {}

    def record(p: _Probe, x: torch.Tensor, out, k: int):
        plus[p.name, p.next_microbatch()] = x.detach().float().clone()

    def compare(p: _Probe, x: torch.Tensor, out, k: int):
        x_plus = plus.pop((p.name, p.next_microbatch()))
        p.add(f"gain.{k}", p.layout.x_weight * squared_norm(x.detach().float() - x_plus))

    try:
        for k in range(config.perturbation_probes):
            key = noise_key(config.seed, "param", k)
            for sign, hook in ((1.0, record), (-1.0, compare)):
                with torch.no_grad():
                    for s, original in saved.items():
                        w = rademacher(param_global_index(s.param, s.start, s.end), noise_key(key, s.name))
                        perturbed = original.float() + sign * sigma * s.sensitivity() * w
                        s.flat(s.param.data).copy_(perturbed.to(s.param.dtype))
                for p in probes:
                    p.next_microbatch.reset()
                rng.restore()
                with _hooks(probes, lambda p, x, out: hook(p, x, out, k)):
                    runner.run(forward_only=True)
    finally:
        with torch.no_grad():
            for s, original in saved.items():
                s.flat(s.param.data).copy_(original)


def _module_statistics(p: _Probe, sums: dict[str, float], config: ProbeConfig, param_sigma: float,
                       stage: int) -> ModuleStatistics:
    layer, _ = parse_module_name(p.name)
    out_local, in_local = p.module.weight.shape
    tp = p.layout.tp
    curv = [hutchinson_trace(sums[f"curvature.{k}"], p.sigma) for k in range(config.hutchinson_probes)]
    gains = [perturbation_gain(sums[f"gain.{k}"], param_sigma) for k in range(config.perturbation_probes)]
    return ModuleStatistics(
        name=p.name, layer=layer, stage=stage,
        in_features=in_local * (tp if p.layout.row else 1), out_features=out_local * (1 if p.layout.row else tp),
        input_numel=sums["input_numel"], output_numel=sums["output_numel"], input_sq=sums["input_sq"],
        weight_sq=sums["weight_sq"], output_sq=sums["output_sq"], output_grad_sq=sums["output_grad_sq"],
        curvature=sum(curv) / len(curv), curvature_probes=curv, gain=sum(gains) / len(gains), gain_probes=gains,
        errors={f: FormatErrors(sums[f"{f}.output_sq"], sums[f"{f}.first_order"], sums[f"{f}.input_grad_sq"],
                                sums[f"{f}.update_sq"]) for f in p.formats},
        unsupported=dict(p.unsupported),
    )


def gather_across_pipeline(stats: ProbeStatistics) -> ProbeStatistics:
    """Every stage's statistics merged, on every rank (all_gather_object over the pipeline
    group; call on all ranks)."""
    group = parallel_state.get_pipeline_model_parallel_group()
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, stats.to_dict(), group=group)
    return ProbeStatistics.merge(ProbeStatistics.from_dict(p) for p in parts)
