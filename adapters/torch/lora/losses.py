"""Tinker's built-in losses on per-token target logprobs, summed over tokens (``loss:sum``).

Every function takes 1-D float32 tensors over the same tokens: ``logp`` (the learner's
logprobs of the target tokens, differentiable), and the datum inputs. With ``q`` the
sampler's ``logprobs``, ``A`` the ``advantages`` and ``r = exp(logp - q)``:

- ``cross_entropy``:       ``-sum(weights * logp)``
- ``importance_sampling``: ``-sum(r * A)``
- ``ppo``:                 ``-sum(min(r * A, clamp(r, low, high) * A))``
- ``cispo``:               ``-sum(stopgrad(clamp(r, low, high)) * logp * A)``
- ``dro``:                 ``-sum(logp * A - 0.5 * beta * (logp - q) ** 2)``
- ``stable_reinforce``:    ``-sum(m * trust(r) * r * A) + kl_coeff * sum(m * (r - 1 - log r))``
  with ``q`` the sampler's logprobs as the server recorded them, ``m`` the sampled
  positions, ``trust(r)`` 1 inside ``STABLE_REINFORCE_TRUST`` and 0 outside (no gradient
  through it): the importance-weighted REINFORCE gradient on tokens the learner still
  agrees with, and a KL(sampler || learner) penalty (the k3 estimator) on all of them.

``low``/``high`` are ``clip_low_threshold`` / ``clip_high_threshold``, bounds on the ratio
itself; configs are resolved (defaults, checks) by ``domain.tinker.checks.loss_config``.
"""

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from domain.tinker.values import STABLE_REINFORCE_TRUST

Inputs = Mapping[str, Tensor]


def loss_sum(loss_fn: str, logp: Tensor, inputs: Inputs, config: Mapping[str, float]) -> Tensor:
    """The summed loss (a 0-d tensor) for ``logp`` ``[N]`` and ``inputs`` (each ``[N]``)."""
    return _LOSSES[loss_fn](logp, inputs, config)


def _cross_entropy(logp: Tensor, inputs: Inputs, config: Mapping[str, float]) -> Tensor:
    return -(inputs["weights"] * logp).sum()


def _importance_sampling(logp: Tensor, inputs: Inputs, config: Mapping[str, float]) -> Tensor:
    ratio = torch.exp(logp - inputs["logprobs"])
    return -(ratio * inputs["advantages"]).sum()


def _ppo(logp: Tensor, inputs: Inputs, config: Mapping[str, float]) -> Tensor:
    ratio = torch.exp(logp - inputs["logprobs"])
    clipped = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
    advantages = inputs["advantages"]
    return -torch.minimum(ratio * advantages, clipped * advantages).sum()


def _cispo(logp: Tensor, inputs: Inputs, config: Mapping[str, float]) -> Tensor:
    ratio = torch.exp(logp - inputs["logprobs"]).detach()
    clipped = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
    return -(clipped * logp * inputs["advantages"]).sum()


def _dro(logp: Tensor, inputs: Inputs, config: Mapping[str, float]) -> Tensor:
    penalty = (logp - inputs["logprobs"]) ** 2
    return -(logp * inputs["advantages"] - 0.5 * config["beta"] * penalty).sum()


def _gspo(logp: Tensor, inputs: Inputs, config: Mapping[str, float]) -> Tensor:
    """GSPO-token (Tinker's): each datum's ratio is the geometric mean of its token ratios
    over the positions ``sequence_ratio_mask`` marks (none marked: 1); every token carries
    that value with its own log-probability's gradient, clipped as PPO. ``segment``: each
    position's datum (the batch's data are concatenated)."""
    segment = inputs["segment"]
    marked = (inputs["sequence_ratio_mask"] != 0).to(logp.dtype)
    count = int(segment.max()) + 1
    per_token = (logp.detach() - inputs["logprobs"]) * marked
    sums = torch.zeros(count, dtype=logp.dtype, device=logp.device).index_add_(
        0, segment, per_token
    )
    counts = torch.zeros(count, dtype=logp.dtype, device=logp.device).index_add_(0, segment, marked)
    log_ratio = (sums / counts.clamp_min(1.0))[segment]
    ratio = torch.exp(log_ratio + logp - logp.detach())
    clipped = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
    advantages = inputs["advantages"]
    return -torch.minimum(ratio * advantages, clipped * advantages).sum()


def _stable_reinforce(logp: Tensor, inputs: Inputs, config: Mapping[str, float]) -> Tensor:
    mask = inputs["sampled_mask"]
    log_ratio = (logp - inputs["logprobs"]) * mask
    ratio = torch.exp(log_ratio)
    low, high = STABLE_REINFORCE_TRUST
    trusted = ((ratio >= low) & (ratio <= high)).to(logp.dtype).detach() * mask
    policy = -(trusted * ratio * inputs["advantages"]).sum()
    return policy + config["kl_coeff"] * (mask * (ratio - 1.0 - log_ratio)).sum()


_LOSSES: dict[str, Callable[[Tensor, Inputs, Mapping[str, float]], Tensor]] = {
    "cross_entropy": _cross_entropy,
    "importance_sampling": _importance_sampling,
    "ppo": _ppo,
    "cispo": _cispo,
    "dro": _dro,
    "gspo": _gspo,
    "stable_reinforce": _stable_reinforce,
}
