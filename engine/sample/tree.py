"""Token trees of one-hot candidates: structure (ancestors, depths) and the lossless tree acceptance rule.

A row's proposal is K nodes; node 0 is the root (the request's last emitted token, already in its output) and node
j >= 1 is proposed token j - 1, whose parent is `parents[j - 1]` (0 = the root; always < j, so nodes are in
topological order). A chain is the tree with parents [0, 1, 2, ...]. Siblings carry distinct tokens.
"""

from __future__ import annotations

import math

import torch

from specserve.engine.sample.sampler import sample


def chain_parents(batch: int, width: int, device: torch.device | None = None) -> torch.Tensor:
    """[B, K] parents of chains: node j's parent is node j - 1."""
    return torch.arange(width, device=device).expand(batch, width).clone()


def ancestor_matrix(parents: torch.Tensor) -> torch.Tensor:
    """parents [B, K] (entries beyond a row's node count may be anything in [0, K]) -> [B, K+1, K+1] bool,
    anc[b, i, a] = node a is node i or one of its ancestors. Pointer doubling: ceil(log2(K + 1)) tiny products."""
    batch, width = parents.shape
    size = width + 1
    par = torch.cat([parents.new_zeros(batch, 1), parents.clamp(0, width)], dim=1)  # the root is its own parent
    reach = torch.nn.functional.one_hot(par, size).float()  # [B, K+1, K+1] i -> parent(i)
    reach = torch.maximum(reach, torch.eye(size, device=parents.device).expand(batch, size, size))
    for _ in range(max(1, math.ceil(math.log2(size)))):
        reach = (torch.bmm(reach, reach) > 0).float()  # paths of up to 2^s hops
    return reach > 0


def depths(ancestors: torch.Tensor) -> torch.Tensor:
    """[B, K+1] depth of each node (root 0) from its ancestor matrix."""
    return ancestors.sum(-1) - 1


def check_tree(parents: list[int], tokens: list[int]) -> int:
    """Raise ValueError unless `parents` (node j's parent at index j - 1) is topological and siblings differ;
    -> the tree's depth (its deepest node's, the root at 0)."""
    seen: set[tuple[int, int]] = set()
    depth = [0]
    for j, (parent, token) in enumerate(zip(parents, tokens), start=1):
        if not 0 <= parent < j:
            raise ValueError(f"tree node {j}: parent {parent} must be in [0, {j})")
        if (parent, token) in seen:
            raise ValueError(f"tree node {j}: a sibling already proposes token {token}")
        seen.add((parent, token))
        depth.append(depth[parent] + 1)
    return max(depth)


def typical_accept(target_probs: torch.Tensor, node_tokens: torch.Tensor, parents: torch.Tensor,
                   threshold: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Medusa's typical acceptance (LOSSY: the output no longer follows p): node j is acceptable when its token's
    probability under its parent's p exceeds min(threshold, alpha * exp(-entropy(p))). target_probs [B, K+1, V],
    node_tokens / parents [B, K], threshold / alpha [B] -> [B, K] bool."""
    width = node_tokens.shape[1]
    entropy = -(target_probs * torch.log(target_probs.clamp_min(1e-30))).sum(-1)  # [B, K+1]
    par = parents.clamp(0, width)
    prob = target_probs.gather(1, par[..., None].expand(-1, -1, target_probs.shape[-1])) \
        .gather(-1, node_tokens.clamp_min(0)[..., None]).squeeze(-1)  # [B, K] p_parent(token)
    bound = torch.minimum(threshold[:, None], alpha[:, None] * torch.exp(-entropy.gather(1, par)))
    return prob > bound


def tree_sample(
    target_probs: torch.Tensor,  # [B, K+1, V] p at every node (the target's distribution after the node's path)
    node_tokens: torch.Tensor,  # [B, K] long, token of node j at index j - 1
    parents: torch.Tensor,  # [B, K] long, parent node of node j at index j - 1 (0 = root)
    ancestors: torch.Tensor,  # [B, K+1, K+1] bool from ancestor_matrix(parents)
    num_nodes: torch.Tensor,  # [B] long, proposed nodes per row (0..K)
    noise: torch.Tensor,  # [B, K+1, V] Exp(1), one draw per depth
    relaxed: torch.Tensor | None = None,  # [B, K] bool: nodes accepted whatever the draw (typical acceptance)
    relaxed_rows: torch.Tensor | None = None,  # [B] bool: rows that use `relaxed` instead of the draw
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tree rule for one-hot candidates: at a node draw y from p; if a child carries y, keep it and descend,
    else emit y and stop. -> (tokens [B, K+1] padded with -1, num_accepted [B], path [B, K+1] node of each emitted
    token's row: path[:, 0] = 0 and path[:, d] the accepted node at depth d, repeating the deepest after it).

    Why it is exact: the node reached at depth d is decided by the draws at depths < d only, and its own draw uses
    the depth-d noise, fresh along any path; so every emitted token is an exact draw from p given the tokens before
    it, whatever the tree holds — the tree decides only how many tokens one step emits. (A chain of one-hot drafts
    is the same rule as rejection sampling with q one-hot.) Greedy rows (one-hot p) follow the argmax."""
    batch, size, vocab = target_probs.shape
    width = size - 1
    device = target_probs.device
    depth = depths(ancestors)  # [B, K+1]
    node_noise = noise.gather(1, depth[..., None].expand(batch, size, vocab))  # the depth-d draw at depth-d nodes
    y = sample(target_probs.reshape(-1, vocab), node_noise.reshape(-1, vocab)).view(batch, size)  # [B, K+1]
    valid = torch.arange(width, device=device)[None, :] < num_nodes[:, None]  # [B, K]
    match = node_tokens == y.gather(1, parents.clamp(0, width))  # node j's token is its parent's draw
    if relaxed is not None:
        match = torch.where(relaxed_rows[:, None], relaxed, match)
    match = valid & match
    ok = torch.cat([torch.ones(batch, 1, dtype=torch.bool, device=device), match], dim=1)  # [B, K+1]
    accepted = ~(ancestors & ~ok[:, None, :]).any(-1)  # every node on the way from the root matched
    deepest = torch.where(accepted, depth, torch.full_like(depth, -1)).argmax(-1)  # [B]
    rows = torch.arange(batch, device=device)
    num_accepted = depth[rows, deepest]  # [B]
    on_path = ancestors[rows, deepest]  # [B, K+1]
    path = deepest[:, None].repeat(1, size + 1)  # one spare column takes the nodes off the path
    path.scatter_(1, torch.where(on_path, depth, torch.full_like(depth, size)), torch.arange(size, device=device)
                  .expand(batch, size))
    path = path[:, :size]
    d = torch.arange(size, device=device)[None, :]
    path = torch.where(d <= num_accepted[:, None], path, deepest[:, None])
    all_tokens = torch.cat([y.new_full((batch, 1), -1), node_tokens], dim=1)  # [B, K+1] token of each node
    tokens = torch.where(d < num_accepted[:, None], all_tokens.gather(1, path.roll(-1, dims=1)),
                         torch.full_like(path, -1))
    tokens[rows, num_accepted] = y[rows, deepest]  # the draw at the deepest accepted node
    return tokens, num_accepted, path
