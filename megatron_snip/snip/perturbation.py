"""The parameter perturbation of the probe passes: every parameter moved to ``theta + sigma R w_k``.

``R`` is the update metric's response of Adam's next step to the gradient (``AdamSlice.in_metric``
of ``P~ = du/dg``, at the clean gradient) and ``w_k`` layout-invariant Rademacher noise of draw k
(``noise.param_noise``). A forward at the perturbed parameters moves every module's input X_l by
``sigma J_l R w_k`` (J_l = dX_l / d(parameters below)), to first order, so that for an error e at X_l

    E_w <J_l R w, e>^2 = ||R * J_l^T e||^2,

the drift in the update metric that e, flowing down into the lower parameters' gradients, causes in
their update: the propagated part of the update divergence (docs/snip.md, "Backward: update
divergence"). Every rank of a data-parallel replica runs its forward on the same parameters, so every
rank applies the perturbation of every slice of the model it holds: under the distributed optimizer,
its own slices' and, exchanged once per cycle, the other data- and context-parallel ranks'.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Collection, Iterator, Sequence

import torch
import torch.distributed as dist

from megatron_snip.compat.device import current_device

from .adam_view import AdamSlice, AdamView
from .module_probe import squared_norm
from .noise import noise_key, param_noise


def unmatched_gain_excludes(names: Collection[str], excludes: Sequence[str]) -> str | None:
    """Why ``--snip-gain-exclude`` is wrong, or None: a pattern that names no parameter of the model
    (``names``: this rank's global parameter names) would silently measure the default gains.
    Collective over every rank: a pipeline stage may hold none of a pattern's parameters."""
    found = torch.tensor([float(any(e in n for n in names)) for e in excludes], dtype=torch.float64,
                         device=current_device())
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    missing = [e for e, f in zip(excludes, found.tolist()) if not f]
    if not missing:
        return None
    some = ", ".join(sorted(names)[:4])
    return (f"--snip-gain-exclude {' '.join(missing)}: names no parameter of the model; give a part of a parameter "
            f"name, e.g. 'embedding' (the model has {some}, ...)")


class ParameterPerturbation:
    """``theta -> theta + sigma R w_k`` for draw k, on every parameter slice this rank's forward uses.

    Args:
        adam: this rank's optimizer state (:class:`AdamView`).
        responses: R of every slice this rank's optimizer updates (flat fp32).
        relative_size: sigma is set so that ``||sigma R w|| = relative_size * ||theta||`` over the whole
            model (Rademacher w: ``||R w|| = ||R||`` exactly).
        seed: the noise seed; draw k's noise is keyed by (seed, k, parameter name).
        draws: K, the number of draws (their signs are kept: a byte per element up to 8 draws).
        excludes: name substrings of parameters left unperturbed (``--snip-gain-exclude``); sigma is the
            unrestricted one, so the others move exactly as without exclusions.

    Collective (the model-wide norms, the exchange between the data- and context-parallel ranks the
    distributed optimizer shards over): every rank constructs it at once.
    """

    def __init__(self, adam: AdamView, responses: dict[AdamSlice, torch.Tensor], relative_size: float, seed: int,
                 draws: int, excludes: Sequence[str] = ()):
        theta_sq = adam.model_sum(lambda s: squared_norm(s.flat(s.param.detach())))
        response_sq = adam.model_sum(lambda s: squared_norm(responses[s]))
        self.sigma = relative_size * math.sqrt(theta_sq / response_sq)
        if excludes:
            error = unmatched_gain_excludes([s.name for s in adam.slices.values()], excludes)
            if error:
                raise ValueError(error)
            responses = {s: torch.zeros_like(r) if any(e in s.name for e in excludes) else r
                         for s, r in responses.items()}
        self.responses = {**responses, **adam.sharding_peers(responses)}
        self._original = {s: _Original(s) for s in self.responses}
        # Every draw's signs, hashed once (a bit per draw and element) rather than once per micro-batch group.
        keys = [noise_key(seed, "param", k) for k in range(draws)]
        dtype = torch.uint8 if draws <= 8 else torch.int32 if draws <= 31 else torch.int64
        self._signs = {}
        for s in self.responses:
            bits = torch.zeros(s.end - s.start, dtype=dtype, device=s.param.device)
            for k, key in enumerate(keys):
                negative = param_noise(s.param, noise_key(key, s.name), s.start, s.end) < 0
                bits.bitwise_or_(negative.to(dtype).bitwise_left_shift_(k))
            self._signs[s] = bits

    @contextlib.contextmanager
    def applied(self, k: int) -> Iterator[None]:
        """The parameters at draw k's perturbed values inside; restored bit for bit on exit (from the
        optimizer's main copy where it gives them, else from a copy taken at construction)."""
        try:
            with torch.no_grad():
                for s, original in self._original.items():
                    w = ((self._signs[s] >> k) & 1).float().mul_(-2.0).add_(1.0)
                    perturbed = torch.addcmul(original.values().float(), self.responses[s], w, value=self.sigma)
                    s.flat(s.param.data).copy_(perturbed)
            yield
        finally:
            with torch.no_grad():
                for s, original in self._original.items():
                    s.flat(s.param.data).copy_(original.values())


class _Original:
    """A parameter slice's values before the perturbation: rebuilt from the optimizer's main copy on
    demand where that gives them bit for bit (``AdamSlice.main_as_param``), else copied."""

    def __init__(self, s: AdamSlice):
        self.slice = s
        self.copy = None if s.main_as_param() is not None else s.flat(s.param.detach()).clone()

    def values(self) -> torch.Tensor:
        return self.copy if self.copy is not None else self.slice.main.detach().view(-1).to(self.slice.param.dtype)
