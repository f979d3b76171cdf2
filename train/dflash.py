"""`specserve train dflash`: the DFlash block-diffusion drafter (engine/spec_decode/dflash/model.py, arXiv 2602.06036)
on the target's own answers (the `selfgen` set).

The target is frozen, so its features (decoder-layer outputs at `target_layer_ids`, concatenated) are computed once
per sequence, teacher-forced over prompt + answer, and cached next to the checkpoints. A training step takes a few
sequences and, in each, up to `num_anchors` anchors a among the positions whose next token is an answer token. The
block of an anchor is [seq[a], MASK x (B - 1)] at positions a .. a + B - 1; it sees the context (the projected
features) strictly before a and itself (bidirectionally), never another block — exactly what the server gives it at
the last emitted token (engine/spec_decode/dflash/). Block position k (1 .. B - 1) is trained on the target's argmax
at a + k (what greedy verification compares against), weighted exp(-(k - 1) / gamma): early positions matter most,
since a miss there ends the accepted run.

Embedding and LM head are the target's, frozen; the head is optionally restricted to a candidate vocabulary (a
`vocab_map.safetensors` d2t: logits only over those rows — on a CPU the full-vocabulary head is most of the cost),
which the export carries so the server maps draft ids back.

The mask token (`--mask-token-id`, else chosen here) is any id the data never uses: its embedding is the target's
frozen row, so it only has to be constant and distinct from real tokens. The choice: the highest-id special token of
the tokenizer that occurs nowhere in the set (prompts, answers, the target's top-k), else the highest such id of the
vocabulary (on padded vocabularies, an unused row).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from specserve.engine.model.hidden import FINAL, decoder_layers, final_norm
from specserve.engine.model.loader import load_tokenizer
from specserve.engine.model.vocab_map import FILE_NAME as VOCAB_MAP_FILE
from specserve.engine.model.vocab_map import VocabMap
from specserve.engine.spec_decode.dflash.model import (
    DFlashDrafter,
    block_masks,
    check_against_target,
    default_target_layer_ids,
    load_drafter,
    new_config,
    save_drafter,
)

from .loop import TrainConfig, compute_autocast, default_ckpt_dir, run_loop, setup_runtime, train_dtype
from .medusa import lm_head_weight, load_target
from .selfdistill import load_set, split_by_prompt
from .teacher import teacher_signals

IGNORE = -100
EVAL_SEED = 1234  # held-out anchors: the same before and after training, and across runs


def default_gamma(block_size: int) -> float:
    """DFlash's loss decay: 4 for blocks up to 8, 7 for 16 (longer blocks keep more weight on late positions)."""
    return 4.0 if block_size <= 8 else 7.0


def context_layer_ids(num_target_layers: int, num_layers: int, layer_ids: list[int] | None = None,
                      num_context_layers: int | None = None) -> list[int]:
    """The target layers the drafter reads: `layer_ids` if given, else z-lab's spacing for `num_context_layers`
    (default: one per drafter layer)."""
    ids = list(layer_ids or default_target_layer_ids(num_target_layers, num_context_layers or num_layers))
    bad = [i for i in ids if not 0 <= i < num_target_layers]
    if bad:
        raise ValueError(f"target_layer_ids: {bad} are outside the target's {num_target_layers} layers")
    return ids


def special_token_ids(tokenizer) -> list[int]:
    """Ids of the tokenizer's special tokens (the named ones and every added token marked special)."""
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items() if tok.special)
    return sorted(ids)


def used_token_ids(records: list[dict]) -> set[int]:
    """Every id that occurs in the set: prompts, answers and the target's top-k candidates."""
    used: set[int] = set()
    for r in records:
        for key in ("prompt_ids", "output_ids", "top_ids"):
            if key in r:
                used.update(torch.unique(r[key]).tolist())
    return used


def choose_mask_token(special_ids: list[int], used: set[int], vocab_size: int) -> int:
    """The highest special id the data never uses, else the highest unused id of the vocabulary. Pure."""
    for candidates in (sorted(special_ids, reverse=True), range(vocab_size - 1, -1, -1)):
        for i in candidates:
            if 0 <= i < vocab_size and i not in used:
                return int(i)
    raise ValueError("mask_token_id: every id of the vocabulary occurs in the data; pass --mask-token-id")


# -- blocks, labels and masks (pure) ----------------------------------------------------------------------------------

