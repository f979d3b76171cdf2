"""A draft's sub-vocabulary (EAGLE-3's draft-to-target id map, FR-Spec's frequent-token head): draft id i stands for
target id d2t[i]; a target token outside it enters the draft as the draft's last id (unknown), and the draft's
distribution over the target vocabulary is exactly zero outside d2t — so q stays the distribution it samples from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FILE_NAME = "vocab_map.safetensors"  # in the draft's directory: one int64 tensor "d2t" [V_draft - 1]


@dataclass(frozen=True)
class VocabMap:
    d2t: torch.Tensor  # [Vd] long: target id of each draft output id
    t2d: torch.Tensor  # [V] long: draft input id of each target id (Vd = unknown)

    @staticmethod
    def from_d2t(d2t: torch.Tensor, target_vocab: int, device: torch.device | str = "cpu") -> "VocabMap":
        d2t = d2t.long()
        if d2t.ndim != 1 or d2t.numel() == 0 or int(d2t.min()) < 0 or int(d2t.max()) >= target_vocab:
            raise ValueError(f"d2t: must be a non-empty 1-D list of target ids in [0, {target_vocab})")
        if torch.unique(d2t).numel() != d2t.numel():
            raise ValueError("d2t: target ids must be distinct")
        t2d = torch.full((target_vocab,), d2t.numel(), dtype=torch.long)
        t2d[d2t] = torch.arange(d2t.numel())
        return VocabMap(d2t.to(device), t2d.to(device))

    @property
    def draft_vocab(self) -> int:
        """Rows of the draft's embedding: the mapped ids plus one unknown id."""
        return self.d2t.numel() + 1

    def to_draft_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        return self.t2d[target_ids]

    def to_target_logits(self, logits: torch.Tensor, target_vocab: int) -> torch.Tensor:
        """[N, Vd + 1] draft logits -> [N, V] target logits, -inf outside the map (the unknown id is never drafted)."""
        out = torch.full((logits.shape[0], target_vocab), float("-inf"), dtype=logits.dtype, device=logits.device)
        out[:, self.d2t] = logits[:, : self.d2t.numel()]
        return out


def save_vocab_map(directory: str | Path, d2t: torch.Tensor) -> None:
    save_file({"d2t": d2t.long().contiguous()}, str(Path(directory) / FILE_NAME))


def load_vocab_map(directory: str | Path, target_vocab: int, device: torch.device) -> VocabMap | None:
    path = Path(directory) / FILE_NAME
    if not path.is_file():
        return None
    return VocabMap.from_d2t(load_file(str(path))["d2t"], target_vocab, device)
