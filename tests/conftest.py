"""Shared fixtures: tiny models written once per test session."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import build_tokenizer, save_gpt2, save_llama

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """Paths of tiny random models sharing one byte-level BPE tokenizer."""
    root = tmp_path_factory.mktemp("tiny")
    tok_dir = root / "tok"
    vocab = len(build_tokenizer(tok_dir))
    return {
        "vocab": vocab,
        "llama": save_llama(root / "llama", tok_dir, vocab, layers=2, seed=0),
        "llama_draft": save_llama(root / "llama_draft", tok_dir, vocab, layers=1, hidden=32, heads=2, kv_heads=1,
                                  seed=1),
        "gpt2": save_gpt2(root / "gpt2", tok_dir, vocab, layers=2, seed=2),
        "gpt2_draft": save_gpt2(root / "gpt2_draft", tok_dir, vocab, layers=1, hidden=32, heads=2, seed=3),
    }


@pytest.fixture(autouse=True, scope="session")
def _training_cache(tmp_path_factory):
    """Training's recomputable caches (checkpoints, teacher stores) go to a temporary directory, never ~/.cache."""
    patch = pytest.MonkeyPatch()
    patch.setenv("SPECSERVE_CACHE", str(tmp_path_factory.mktemp("specserve-cache")))
    yield
    patch.undo()
