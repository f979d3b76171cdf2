"""Runs one HF causal LM over a ragged batch on the engine's KV pool: one forward, no padding between sequences."""

from __future__ import annotations

import torch

from engine.attention import SeqChunk, build_metadata
from engine.kv_cache import KVPool
from engine.vocab_map import VocabMap


class ModelRunner:
    def __init__(self, model, kv: KVPool, device: torch.device, vocab_size: int, vocab_map: VocabMap | None = None):
        self.model = model
        self.kv = kv
        self.device = device
        self.vocab_size = vocab_size  # logits are cut or padded to this width (the target's vocabulary)
        self.vocab_map = vocab_map  # a draft over a sub-vocabulary: ids in, logits out go through it

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, chunks: list[SeqChunk], logits_index: torch.Tensor) -> torch.Tensor:
        """input_ids [T] (chunks' tokens concatenated), logits_index [N] token rows wanted -> logits [N, V] fp32."""
        md, positions = build_metadata(self.kv, chunks, self.device)
        input_ids = input_ids.to(self.device)
        if self.vocab_map is not None:
            input_ids = self.vocab_map.to_draft_ids(input_ids)
        out = self.model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                         logits_to_keep=logits_index.to(self.device), specserve_metadata=md)
        logits = out.logits[0].float()  # [N, V_model]
        if self.vocab_map is not None:
            return self.vocab_map.to_target_logits(logits, self.vocab_size)  # [N, V]
        width = logits.shape[-1]
        if width > self.vocab_size:
            logits = logits[:, : self.vocab_size]
        elif width < self.vocab_size:  # a draft with a smaller padded vocabulary never proposes the extra ids
            logits = torch.nn.functional.pad(logits, (0, self.vocab_size - width), value=float("-inf"))
        return logits
