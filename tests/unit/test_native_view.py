"""native_forward.causal_groups builds the one-call decoder's attention view straight from a forward's chunks: it
must give exactly the arrays build_metadata's query groups and their causal key views give."""

import random
from types import SimpleNamespace

import pytest
import torch

from specserve.engine.model.attention import SHORT_QUERY, SeqChunk, build_metadata
from specserve.engine.model.native_forward import causal_groups


def random_chunks(rng: random.Random, block_size: int, null_block: int) -> list[SeqChunk]:
    chunks, free = [], list(range(null_block))
    rng.shuffle(free)  # blocks out of order, as a pool hands them out
    for _ in range(rng.randint(1, 6)):
        start = rng.choice([0, rng.randint(0, 60)])
        num_new = rng.choice([1, rng.randint(1, SHORT_QUERY), rng.randint(SHORT_QUERY + 1, 3 * SHORT_QUERY)])
        need = -(-(start + num_new) // block_size) + rng.randint(0, 2)  # some tables hold spare blocks
        table, free = free[:need], free[need:]
        chunks.append(SeqChunk(table, start, num_new))
    return chunks


@pytest.mark.parametrize("seed", range(40))
def test_causal_groups_are_build_metadatas_query_groups(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 4, 16])
    kv = SimpleNamespace(block_size=block_size, null_block=400)
    chunks = random_chunks(rng, block_size, kv.null_block)
    groups, write_slots, positions = causal_groups(kv, chunks)
    md, expected_positions = build_metadata(kv, chunks, torch.device("cpu"))
    assert torch.equal(positions, expected_positions) and torch.equal(write_slots, md.write_slots)
    assert len(groups) == len(md.groups)
    for (slots, mask, token_index, output_index), group in zip(groups, md.groups):
        view = group.key_view(None)
        assert torch.equal(slots, view.slots) and torch.equal(mask, view.mask[:, 0])
        assert torch.equal(token_index, group.token_index) and torch.equal(output_index, group.output_index)


def test_a_table_too_short_for_its_tokens_is_refused():
    kv = SimpleNamespace(block_size=4, null_block=9)
    with pytest.raises(RuntimeError, match="sequence 1: 1 blocks cannot hold 6 tokens"):
        causal_groups(kv, [SeqChunk([0], 0, 3), SeqChunk([1], 2, 4)])
