"""Running probe passes through megatron's pipeline schedule without leaving a trace.

:class:`PassRunner` replays the same recorded micro-batches through any pipeline
layout; :func:`preserved_training_state` puts precisions, quantization states, RNG
states and gradient buffers back afterwards.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_attr_wrapped_model, get_model_config

from megatron_snip.compat.device import has_cuda
from megatron_snip.model.compile import eager_layers
from megatron_snip.model.quantized.layers import PlanLinear
from megatron_snip.model.step import LOSS_KEY, forward_step, reduced_losses

ForwardStep = Callable  # (data_iterator, model) -> (output, loss_func), as megatron's schedules call it

class RngStates:
    """The torch CPU/CUDA RNG states and megatron's RNG tracker states, captured once."""

    def __init__(self):
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if has_cuda() else None
        tracker = tensor_parallel.get_cuda_rng_tracker()
        self.tracker = {k: v.clone() for k, v in tracker.get_states().items()} if tracker.is_initialized() else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        if self.tracker is not None:
            tensor_parallel.get_cuda_rng_tracker().set_states({k: v.clone() for k, v in self.tracker.items()})


@contextlib.contextmanager
def preserved_training_state(chunks: Sequence[torch.nn.Module], modules: dict[str, PlanLinear],
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
    # With the distributed optimizer's overlapped param gather, DDP all-gathers the parameters at the
    # first forward after each gradient sync (and the interleaved schedule dispatches gathers through
    # config.param_sync_func); within a probe that would copy one rank's perturbed shard into the
    # others' models (and leave it there after the rank restored its own). Gather once now, and keep
    # both off until the probe ends.
    gathering = [chunk for chunk in chunks if getattr(chunk, "use_forward_hook", False)]
    config = get_model_config(chunks[0])
    param_sync_func = config.param_sync_func
    for chunk in gathering:
        chunk.disable_forward_pre_hook(param_sync=True)
    if gathering:
        config.param_sync_func = None
    try:
        yield rng
    finally:
        config.param_sync_func = param_sync_func
        for chunk in gathering:
            chunk.enable_forward_pre_hook()
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
                 seq_length: int, micro_batch_size: int, forward_step_func: ForwardStep = forward_step,
                 loss_key: str = LOSS_KEY):
        config = get_model_config(chunks[0])
        if config.calculate_per_token_loss:
            raise ValueError("SNIP probes need the loss averaged per micro-batch; calculate_per_token_loss is set")
        self.chunks = list(chunks)
        self.config = config
        self.num_microbatches = num_microbatches
        self.seq_length, self.micro_batch_size = seq_length, micro_batch_size
        self.forward_step_func, self.loss_key = forward_step_func, loss_key
        self._source, self._batches = data_iterator, None
        self._schedule = get_forward_backward_func()

    @property
    def loss_scale(self) -> float:
        """The grad scaler's factor on the loss before backward (1 without one): the reduced weight
        gradients (``main_grad``) are that many times dL/dtheta."""
        f = self.config.grad_scale_func
        device = next(self.chunks[0].parameters()).device
        return 1.0 if f is None else float(f(torch.ones(1, device=device)).item())

    @property
    def output_grad_scale(self) -> float:
        """How many times dL/dY the activation gradients of a backward pass are: the grad scaler's
        factor, and the context-parallel size, which megatron-core's schedule multiplies each
        micro-batch's loss by (``forward_step_calc_loss``) and DDP's average over the data- and
        context-parallel ranks divides back out of the weight gradients."""
        return self.loss_scale * parallel_state.get_context_parallel_world_size()

    def groups(self) -> list[range]:
        """The micro-batches a pass may run alone, in order: each one, or the whole batch under the
        interleaved schedule (its micro-batch groups span the pipeline)."""
        if len(self.chunks) > 1:
            return [range(self.num_microbatches)]
        return [range(m, m + 1) for m in range(self.num_microbatches)]

    def _data(self, microbatches: range) -> Iterator | list | None:
        if self._source is None:
            data = None
        elif self._batches is None:
            if len(microbatches) != self.num_microbatches:
                raise ValueError("the first pass reads the whole batch; later passes may run part of it")
            self._batches = []
            data = self._record()
        else:
            data = iter(self._batches[microbatches.start:microbatches.stop])
        if len(self.chunks) == 1:
            return data
        # The interleaved schedule reads one iterator per chunk (virtual stage), each the same micro-batches.
        return [None] * len(self.chunks) if data is None else list(itertools.tee(data, len(self.chunks)))

    def _record(self) -> Iterator:
        for i in range(self.num_microbatches):
            try:
                batch = next(self._source)
            except StopIteration:
                raise ValueError(f"the probe data iterator ran out after {i} of {self.num_microbatches} "
                                 "micro-batches") from None
            self._batches.append(batch)
            yield batch

    def run(self, forward_only: bool, microbatches: range | None = None, sync_grads: bool = True) -> float | None:
        """One pass over ``microbatches`` (default: all; a part, as :meth:`groups` cuts them, after the
        first pass); returns the mean loss on the last stage (None elsewhere).

        A part's backward scales each micro-batch's loss by ``1 / len(microbatches)`` (megatron-core's
        schedule divides by the micro-batches it runs), not by the batch's. ``sync_grads`` False: the
        weight gradients stay this rank's, not reduced over the data-parallel ranks (a pass that reads
        only activation gradients need not pay for that)."""
        out = self._run(forward_only, microbatches, sync_grads, self.forward_step_func, contextlib.nullcontext())
        return sum(reduced_losses(out, self.loss_key).tolist()) / len(out) if out else None

    def run_decoder(self, microbatches: range | None = None) -> None:
        """A forward-only pass through the transformer layers alone: the last stage stops after the final
        layer norm (no output layer, no loss), for passes that read only the linears' inputs."""
        models = [get_attr_wrapped_model(chunk, "post_process", return_model_obj=True) for chunk in self.chunks]
        self._run(True, microbatches, True, _hidden_states_only(self.forward_step_func), _no_postprocess(models))

    def _run(self, forward_only: bool, microbatches: range | None, sync_grads: bool, step: ForwardStep,
             context) -> list:
        """The schedule's pass over ``microbatches`` (what it returns: the last stage's per-micro-batch outputs)."""
        microbatches = range(self.num_microbatches) if microbatches is None else microbatches
        if not forward_only:
            for chunk in self.chunks:
                chunk.zero_grad_buffer()
        # The passes hook the linears, which compiled layers would not call (--torch-compile): layers run eagerly.
        with (torch.no_grad() if forward_only else contextlib.nullcontext()), \
                (contextlib.nullcontext() if forward_only or sync_grads else self._unsynced()), eager_layers(), context:
            out = self._schedule(forward_step_func=step, data_iterator=self._data(microbatches),
                                 model=self.chunks, num_microbatches=len(microbatches),
                                 seq_length=self.seq_length, micro_batch_size=self.micro_batch_size,
                                 forward_only=forward_only)
        return out

    @contextlib.contextmanager
    def _unsynced(self) -> Iterator[None]:
        """DDP's gradient reduction off: every micro-batch inside its chunks' ``no_sync`` (overlapped
        reduction launches nothing), and the schedule's own switches (its no-sync function for all but the
        last micro-batch, the interleaved schedule's grad-sync dispatch, the final reduction) unset."""
        config = self.config
        saved = config.no_sync_func, config.grad_sync_func, config.finalize_model_grads_func
        config.no_sync_func = config.grad_sync_func = config.finalize_model_grads_func = None
        try:
            with contextlib.ExitStack() as stack:
                for chunk in self.chunks:
                    stack.enter_context(chunk.no_sync())
                yield
        finally:
            config.no_sync_func, config.grad_sync_func, config.finalize_model_grads_func = saved


def _hidden_states_only(step: ForwardStep) -> ForwardStep:
    """``step`` without its loss function: the schedule keeps the last stage's output as it is."""
    def run(data_iterator, model):
        output, _ = step(data_iterator, model)
        return output, None
    return run


@contextlib.contextmanager
def _no_postprocess(models: Sequence[torch.nn.Module]) -> Iterator[None]:
    """megatron-core's GPT models return the decoder's hidden states (``post_process`` off) inside."""
    saved = [m.post_process for m in models]
    try:
        for m in models:
            m.post_process = False
        yield
    finally:
        for m, value in zip(models, saved):
            m.post_process = value
