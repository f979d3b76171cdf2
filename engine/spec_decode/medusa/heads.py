"""Medusa heads (Cai et al. 2024): K heads over the target's last hidden state (the final norm's output, what the LM
head reads); head k predicts the token k + 2 places after the state's position (the LM head itself predicts the
next one). Head k is `medusa_num_layers` ResBlocks `h + SiLU(W h + b)` (W zero-initialised, so an untrained head
starts as the LM head) followed by a vocabulary projection: its own `Linear(H, V)` in the public Medusa format, or
the target's frozen LM head shared by every head (ours: a 49k x 576 projection per head would be 57 MB in bf16).

On disk, a directory with `medusa_config.json` (`medusa_num_heads`, `medusa_num_layers`, optionally
`medusa_choices`, the tree the trainer picked; the public format's `config.json` is read too, so heads can sit inside
a target directory whose `config.json` is the model's) and `medusa_lm_head.safetensors` (or `.pt`) with the public
format's keys: `{k}.{j}.linear.weight|bias` for ResBlock j of head k and `{k}.{L}.weight` for its projection
(absent: shared).
Optionally `medusa_vocab.safetensors` ("ids" [Vc]): the target ids that shared heads may propose, so each head
projects onto Vc rows of the LM head instead of all of them (a 49k x 576 head costs ~6 ms a step on a 2-core CPU, an
8k one ~0.5 ms). Lossless: proposals are one-hot candidates, and the target verifies them whatever they are.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

WEIGHT_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
CONFIG_FILES = ("medusa_config.json", "config.json")  # ours (written), then the public format's
VOCAB_FILE = "medusa_vocab.safetensors"  # optional: the candidate ids of shared heads ("ids")


class ResBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)  # starts as the identity: head k = the LM head before training
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, num_heads: int, num_layers: int, hidden: int, vocab: int | None = None):
        """vocab: give each head its own projection to this many ids (the public format); None: the target's
        LM head is shared, passed to `logits()`."""
        super().__init__()
        if num_heads < 1 or num_layers < 1:
            raise ValueError(f"medusa heads: need medusa_num_heads >= 1 and medusa_num_layers >= 1, got "
                             f"{num_heads} and {num_layers}")
        self.num_heads, self.num_layers, self.hidden = num_heads, num_layers, hidden
        self.blocks = nn.ModuleList(nn.Sequential(*(ResBlock(hidden) for _ in range(num_layers)))
                                    for _ in range(num_heads))
        self.proj = None if vocab is None else nn.ModuleList(nn.Linear(hidden, vocab, bias=False)
                                                              for _ in range(num_heads))

    @property
    def shared_lm_head(self) -> bool:
        return self.proj is None

    def states(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """[N, H] last hidden states -> [K, N, H] each head's state before its projection (the first
        `num_heads` heads only, when given)."""
        return torch.stack([blocks(hidden) for blocks in self.blocks[:num_heads]])

    def logits(self, hidden: torch.Tensor, lm_head: torch.Tensor | None = None, num_heads: int | None = None
               ) -> torch.Tensor:
        """[N, H] -> [K, N, V]; `lm_head` [V, H] is the target's output embedding, or some rows of it (shared
        heads only). One matmul for all heads: the weight is read once whatever K is."""
        states = self.states(hidden, num_heads)
        if self.proj is not None:
            return torch.stack([p(s) for p, s in zip(self.proj, states)])
        if lm_head is None:
            raise ValueError("medusa heads: shared heads need the target's LM head")
        k, n, h = states.shape  # 2-D: a batched matmul measured 2x slower here (and ~60x on a strided view)
        return torch.nn.functional.linear(states.reshape(k * n, h), lm_head).view(k, n, -1)

    # -- the public format ------------------------------------------------------------------------------------
    def medusa_state_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        for k, blocks in enumerate(self.blocks):
            for j, block in enumerate(blocks):
                out[f"{k}.{j}.linear.weight"] = block.linear.weight.detach().contiguous()
                out[f"{k}.{j}.linear.bias"] = block.linear.bias.detach().contiguous()
            if self.proj is not None:
                out[f"{k}.{self.num_layers}.weight"] = self.proj[k].weight.detach().contiguous()
        return out

    def save(self, directory: str | Path, extra_config: dict | None = None, dtype: torch.dtype = torch.bfloat16
             ) -> Path:
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file({k: v.to(dtype) for k, v in self.medusa_state_dict().items()}, str(directory / WEIGHT_FILES[0]))
        config = {"medusa_num_heads": self.num_heads, "medusa_num_layers": self.num_layers,
                  "hidden_size": self.hidden, "shared_lm_head": self.shared_lm_head, **(extra_config or {})}
        (directory / CONFIG_FILES[0]).write_text(json.dumps(config, indent=1) + "\n")
        return directory


def find_heads(directory: str | Path) -> Path | None:
    """The heads' weight file inside a directory (a heads directory, or a target directory that carries them)."""
    directory = Path(directory).expanduser()
    if not directory.is_dir():
        return None
    return next((directory / f for f in WEIGHT_FILES if (directory / f).is_file()), None)


