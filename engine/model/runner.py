"""Runs one HF causal LM over a ragged batch on the engine's KV pool: one forward, no padding between sequences."""

from __future__ import annotations

import torch

from specserve.engine.model.attention import SeqChunk, build_metadata
from specserve.engine.model.cpu_kernels.build import for_device
from specserve.engine.model.hidden import LayerTaps
from specserve.engine.model.native_forward import NativeForward
from specserve.engine.model.vocab_map import VocabMap
from specserve.engine.sched.kv_cache import KVPool


class ModelRunner:
    def __init__(self, model, kv: KVPool, device: torch.device, vocab_size: int, vocab_map: VocabMap | None = None,
                 hidden_layers: tuple[int, ...] = ()):
        self.model = model
        self.kv = kv
        self.device = device
        self.vocab_size = vocab_size  # logits are cut or padded to this width (the target's vocabulary)
        self.vocab_map = vocab_map  # a draft over a sub-vocabulary: ids in, logits out go through it
        self.taps = LayerTaps(model, hidden_layers) if hidden_layers else None
        self.stable_shapes = False  # a compiled model: metadata padded so that Dynamo meets one shape class
        self.kernels = for_device(device)  # short-query attention on the CPU kernels (not under torch.compile)
        self.native = NativeForward.of(model)  # decode and verify forwards without transformers' model code

    def forward(self, input_ids: torch.Tensor, chunks: list[SeqChunk], logits_index: torch.Tensor) -> torch.Tensor:
        """input_ids [T] (chunks' tokens concatenated), logits_index [N] token rows wanted -> logits [N, V] fp32."""
        return self.run(input_ids, chunks, logits_index)[0]

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, chunks: list[SeqChunk], logits_index: torch.Tensor,
            hidden_rows: torch.Tensor | None = None, capture: bool = False
            ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """forward(), plus with `capture` the tapped layers' hidden states {layer: [R, H]} at token rows
        `hidden_rows` [R] (None: every token)."""
        input_ids = input_ids.to(self.device)
        if self.vocab_map is not None:
            input_ids = self.vocab_map.to_draft_ids(input_ids)
        capture = capture and self.taps is not None
        md, positions = build_metadata(self.kv, chunks, self.device, self.stable_shapes,
                                       kernels=None if self.stable_shapes else self.kernels)
        if self.native is not None and not capture and not self.stable_shapes:
            logits = self.native.forward(input_ids, positions, md, logits_index.to(self.device))
            if logits is not None:
                return self._logits(logits.float()), {}
        if capture:
            self.taps.begin(None if hidden_rows is None else hidden_rows.to(self.device))
        try:
            out = self.model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                             logits_to_keep=logits_index.to(self.device), specserve_metadata=md)
        except BaseException:
            if capture:
                self.taps.end(check=False)
            raise
        hidden = self.taps.end() if capture else {}
        return self._logits(out.logits[0].float()), hidden

    def _logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, V_model] -> [N, V] in the target's vocabulary."""
        if self.vocab_map is not None:
            return self.vocab_map.to_target_logits(logits, self.vocab_size)  # [N, V]
        width = logits.shape[-1]
        if width > self.vocab_size:
            logits = logits[:, : self.vocab_size]
        elif width < self.vocab_size:  # a draft with a smaller padded vocabulary never proposes the extra ids
            logits = torch.nn.functional.pad(logits, (0, self.vocab_size - width), value=float("-inf"))
        return logits
