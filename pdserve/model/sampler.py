"""Batched sampling with no host sync: greedy / temperature -> top-k -> top-p -> sample.

Sampling uses the exponential trick: argmax(probs / q) with q ~ Exp(1) per vocabulary entry draws
exactly from `probs` (it is Gumbel-max in disguise) and, unlike torch.multinomial, never waits for the
device. A row with its own torch.Generator (a request with a seed) draws its noise from that
generator alone, so its samples do not depend on which other requests share the batch; rows
without one share a single draw from the default generator.

temperatures, top_ps and top_ks may be [N] tensors on the logits' device, or Python lists. Lists are
host values, so they also let the sampler skip work without a sync: an all-greedy batch is one argmax,
and a batch where nobody uses top-k/top-p sorts nothing.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pdserve.model import triton_argmax
from pdserve.model.host_copy import to_device

Values = torch.Tensor | Sequence[float]


def sample(logits: torch.Tensor, temperatures: Values, top_ps: Values, top_ks: Values,
           generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """logits: [N, V] float32. temperature 0 means greedy (an exact argmax of the logits); top_k <= 0
    (or >= V, however large) means no top-k cut; top_p 1.0 means no top-p cut. generators: one per
    row, None or a torch.Generator on the logits' device. Returns the sampled token ids, [N] int64 on
    the device."""
    # A host list shows how many rows are greedy (temperature 0: the argmax) without a device sync.
    num_greedy = sum(t == 0 for t in temperatures) if _is_host(temperatures) else None
    if num_greedy == len(temperatures):
        return argmax_rows(logits)
    device = logits.device
    vocab_size = logits.shape[-1]
    greedy_ids = None if num_greedy == 0 else argmax_rows(logits)
    temperatures = _as_tensor(temperatures, torch.float32, device)
    is_greedy = temperatures == 0
    logits = logits / torch.where(is_greedy, 1.0, temperatures)[:, None]  # [N, V]
    needs_cut = not (_is_host(top_ks) and _is_host(top_ps)
                     and all(k <= 0 or k >= vocab_size for k in top_ks) and all(p >= 1.0 for p in top_ps))
    if needs_cut:
        if _is_host(top_ks):
            # Past the vocabulary a top_k cuts nothing: clamp before it becomes an int64, so that no
            # value (SamplingParams bounds it, but a caller may skip that) can overflow the tensor.
            top_ks = [min(max(k, 0), vocab_size) for k in top_ks]
        logits = apply_top_k_top_p(logits, _as_tensor(top_ks, torch.int64, device),
                                   _as_tensor(top_ps, torch.float32, device))
    probs = logits.softmax(dim=-1)  # [N, V]
    sampled_ids = argmax_rows(probs / _exponential_noise(probs.shape, generators, device))
    return sampled_ids if greedy_ids is None else torch.where(is_greedy, greedy_ids, sampled_ids)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1), the first index of each row's maximum. On CUDA through
    model/triton_argmax.py: torch reduces a row in one thread block, so few rows of a large
    vocabulary leave the GPU nearly idle."""
    if triton_argmax.supports(logits):
        return triton_argmax.argmax_triton(logits)
    return logits.argmax(dim=-1)


class Sampler(nn.Module):
    """sample() as a module, for a model runner that keeps its steps as modules."""

    def forward(self, logits: torch.Tensor, temperatures: Values, top_ps: Values, top_ks: Values,
                generators: Sequence[torch.Generator | None]) -> torch.Tensor:
        return sample(logits, temperatures, top_ps, top_ks, generators)


def apply_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside the row's top-k, then outside its top-p nucleus (the smallest
    set of most likely tokens holding at least top_p of the top-k renormalised mass; the most likely
    token always stays). logits: [N, V]; top_ks: [N] int (0 = no cut); top_ps: [N] float."""
    vocab_size = logits.shape[-1]
    sorted_logits, sorted_ids = logits.sort(dim=-1)  # ascending, [N, V]
    k = torch.where(top_ks > 0, top_ks, vocab_size).clamp(max=vocab_size)
    kth_largest = sorted_logits.gather(1, (vocab_size - k)[:, None])  # [N, 1]
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, float("-inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [N, V], ascending mass
    outside_nucleus = cumulative <= 1.0 - top_ps[:, None]
    outside_nucleus[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(outside_nucleus, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)


def _exponential_noise(shape: torch.Size, generators: Sequence[torch.Generator | None],
                       device: torch.device) -> torch.Tensor:
    noise = torch.empty(shape, device=device)  # [N, V]
    if any(generator is None for generator in generators):
        noise.exponential_()  # one shared draw for the rows without a seed
    for row, generator in enumerate(generators):
        if generator is not None:
            _draw_row(noise[row], generator)
    # A zero draw would turn a masked token's 0 / 0 into NaN, which argmax would pick.
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)


def _draw_row(row: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The one draw a seeded row takes per sampled token: V exponentials, whatever the row's
    temperature, top-k or top-p (the noise covers the whole vocabulary; the cuts mask the probabilities
    instead). Greedy rows take none: they get no generator."""
    return row.exponential_(generator=generator)


def skip_draws(generator: torch.Generator, vocab_size: int, num_draws: int, device: torch.device) -> None:
    """Advance a seeded request's generator past `num_draws` sampled tokens, as if it had sampled them
    here: a request resumed on this instance with tokens another one generated continues the same
    random stream. The same draws replayed one by one, exactly as the sampler takes them: one larger
    draw happens to advance a CPU generator the same way on torch 2.13, but nothing promises it, and it
    saved little (1.3 vs 2.2 ms per 49,152-entry draw on a loaded CPU: generating the numbers is the cost).
    On CPU that is ~2 ms per token of a 49k vocabulary, paid once per recovery inside the step that
    first samples for the request; on CUDA one small kernel per token."""
    row = torch.empty(vocab_size, device=device)
    for _ in range(num_draws):
        _draw_row(row, generator)


def _is_host(values: Values) -> bool:
    return not isinstance(values, torch.Tensor)


def _as_tensor(values: Values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.to(device=device, dtype=dtype)
    return to_device(values, dtype, device)