def read_config(directory: str | Path, field: str = "medusa_heads") -> dict:
    directory = Path(directory).expanduser()
    path = next((directory / f for f in CONFIG_FILES if (directory / f).is_file()), directory / CONFIG_FILES[0])
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{field}: cannot read {path}: {exc}") from None
    for key in ("medusa_num_heads", "medusa_num_layers"):
        if not isinstance(config.get(key), int) or config[key] < 1:
            raise ValueError(f"{field}: {path} needs an integer {key} >= 1")
    return config


def load_vocab(directory: str | Path, vocab: int, field: str = "medusa_heads") -> torch.Tensor | None:
    """The candidate ids of shared heads ([Vc] long, distinct, < vocab), or None when the directory has none."""
    path = Path(directory).expanduser() / VOCAB_FILE
    if not path.is_file():
        return None
    from safetensors.torch import load_file
    ids = load_file(str(path)).get("ids")
    if ids is None or ids.ndim != 1 or ids.numel() == 0 or ids.is_floating_point():
        raise ValueError(f"{field}: {path} needs a non-empty 1-D integer tensor 'ids'")
    ids = ids.long()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab or torch.unique(ids).numel() != ids.numel():
        raise ValueError(f"{field}: {path}: ids must be distinct target ids in [0, {vocab})")
    return ids


def save_vocab(directory: str | Path, ids: torch.Tensor) -> Path:
    from safetensors.torch import save_file
    path = Path(directory) / VOCAB_FILE
    save_file({"ids": ids.long().contiguous()}, str(path))
    return path


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file
        return load_file(str(path))
    state = torch.load(path, map_location="cpu", weights_only=True)
    return state.state_dict() if isinstance(state, nn.Module) else dict(state)


def load_heads(directory: str | Path, hidden: int, vocab: int, field: str = "medusa_heads"
               ) -> tuple[MedusaHeads, dict]:
    """Heads from a directory in the public Medusa format or ours -> (heads on the CPU in fp32, their config).
    ValueError naming `field` when the files do not fit the target (hidden size, vocabulary)."""
    weights_path = find_heads(directory)
    if weights_path is None:
        raise ValueError(f"{field}: no {' or '.join(WEIGHT_FILES)} in {directory}")
    config = read_config(directory, field)
    num_heads, num_layers = config["medusa_num_heads"], config["medusa_num_layers"]
    state = _read_weights(weights_path)
    own = [state.get(f"{k}.{num_layers}.weight") for k in range(num_heads)]
    if any(w is not None for w in own) and not all(w is not None for w in own):
        raise ValueError(f"{field}: {weights_path} has a projection for some heads only")
    heads = MedusaHeads(num_heads, num_layers, hidden, vocab if own[0] is not None else None)
    for k in range(num_heads):
        for j in range(num_layers):
            # the Medusa project builds a head as [ResBlock(H)] * L: one block repeated, so a file may hold j = 0 only
            jj = j if f"{k}.{j}.linear.weight" in state else 0
            w, b = state.get(f"{k}.{jj}.linear.weight"), state.get(f"{k}.{jj}.linear.bias")
            if w is None or b is None:
                raise ValueError(f"{field}: {weights_path} lacks {k}.{j}.linear.weight/bias "
                                 f"(medusa_num_heads={num_heads}, medusa_num_layers={num_layers})")
            if tuple(w.shape) != (hidden, hidden):
                raise ValueError(f"{field}: head {k} block {j} is {tuple(w.shape)}; the target's hidden size is "
                                 f"{hidden}")
            block = heads.blocks[k][j].linear
            block.weight.data.copy_(w.float())
            block.bias.data.copy_(b.float())
        if own[k] is not None:
            if tuple(own[k].shape) != (vocab, hidden):
                raise ValueError(f"{field}: head {k}'s projection is {tuple(own[k].shape)}; the target needs "
                                 f"({vocab}, {hidden})")
            heads.proj[k].weight.data.copy_(own[k].float())
    return heads, config
