"""What a verified step hands back: the speculation counts, the K/V moves of accepted tree paths, the target
hidden states each reader gets, and what each proposer is told. Pure over the step's host-side results."""

from __future__ import annotations

import torch

from specserve.engine.request import Request
from specserve.engine.spec_decode.base import HiddenChunk, VerifiedRow
from specserve.engine.stats import StepStats


def count_speculation(req: Request, k: int, m: int, stats: StepStats, depth: int) -> None:
    """A row proposed k tokens (nodes) reaching `depth` positions, and m were accepted."""
    req.speculation.num_steps += 1
    req.speculation.num_draft_tokens += k
    req.speculation.num_accepted_tokens += m
    stats.num_drafts += 1
    stats.num_draft_tokens += k
    stats.num_accepted_tokens += m
    stats.speculative_tokens_chosen.append(k)
    stats.accepted_lengths.append(m + 1)
    stats.draft_methods.append(req.speculation.method)
    stats.draft_depths.append(depth)
    for j in range(m):
        stats.num_accepted_tokens_per_pos[j] += 1


def path_moves(block_ids: list[int], block_size: int, root: int, path: list[int]) -> tuple[list[int], list[int]]:
    """A tree's accepted node at depth d sits in slot root + node; the sequence needs it at root + d. -> flat
    (source, destination) slots: at most depth moves (per layer of the pool)."""
    src, dst = [], []
    for d, node in enumerate(path[1:], start=1):
        if node != d:
            a, b = root + node, root + d
            src.append(block_ids[a // block_size] * block_size + a % block_size)
            dst.append(block_ids[b // block_size] * block_size + b % block_size)
    return src, dst


def hidden_chunks(seqs, layout, paths: dict[int, list[int]], hidden: dict[int, torch.Tensor], hidden_rows,
                  reader_of) -> dict[str, tuple[list, list]]:
    """Each hidden-state reader's rows of the tokens whose K/V were kept, in position order: a verify row's
    emitted path, a prefill chunk's tokens (when every row was captured: hidden_rows None) or its sampled row.
    -> proposer name -> (requests, HiddenChunks)."""
    out: dict[str, tuple[list, list]] = {}
    emitting = {i: b for b, i in enumerate(layout.emitting)}
    token_offsets, logit_offsets = layout.token_offsets, layout.logit_offsets
    for i, s in enumerate(seqs):
        n, k, req = s.num_new_tokens, s.num_draft_tokens, s.request
        reader = reader_of(req)
        first, kept, start = 0, [], layout.roots[i]
        if hidden_rows is None:  # every token row was captured
            first, kept = token_offsets[i], paths[i] if k else list(range(n))
        elif i in emitting:  # only the logit rows were captured
            first, kept = logit_offsets[emitting[i]], paths[i] if k else [0]
            start = layout.roots[i] if k else layout.roots[i] + n - 1
        if reader is not None and kept and not req.finished:
            some = next(iter(hidden.values()))
            idx = torch.tensor([first + j for j in kept], device=some.device)
            states = {layer: h.index_select(0, idx) for layer, h in hidden.items()
                      if layer in reader.needs.hidden_layers}
            reqs, chunks = out.setdefault(reader.name, ([], []))
            reqs.append(req)
            chunks.append(HiddenChunk(start, states))
    return out


def verified_rows(seqs, proposals, paths: dict[int, list[int]]) -> dict[str, tuple[list[Request], list]]:
    """proposer name -> (requests, VerifiedRows) of the rows it proposed for."""
    out: dict[str, tuple[list, list]] = {}
    for i, (s, prop) in enumerate(zip(seqs, proposals)):
        if prop is None:
            continue
        m = len(paths[i]) - 1
        emitted = s.request.token_ids[-(m + 1):] if not s.request.finished else []  # the m + 1 just appended
        reqs, rows = out.setdefault(prop.owner, ([], []))
        reqs.append(s.request)
        rows.append(VerifiedRow(len(prop.tokens), m, emitted))
    return out
