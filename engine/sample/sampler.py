"""Pure sampling functions: logits -> the distribution a request asks for, and sampling from it without host syncs.

Every row of a batch carries its own parameters. Greedy rows become one-hot distributions of the argmax, so the
rejection sampler needs no separate greedy path: with one-hot p it accepts exactly when the draft equals the argmax. (A
step whose rows are all greedy skips even that vocabulary-sized work: specserve.engine.sample.rejection.greedy_accept
gives the same result from the argmax ids.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.sampling_params import SamplingParams

_TINY = 1e-20


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters on the device, plus host-side flags that let us skip unused filters."""

    temperature: torch.Tensor  # [N]
    top_k: torch.Tensor  # [N] long, 0 = off
    top_p: torch.Tensor  # [N]
    min_p: torch.Tensor  # [N]
    greedy: torch.Tensor  # [N] bool
    presence_penalty: torch.Tensor  # [N]
    frequency_penalty: torch.Tensor  # [N]
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    any_penalty: bool

    @staticmethod
    def from_params(rows: list[SamplingParams], device: torch.device, penalties: bool = True) -> "SamplingTensors":
        def t(values, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype, device=device)

        use_pen = penalties and any(p.has_penalties for p in rows)
        return SamplingTensors(
            temperature=t([p.temperature for p in rows]),
            top_k=t([min(p.top_k, 1 << 31) for p in rows], torch.long),  # any k >= vocab means "off" anyway
            top_p=t([p.top_p for p in rows]),
            min_p=t([p.min_p for p in rows]),
            greedy=t([p.greedy for p in rows], torch.bool),
            presence_penalty=t([p.presence_penalty if use_pen else 0.0 for p in rows]),
            frequency_penalty=t([p.frequency_penalty if use_pen else 0.0 for p in rows]),
            all_greedy=all(p.greedy for p in rows),
            any_top_k=any(p.top_k > 0 and not p.greedy for p in rows),
            any_top_p=any(p.top_p < 1.0 and not p.greedy for p in rows),
            any_min_p=any(p.min_p > 0.0 and not p.greedy for p in rows),
            any_penalty=use_pen,
        )


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """OpenAI presence/frequency penalties: logit -= frequency * count + presence * (count > 0).

    logits [N, V]; counts [N, V] = occurrences of each token among the generated tokens before that row's position.
    """
    return logits - st.frequency_penalty[:, None] * counts - st.presence_penalty[:, None] * (counts > 0).to(logits.dtype)


def processed_probs(logits: torch.Tensor, st: SamplingTensors, counts: torch.Tensor | None = None) -> torch.Tensor:
    """The distribution each row samples from: penalties, temperature, top-k, top-p, min-p; greedy rows one-hot.

    logits [N, V] (any float dtype) -> probs [N, V] float32 summing to 1.
    """
    logits = logits.float()
    if counts is not None and st.any_penalty:
        logits = apply_penalties(logits, counts, st)
    vocab = logits.shape[-1]
    greedy_onehot = torch.nn.functional.one_hot(argmax_rows(logits), vocab).float()  # [N, V]
    if st.all_greedy:
        return greedy_onehot
    temp = torch.where(st.greedy, torch.ones_like(st.temperature), st.temperature)
    x = logits / temp[:, None]
    if st.any_top_k:
        k = torch.where(st.top_k > 0, st.top_k, torch.full_like(st.top_k, vocab)).clamp(max=vocab)
        kth = x.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])  # [N, 1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if st.any_top_p:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p
        drop_sorted = mass_before >= st.top_p[:, None]
        drop_sorted[:, 0] = False  # the most likely token is always kept (a top_p that rounds to 0 in fp32 too)
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if st.any_min_p:
        floor = st.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    probs = probs / probs.sum(-1, keepdim=True)
    return torch.where(st.greedy[:, None], greedy_onehot, probs)


ARGMAX_BLOCK = 256


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1), exactly (the first maximum; the first NaN where there is one), in two cheap passes: the maximum
    of each block of ARGMAX_BLOCK entries, then the argmax of the first block holding the row's maximum. torch's
    argmax over a vocabulary row is slow on CPU (0.24 ms for 4 x 49152 on 2 cores against 0.05 ms this way)."""
    vocab = x.shape[-1]
    if vocab % ARGMAX_BLOCK or vocab < 2 * ARGMAX_BLOCK:
        return x.argmax(-1)
    lead = x.shape[:-1]
    blocks = x.reshape(-1, vocab // ARGMAX_BLOCK, ARGMAX_BLOCK)  # [R, nb, block]
    best = blocks.amax(-1).argmax(-1)  # [R] the first block holding the maximum (or the first NaN)
    within = blocks[torch.arange(blocks.shape[0], device=x.device), best].argmax(-1)  # [R]
    return (best * ARGMAX_BLOCK + within).reshape(lead)


def sample(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Exponential race: argmax(p / E) with E ~ Exp(1) is an exact draw from p, with no host sync.

    probs [N, V] (need not be normalised), noise [N, V] -> token ids [N].
    """
    return argmax_rows(probs / noise.clamp_min(_TINY))


def exponential_noise(generators: list[torch.Generator | None], vocab: int, default: torch.Generator,
                      device: torch.device) -> torch.Tensor:
    """Exp(1) noise [N, V]: seeded rows from their own generator (so the batch does not change their draws),
    the rest in one draw from the engine's generator."""
    out = torch.empty(len(generators), vocab, device=device)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        out[unseeded] = torch.empty(len(unseeded), vocab, device=device).exponential_(generator=default)
    for i, gen in enumerate(generators):
        if gen is not None:
            out[i].exponential_(generator=gen)
    return out


def depth_noise(generators: list[torch.Generator | None], widths: list[int], width: int, vocab: int,
                default: torch.Generator, device: torch.device) -> torch.Tensor:
    """Exp(1) noise [N, width, V] for the tree rule (one draw per depth); a seeded row draws exactly widths[i] rows
    of it, so its stream depends only on its own proposal, never on the batch's widest."""
    out = torch.empty(len(generators), width, vocab, device=device)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        out[unseeded] = torch.empty(len(unseeded), width, vocab, device=device).exponential_(generator=default)
    for i, gen in enumerate(generators):
        if gen is not None:
            out[i, : widths[i]].exponential_(generator=gen)
            out[i, widths[i]:] = 1.0  # depths this row cannot reach
    return out


def uniform_noise(generators: list[torch.Generator | None], counts: list[int], width: int,
                  default: torch.Generator, device: torch.device) -> torch.Tensor:
    """U[0, 1) noise [N, width]; a seeded row draws exactly counts[i] values so its stream depends only on its k."""
    out = torch.rand(len(generators), width, device=device, generator=default) if width else \
        torch.empty(len(generators), 0, device=device)
    for i, gen in enumerate(generators):
        if gen is not None and counts[i]:
            out[i, : counts[i]] = torch.rand(counts[i], device=device, generator=gen)
    return out
