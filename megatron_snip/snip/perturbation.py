"""The parameter perturbation of the probe passes: every parameter moved to ``theta + sigma R w_k``.

``R`` is the update metric's response of Adam's next step to the gradient (``AdamSlice.in_metric``
of ``P~ = du/dg``, at the clean gradient) and ``w_k`` layout-invariant Rademacher noise of draw k
(``noise.param_sign_bits``). A forward at the perturbed parameters moves every module's input X_l by
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
from .noise import noise_key, param_sign_bits


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


# Parameters (global names) after the last transformer layer: the perturbation passes read only the inputs of the
# layers' linears, so moving these would change nothing they measure.
DOWNSTREAM = ("output_layer.", "decoder.final_layernorm.")


class ParameterPerturbation:
    """``theta -> theta + sigma R w_k`` for draw k, on every parameter slice this rank's forward uses.

    Args:
        adam: this rank's optimizer state (:class:`AdamView`).
        responses: R of every slice this rank's optimizer updates (flat fp32).
        relative_size: sigma is set so that ``||sigma R w|| = relative_size * ||theta||`` over the whole
            model (Rademacher w: ``||R w|| = ||R||`` exactly).
        seed: the noise seed; draw k's noise is keyed by (seed, k // 8, parameter name).
        draws: K, the number of draws (their signs are kept: a byte per element and eight draws).
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
        # Left where they are: the excluded parameters, and those downstream of every linear's input, whose
        # perturbation no measurement would see.
        self._steps = {s: self.sigma * r for s, r in {**responses, **adam.sharding_peers(responses)}.items()
                       if not any(e in s.name for e in excludes) and not s.name.startswith(DOWNSTREAM)}
        self._original = {s: _Original(s) for s in self._steps}
        # Every draw's signs, hashed once rather than once per micro-batch group: a byte per element and eight
        # draws (bit k % 8 of byte k // 8 set where draw k is -1).
        keys = [noise_key(seed, "param", j) for j in range(math.ceil(draws / 8))]
        self._signs = {s: [param_sign_bits(s.param, noise_key(key, s.name), s.start, s.end) for key in keys]
                       for s in self._steps}

    @contextlib.contextmanager
    def applied(self, k: int) -> Iterator[None]:
        """The parameters at draw k's perturbed values inside; restored bit for bit on exit (from the
        optimizer's main copy where it gives them, else from a copy taken at construction)."""
        try:
            with torch.no_grad():
                for s, original in self._original.items():
                    w = ((self._signs[s][k // 8] >> (k % 8)) & 1).float().mul_(-2.0).add_(1.0)
                    s.flat(s.param.data).copy_(torch.addcmul(original.values().float(), self._steps[s], w))
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