def training_mask(anchors: list[int], block_size: int, ctx_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the blocks of `anchors` (block i = query rows i*B .. i*B + B - 1):
    ctx_visible [Q, T]: query row of anchor a sees context key p iff p < a (strictly before its anchor);
    same_block [Q, Q]: it sees every row of its own block (bidirectional) and no other block's. Pure."""
    a = torch.tensor(anchors, dtype=torch.long).repeat_interleave(block_size)  # [Q] anchor of each query row
    block = torch.arange(len(anchors)).repeat_interleave(block_size)  # [Q]
    ctx_visible = torch.arange(ctx_len)[None, :] < a[:, None]  # [Q, T]
    same_block = block[:, None] == block[None, :]  # [Q, Q]
    return ctx_visible, same_block


def block_targets(anchors: list[int], block_size: int, labels: torch.Tensor, gamma: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """labels [n] (target ids, IGNORE where no loss) -> per query row (label [Q], weight [Q]): block position k >= 1
    of anchor a is labelled labels[a + k] (IGNORE past the end), weight exp(-(k - 1) / gamma); position 0 has none.
    Pure."""
    n = len(labels)
    k = torch.arange(block_size)
    pos = torch.tensor(anchors, dtype=torch.long)[:, None] + k[None, :]  # [A, B]
    lab = torch.where(pos < n, labels[pos.clamp(max=n - 1)], IGNORE)
    lab[:, 0] = IGNORE
    weight = torch.exp(-(k - 1).clamp_min(0).float() / gamma).expand_as(lab)
    weight = torch.where(lab != IGNORE, weight, 0.0)
    return lab.reshape(-1), weight.reshape(-1)


def draw_anchors(n_prompt: int, n: int, count: int, generator: torch.Generator) -> list[int]:
    """Up to `count` anchors uniformly without replacement among a in [n_prompt - 1, n - 2] (the positions whose
    next token is an answer token), sorted."""
    span = n - n_prompt  # number of candidate anchors
    picks = torch.randperm(span, generator=generator)[: min(count, span)] + n_prompt - 1
    return sorted(picks.tolist())


# -- sequences and batches --------------------------------------------------------------------------------------------

@dataclass
class Sequence:
    ids: torch.Tensor  # [n] prompt + answer
    n_prompt: int
    labels: torch.Tensor  # [n] target argmax at answer positions, IGNORE at prompt positions
    features: torch.Tensor  # [n, nH] bf16 target features


def answer_labels(record: dict) -> torch.Tensor:
    """[n]: the target's argmax (top_ids[:, 0]) at every answer position, IGNORE over the prompt."""
    n_prompt, n_out = len(record["prompt_ids"]), len(record["output_ids"])
    labels = torch.full((n_prompt + n_out,), IGNORE, dtype=torch.long)
    labels[n_prompt:] = record["top_ids"][:, 0].long()
    return labels


def record_ids(record: dict) -> torch.Tensor:
    return torch.cat([record["prompt_ids"], record["output_ids"]]).long()


@dataclass
class BlockBatch:
    features: torch.Tensor  # [S, T, nH] context features (zeros past a sequence's last visible position)
    ctx_pos: torch.Tensor  # [S, T]
    tokens: torch.Tensor  # [S, Q] block tokens (Q = A * B; padding blocks are all MASK)
    q_pos: torch.Tensor  # [S, Q]
    ctx_visible: torch.Tensor  # [S, Q, T] bool
    same_block: torch.Tensor  # [S, Q, Q] bool
    labels: torch.Tensor  # [S, Q] target ids, IGNORE where no loss
    weights: torch.Tensor  # [S, Q]
    real: torch.Tensor  # [S, A] bool: a real block (not padding)
    num_tokens: int  # labelled query rows


def make_batch(seqs: list[Sequence], anchors: list[list[int]], block_size: int, mask_token_id: int,
               gamma: float) -> BlockBatch:
    """The blocks of `anchors[s]` in sequence s, padded to the most anchors per sequence. Padding blocks sit at
    anchor 0: they see no context and only themselves (so SDPA never gets an all-masked row) and carry no label.
    Context keys past a sequence's own end are zeros no query sees (a query sees p < a <= n - 2)."""
    b = block_size
    s_count, a_count = len(seqs), max(len(a) for a in anchors)
    q = a_count * b
    t = max(1, max(max(a, default=0) for a in anchors))  # keys past the last anchor are never visible
    feats = torch.zeros(s_count, t, seqs[0].features.shape[1], dtype=seqs[0].features.dtype)
    tokens = torch.full((s_count, q), mask_token_id, dtype=torch.long)
    q_pos = torch.zeros(s_count, q, dtype=torch.long)
    ctx_visible = torch.zeros(s_count, q, t, dtype=torch.bool)
    same_block = torch.zeros(s_count, q, q, dtype=torch.bool)
    labels = torch.full((s_count, q), IGNORE, dtype=torch.long)
    weights = torch.zeros(s_count, q)
    real = torch.zeros(s_count, a_count, dtype=torch.bool)
    for i, (seq, anc) in enumerate(zip(seqs, anchors)):
        padded = anc + [0] * (a_count - len(anc))
        width = min(t, len(seq.ids))
        feats[i, :width] = seq.features[:width]
        ctx_visible[i], same_block[i] = training_mask(padded, b, t)
        q_pos[i] = (torch.tensor(padded)[:, None] + torch.arange(b)[None, :]).reshape(-1)
        tokens[i, torch.arange(len(anc)) * b] = seq.ids[anc]
        labels[i, : len(anc) * b], weights[i, : len(anc) * b] = block_targets(anc, b, seq.labels, gamma)
        real[i, : len(anc)] = True
    ctx_pos = torch.arange(t)[None, :].expand(s_count, t)
    return BlockBatch(feats, ctx_pos, tokens, q_pos, ctx_visible, same_block, labels, weights, real,
                      int((labels != IGNORE).sum()))


# -- target features --------------------------------------------------------------------------------------------------

def cached_features(target, target_path: str, records: list[dict], layer_ids: list[int], ckpt_dir: Path
                    ) -> list[torch.Tensor]:
    """Per record, the teacher-forced features [n, len(layer_ids) * H] bf16: HF's hidden_states[i + 1] (z-lab's
    definition: decoder-layer outputs, except that layer L - 1's is the final norm's output — what the server's
    DFlash proposer taps too), concatenated in `layer_ids` order, from the one teacher path (train/teacher.py)."""
    last = len(decoder_layers(target)) - 1
    taps = [FINAL if i == last else i for i in layer_ids]
    return [r["hidden"] for r in teacher_signals(target, target_path, records, taps, 0, ckpt_dir, compute_autocast(),
                                                 "dflash")]


# -- the drafter ------------------------------------------------------------------------------------------------------

def load_vocab_ids(path: str | Path, vocab_size: int) -> VocabMap:
    """--vocab-map: a vocab_map.safetensors file (int64 "d2t"), or a directory holding one."""
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / VOCAB_MAP_FILE
    if not path.is_file():
        raise FileNotFoundError(f"vocab_map: no {VOCAB_MAP_FILE} at {path}")
    return VocabMap.from_d2t(load_file(str(path))["d2t"], vocab_size)


def init_from_target(drafter: DFlashDrafter, target, layers: list[int]) -> None:
    """Drafter layer i takes target layer layers[i]'s attention projections, MLP and both norms (q_norm / k_norm,
    which the target lacks, stay 1); the final norm is the target's (it feeds the same LM head)."""
    if len(layers) != len(drafter.layers):
        raise ValueError(f"init_layers: {len(layers)} target layers for a {len(drafter.layers)}-layer drafter")
    stack = decoder_layers(target)
    for dst, src in zip(drafter.layers, layers):
        if not 0 <= src < len(stack):
            raise ValueError(f"init_layers: layer {src} is outside the target's {len(stack)} layers")
        state = stack[src].state_dict()
        own = dst.state_dict()
        wrong = [k for k, v in state.items() if k in own and own[k].shape != v.shape]
        if wrong:
            raise ValueError(f"init_layers: target layer {src} does not fit the drafter ({wrong[:3]} differ in "
                             "shape; leave --intermediate-size at the target's)")
        result = dst.load_state_dict(state, strict=False)
        missing = [k for k in result.missing_keys if not k.endswith(("q_norm.weight", "k_norm.weight"))]
        if missing or result.unexpected_keys:
            raise ValueError(f"init_layers: target layer {src} does not match a drafter layer (missing "
                             f"{missing[:3]}, unexpected {result.unexpected_keys[:3]})")
    drafter.norm.load_state_dict(final_norm(target).state_dict())


@dataclass
class Frozen:
    """The target's pieces the drafter borrows: its input embedding module (called, as the server does, so a
    target that scales its embeddings is matched), LM head rows [Vc, H] in the compute dtype, and the candidate map
    (None: the full vocabulary)."""
    embed: torch.nn.Module
    head: torch.Tensor
    vmap: VocabMap | None

    def head_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """Target ids -> LM head rows; IGNORE where there is no label or it is outside the candidates."""
        if self.vmap is None:
            return labels
        rows = self.vmap.t2d[labels.clamp_min(0)]
        return torch.where((labels != IGNORE) & (rows < self.vmap.d2t.numel()), rows, IGNORE)

    def target_ids(self, rows: torch.Tensor) -> torch.Tensor:
        return rows if self.vmap is None else self.vmap.d2t[rows]


def draft_hidden(drafter: DFlashDrafter, frozen: Frozen, batch: BlockBatch) -> torch.Tensor:
    """One drafter forward over every block of the batch -> [S, Q, H]. Each block runs as its own row against its
    sequence's context (keys [T + B], not [T + Q]): the same attention as batch.same_block's block-diagonal mask,
    without the A-fold waste of scoring every other block's keys only to mask them out."""
    s, q = batch.tokens.shape
    t = batch.ctx_pos.shape[1]
    a = batch.real.shape[1]
    b = q // a
    ctx_kv = drafter.context_kv(batch.features.float(), batch.ctx_pos)  # per layer [S, T, kvh, D]
    ctx_kv = [tuple(x[:, None].expand(s, a, *x.shape[1:]).reshape(s * a, *x.shape[1:]) for x in kv)
              for kv in ctx_kv]  # per layer [S * A, T, kvh, D]
    x = frozen.embed(batch.tokens).float().view(s * a, b, -1)  # [S * A, B, H]
    q_pos = batch.q_pos.view(s * a, b)
    ctx_pos = batch.ctx_pos[:, None].expand(s, a, t).reshape(s * a, t)
    ctx_visible = batch.ctx_visible.view(s * a, b, t)
    same_block = torch.ones(s * a, b, b, dtype=torch.bool)
    masks = block_masks(drafter, ctx_visible, q_pos, torch.cat([ctx_pos, q_pos], dim=1), same_block)
    return drafter(x, q_pos, ctx_kv, masks).view(s, q, -1)


def block_loss(drafter: DFlashDrafter, frozen: Frozen):
    """Weighted CE over the labelled block positions, averaged over their weights."""
    def loss_fn(batch: BlockBatch) -> torch.Tensor:
        hidden = draft_hidden(drafter, frozen, batch)  # [S, Q, H]
        labels = frozen.head_labels(batch.labels)  # [S, Q]
        rows = labels != IGNORE
        if not rows.any():
            return hidden.sum() * 0.0
        logits = hidden[rows].to(frozen.head.dtype) @ frozen.head.t()  # [N, Vc]
        ce = F.cross_entropy(logits.float(), labels[rows], reduction="none")  # [N]
        w = batch.weights[rows]
        return (ce * w).sum() / w.sum()
    return loss_fn


@torch.no_grad()
def block_accuracy(drafter: DFlashDrafter, frozen: Frozen, batches: list[BlockBatch], block_size: int) -> dict:
    """Teacher-forced, on held-out blocks: top-1 accuracy per block position k = 1 .. B - 1 (a label outside the
    candidates is a miss: the drafter cannot propose it), and tau = the mean over blocks of 1 + the number of
    leading correct positions (a missing label — past the answer's end — stops the run, as the request would)."""
    was_training = drafter.training
    drafter.eval()
    b = block_size
    hits, counts = torch.zeros(b - 1), torch.zeros(b - 1)
    tau_sum, blocks = 0.0, 0
    for batch in batches:
        with compute_autocast():
            hidden = draft_hidden(drafter, frozen, batch)  # [S, Q, H]
        s, a = batch.real.shape
        hidden = hidden.view(s, a, b, -1)[:, :, 1:]  # [S, A, B - 1, H]
        logits = hidden.to(frozen.head.dtype) @ frozen.head.t()  # [S, A, B - 1, Vc]
        pred = frozen.target_ids(logits.argmax(-1))
        labels = batch.labels.view(s, a, b)[:, :, 1:]
        valid = labels != IGNORE
        match = (pred == labels) & valid  # [S, A, B - 1]
        hits += match.sum((0, 1)).float()
        counts += valid.sum((0, 1)).float()
        run = match.long().cumprod(-1).sum(-1)  # [S, A] leading correct positions
        tau_sum += float((1 + run)[batch.real].sum())
        blocks += int(batch.real.sum())
    drafter.train(was_training)
    return {"accuracy_by_position": [round(x, 4) for x in (hits / counts.clamp_min(1)).tolist()],
            "tau": round(tau_sum / max(blocks, 1), 4), "blocks": blocks}


def _split(records: list[dict]) -> tuple[list[dict], list[dict]]:
    train, held = split_by_prompt(records, 10)  # every tenth prompt, as medusa
    return train, held or train[: max(1, len(train) // 10)]


def _sequences(records: list[dict], features: list[torch.Tensor]) -> list[Sequence]:
    return [Sequence(record_ids(r), len(r["prompt_ids"]), answer_labels(r), f) for r, f in zip(records, features)]


def heldout_batches(seqs: list[Sequence], cfg: TrainConfig, block_size: int, mask_token_id: int, num_anchors: int,
                    gamma: float) -> list[BlockBatch]:
    """Every held-out sequence, with anchors drawn once from a fixed seed (the same blocks before and after)."""
    g = torch.Generator().manual_seed(EVAL_SEED)
    anchors = [draw_anchors(s.n_prompt, len(s.ids), num_anchors, g) for s in seqs]
    return [make_batch(seqs[i: i + cfg.batch_size], anchors[i: i + cfg.batch_size], block_size, mask_token_id, gamma)
            for i in range(0, len(seqs), cfg.batch_size)]


def training_batches(train: list[Sequence], cfg: TrainConfig, block_size: int, mask_token_id: int, num_anchors: int,
                     gamma: float):
    """step -> BlockBatch, a pure function of the step (a resumed run sees the same batches): sequences in a
    per-epoch permutation, anchors from a per-step generator."""
    def batch_fn(step: int) -> BlockBatch:
        picks = []
        for i in range(step * cfg.batch_size, (step + 1) * cfg.batch_size):
            epoch, pos = divmod(i, len(train))
            perm = torch.randperm(len(train), generator=torch.Generator().manual_seed(cfg.seed * 1000 + epoch))
            picks.append(train[int(perm[pos])])
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
        anchors = [draw_anchors(s.n_prompt, len(s.ids), num_anchors, g) for s in picks]
        return make_batch(picks, anchors, block_size, mask_token_id, gamma)
    return batch_fn


def build_drafter(target, num_layers: int, block_size: int, mask_token_id: int, layer_ids: list[int],
                  intermediate_size: int | None = None, init_layers: list[int] | None = None) -> DFlashDrafter:
    """A fresh fp32 drafter for `target` (seed it first), checked against it, optionally from target layers."""
    tcfg = target.config
    drafter = DFlashDrafter(new_config(tcfg, num_layers, block_size, mask_token_id, layer_ids, intermediate_size))
    drafter = drafter.float()
    check_against_target(drafter, tcfg, tcfg.vocab_size, field="dflash")
    if init_layers:
        init_from_target(drafter, target, init_layers)
    return drafter


def coverage(batches: list[BlockBatch], frozen: Frozen) -> float | None:
    """Fraction of the labels inside the candidate vocabulary (None: full vocabulary)."""
    if frozen.vmap is None:
        return None
    labelled = kept = 0
    for b in batches:
        labelled += int((b.labels != IGNORE).sum())
        kept += int((frozen.head_labels(b.labels) != IGNORE).sum())
    return round(kept / max(labelled, 1), 4)


def train_dflash(target_path: str, data: str | Path | list[dict], out: str | Path, cfg: TrainConfig,
                 num_layers: int = 2, block_size: int = 8, target_layer_ids: list[int] | None = None,
                 num_context_layers: int | None = None, mask_token_id: int | None = None, num_anchors: int = 16,
                 gamma: float | None = None, init_layers: list[int] | None = None, vocab_map: str | None = None,
                 intermediate_size: int | None = None, max_len: int = 1024, init_drafter: str | None = None) -> dict:
    """Trains a DFlash drafter for the frozen target on a selfgen set (a directory, or its records); exports it
    (z-lab's format + our d2t) to `out` with a train_summary.json (held-out per-position accuracy and tau,
    untrained vs trained, the config, steps / tokens / time). `init_drafter` continues from an exported drafter:
    its layers, block size, mask token, context layers and vocabulary map override the arguments."""
    if block_size < 2:
        raise ValueError(f"block_size: must be >= 2, got {block_size}")
    ckpt_dir = Path(cfg.ckpt_dir) if cfg.ckpt_dir else default_ckpt_dir("dflash", out)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    cfg.ckpt_dir = str(ckpt_dir)
    setup_runtime(cfg)
    gamma = gamma or default_gamma(block_size)
    target = load_target(target_path, torch.bfloat16).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    tcfg = target.config
    records = data if isinstance(data, list) else load_set(data, max_len, target, target_path, ckpt_dir)
    records = [r for r in records if len(r["output_ids"]) > 0]
    train_recs, held_recs = _split(records)
    if not train_recs:
        raise ValueError("data: no training answers (every prompt is held out, or every answer is empty)")
    prior = load_drafter(init_drafter, torch.float32, torch.device("cpu"), "init_drafter") if init_drafter else None
    if prior is not None:
        target_layer_ids, num_layers = prior[0].target_layer_ids, len(prior[0].layers)
        block_size, mask_token_id = prior[0].block_size, prior[0].mask_token_id
    layer_ids = context_layer_ids(tcfg.num_hidden_layers, num_layers, target_layer_ids, num_context_layers)
    if mask_token_id is None:
        mask_token_id = choose_mask_token(special_token_ids(load_tokenizer(target_path)), used_token_ids(records),
                                          tcfg.vocab_size)
    vmap = load_vocab_ids(vocab_map, tcfg.vocab_size) if vocab_map else None
    if prior is not None and prior[1] is not None:
        vmap = VocabMap.from_d2t(prior[1], tcfg.vocab_size)
    feats = cached_features(target, target_path, train_recs + held_recs, layer_ids, ckpt_dir)
    train = _sequences(train_recs, feats[: len(train_recs)])
    held = _sequences(held_recs, feats[len(train_recs):])

    torch.manual_seed(cfg.seed)
    if prior is not None:
        drafter = prior[0].train()
    else:
        drafter = build_drafter(target, num_layers, block_size, mask_token_id, layer_ids, intermediate_size,
                                init_layers)
    head = lm_head_weight(target).detach()
    frozen = Frozen(target.get_input_embeddings(),
                    (head if vmap is None else head[vmap.d2t]).to(train_dtype()).contiguous(), vmap)
    n_params = sum(p.numel() for p in drafter.parameters())
    init_name = init_drafter or (f"target layers {init_layers}" if init_layers else "random")
    held_batches = heldout_batches(held, cfg, block_size, mask_token_id, num_anchors, gamma)
    held_coverage = coverage(held_batches, frozen)
    print(f"[dflash] {len(train)} train / {len(held)} held-out answers; drafter {num_layers} layers x "
          f"{tcfg.hidden_size}, block {block_size}, {n_params / 1e6:.2f}M params, context layers {layer_ids}, "
          f"mask token {mask_token_id}, vocabulary {'full' if vmap is None else vmap.d2t.numel()} (held-out label "
          f"coverage {held_coverage}), init {init_name}",
          flush=True)
    before = block_accuracy(drafter, frozen, held_batches, block_size)
    summary = run_loop(drafter, block_loss(drafter, frozen),
                       training_batches(train, cfg, block_size, mask_token_id, num_anchors, gamma),
                       held_batches[: cfg.eval_batches], cfg, ckpt_dir, "dflash")
    drafter.eval()
    after = block_accuracy(drafter, frozen, held_batches, block_size)
    save_drafter(drafter, out, d2t=None if vmap is None else vmap.d2t)
    report = {**{k: v for k, v in summary.items() if k != "config"}, "kind": "dflash", "target": str(target_path),
              "data": "<records>" if isinstance(data, list) else str(data),
              "drafter": {"num_layers": num_layers, "block_size": block_size, "mask_token_id": mask_token_id,
                          "target_layer_ids": layer_ids, "hidden_size": drafter.config.hidden_size,
                          "intermediate_size": drafter.config.intermediate_size, "num_params": n_params,
                          "init_layers": list(init_layers or []), "init": init_name},
              "num_anchors": num_anchors, "gamma": gamma, "draft_vocab": None if vmap is None else vmap.d2t.numel(),
              "heldout_label_coverage": held_coverage, "train_answers": len(train), "heldout_answers": len(held),
              "heldout_blocks": after["blocks"],
              "accuracy_by_position_untrained": before["accuracy_by_position"],
              "accuracy_by_position": after["accuracy_by_position"],
              "tau_untrained": before["tau"], "tau": after["tau"], "config": asdict(cfg)}
    (Path(out) / "train_summary.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"[dflash] held-out tau {before['tau']} -> {after['tau']}; top-1 by block position "
          f"{after['accuracy_by_position']} (untrained {before['accuracy_by_position']}); exported to {out}",
          flush=True)
    return report
