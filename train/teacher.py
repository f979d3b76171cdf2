"""One teacher path for every trainer: the data (the kept corpus of the target's answers, or an older selfgen
directory) and the target run teacher-forced over it in prefill-shaped bf16 batches, yielding per sequence the
hidden states of chosen layers and the target's top-k next-token log-probs.

Layer taps are the engine's ids (engine/model/hidden.py): i = the output of decoder layer i, -1 = the final norm's
output. HF's hidden_states[i] (the input of layer i, what EAGLE-3 names) is tap i - 1.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import torch

from specserve.engine.model.hidden import FINAL, decoder_layers, final_norm
from specserve.train.answers import MANIFEST, AnswerCorpus, read_shard
from specserve.train.loop import cache_base


def _prompt_index(prompt_ids: list[int]) -> int:
    """A stable id of a prompt (the held-out split keys on it, so it does not move as the corpus grows)."""
    return int.from_bytes(hashlib.sha1(str(prompt_ids).encode()).digest()[:6], "little")


def load_records(data: str | Path, max_len: int) -> list[dict]:
    """Sequences of at most max_len tokens as dicts: prompt_ids, output_ids (int32 tensors), index, prompt_index;
    an older selfgen directory's records also carry the top-k it stored."""
    directory = Path(data)
    if (directory / MANIFEST).is_file():
        records, index = [], 0
        for shard in AnswerCorpus(directory).shards:
            answers = read_shard(shard)
            for row, a in enumerate(answers):
                index += 1
                if a.output_ids:
                    records.append({"index": index - 1, "prompt_index": _prompt_index(a.prompt_ids),
                                    "temperature": a.temperature, "shard": shard, "row": row,
                                    "prompt_ids": torch.tensor(a.prompt_ids, dtype=torch.int32),
                                    "output_ids": torch.tensor(a.output_ids, dtype=torch.int32)})
    else:
        records = [r for shard in sorted(directory.glob("shard_*.pt")) for r in torch.load(shard)]
    records = [r for r in records if len(r["prompt_ids"]) + len(r["output_ids"]) <= max_len]
    if not records:
        raise ValueError(f"data: no answers with sequences <= {max_len} tokens in {directory}")
    return sorted(records, key=lambda r: r["index"])


def sequence(record: dict) -> torch.Tensor:
    return torch.cat([record["prompt_ids"], record["output_ids"]]).long()


def length_groups(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Indices sorted by length, grouped so that (group size x longest) stays within `batch_tokens`."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[i] <= batch_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@torch.no_grad()
def teacher_forward(target, records: list[dict], taps: list[int], top_k: int = 0, batch_tokens: int = 2048,
                    autocast=None, desc: str = "teacher") -> list[dict]:
    """Per record: {"hidden": [n, len(taps) * H] bf16 (taps concatenated in order), and with top_k > 0
    "top_ids" [n, k] int32 / "top_logprobs" [n, k] fp16 of the target's next-token distribution at every
    position}. Several sequences per forward, right-padded (causal: the real rows are exact)."""
    stack = decoder_layers(target)
    captured: dict[int, torch.Tensor] = {}

    def hook(tap: int):
        def fn(module, args, output):
            captured[tap] = output[0] if isinstance(output, tuple) else output
        return fn
    handles = [(final_norm(target) if i == FINAL else stack[i]).register_forward_hook(hook(i)) for i in set(taps)]
    seqs = [sequence(r) for r in records]
    out: list[dict] = [{} for _ in records]
    t0 = time.time()
    try:
        for group in length_groups([len(s) for s in seqs], batch_tokens):
            longest = max(len(seqs[i]) for i in group)
            ids = torch.zeros(len(group), longest, dtype=torch.long)
            mask = torch.zeros(len(group), longest, dtype=torch.long)
            for row, i in enumerate(group):
                ids[row, : len(seqs[i])], mask[row, : len(seqs[i])] = seqs[i], 1
            captured.clear()
            with autocast if autocast is not None else torch.autocast("cpu", enabled=False):
                if top_k:
                    logits = target(input_ids=ids, attention_mask=mask, use_cache=False).logits
                else:
                    target.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False)
            feats = torch.cat([captured[i] for i in taps], dim=-1) if taps else None  # [G, longest, n_taps * H]
            if top_k:
                top = torch.log_softmax(logits.float(), dim=-1).topk(top_k, dim=-1)
            for row, i in enumerate(group):
                n = len(seqs[i])
                if feats is not None:
                    out[i]["hidden"] = feats[row, :n].to(torch.bfloat16).clone()
                if top_k:
                    out[i]["top_ids"] = top.indices[row, :n].to(torch.int32).clone()
                    out[i]["top_logprobs"] = top.values[row, :n].to(torch.float16).clone()
    finally:
        for h in handles:
            h.remove()
    print(f"[{desc}] {len(records)} sequences ({sum(len(s) for s in seqs)} tokens) teacher-forced, taps {taps}, "
          f"top-{top_k}, in {time.time() - t0:.0f}s", flush=True)
    return out


def cache_key(target_path: str, records: list[dict], *parts) -> str:
    """Target, records and what was computed: a different set or choice never reuses a stale cache."""
    h = hashlib.sha256(str(Path(target_path).expanduser().resolve()).encode())
    for r in records:
        h.update(str(r["index"]).encode())
        h.update(str(len(r["output_ids"])).encode())
    h.update(repr(parts).encode())
    return h.hexdigest()[:16]


def cached_teacher(target, target_path: str, records: list[dict], taps: list[int], top_k: int, cache_dir: Path,
                   autocast=None, desc: str = "teacher") -> list[dict]:
    """teacher_forward, saved once per (target, records, taps, top_k) under cache_dir (outside git: recomputable)."""
    path = cache_dir / f"teacher-{cache_key(target_path, records, taps, top_k)}.pt"
    if path.exists():
        return torch.load(path)
    out = teacher_forward(target, records, taps, top_k, autocast=autocast, desc=desc)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(out, tmp)
    tmp.replace(path)
    return out


# -- the per-shard store: the corpus's teacher signals, computed once and read by every trainer ------------------------

def store_root(target_path: str) -> Path:
    """Where a target's per-shard teacher signals live (outside git: recomputable, and large: ~1.2 KB per tap per
    token in bf16)."""
    key = hashlib.sha256(str(Path(target_path).expanduser().resolve()).encode()).hexdigest()[:12]
    return cache_base() / "teacher" / key


def shard_digest(shard: Path) -> str:
    """The shard's content: a store file names it, so another corpus's (or a rewritten) shard is never served."""
    return hashlib.sha1(Path(shard).read_bytes()).hexdigest()[:16]


def _store_name(shard: Path, taps: list[int], top_k: int) -> str:
    return f"{shard.stem}.{shard_digest(shard)}.t{'_'.join(str(t) for t in sorted(set(taps)))}.k{top_k}.pt"


def _parse_store_name(name: str) -> tuple[str, str, set[int], int] | None:
    """"shard_00003.<digest>.t-1_1_14.k20.pt" -> ("shard_00003", "<digest>", {-1, 1, 14}, 20)."""
    parts = name.removesuffix(".pt").split(".")
    if len(parts) != 4 or (parts[2][:1], parts[3][:1]) != ("t", "k"):
        return None
    taps = {int(t) for t in parts[2][1:].split("_") if t}
    return parts[0], parts[1], taps, int(parts[3][1:])


def covering_file(root: Path, shard: Path, taps: list[int], top_k: int) -> Path | None:
    """A stored file for this shard's content with every tap asked for and at least top_k."""
    digest = shard_digest(shard)
    for path in sorted(root.glob(f"{shard.stem}.{digest}.*.pt")):
        parsed = _parse_store_name(path.name)
        if parsed and set(taps) <= parsed[2] and top_k <= parsed[3]:
            return path
    return None


def build_shard_file(target, shard: Path, taps: list[int], top_k: int, root: Path, autocast=None,
                     batch_tokens: int = 2048) -> Path:
    """Teacher-forces every answer of one corpus shard and saves the signals flat: "tap.<i>" [T, H] bf16 per tap,
    "top_ids" / "top_logprobs" [T, top_k], "offsets" [R + 1] (row r's tokens are offsets[r]:offsets[r + 1];
    answers with no output have no tokens)."""
    answers = read_shard(shard)
    rows = [{"prompt_ids": torch.tensor(a.prompt_ids, dtype=torch.int32),
             "output_ids": torch.tensor(a.output_ids, dtype=torch.int32)} for a in answers]
    live = [i for i, a in enumerate(answers) if a.output_ids]
    out = teacher_forward(target, [rows[i] for i in live], sorted(set(taps)), top_k, batch_tokens, autocast,
                          f"teacher {shard.name}")
    lengths = [0] * len(answers)
    for i, o in zip(live, out):
        lengths[i] = len(rows[i]["prompt_ids"]) + len(rows[i]["output_ids"])
    offsets = torch.zeros(len(answers) + 1, dtype=torch.long)
    offsets[1:] = torch.tensor(lengths).cumsum(0)
    flat: dict[str, torch.Tensor] = {"offsets": offsets}
    if taps:
        h = target.config.hidden_size
        joined = torch.cat([o["hidden"] for o in out]) if out else torch.zeros(0, h * len(set(taps)))
        for j, tap in enumerate(sorted(set(taps))):
            flat[f"tap.{tap}"] = joined[:, j * h:(j + 1) * h].contiguous()
    if top_k:
        flat["top_ids"] = torch.cat([o["top_ids"] for o in out])
        flat["top_logprobs"] = torch.cat([o["top_logprobs"] for o in out])
    root.mkdir(parents=True, exist_ok=True)
    path = root / _store_name(shard, taps, top_k)
    tmp = path.with_suffix(".tmp")
    torch.save(flat, tmp)
    tmp.replace(path)
    return path


def store_signals(target, target_path: str, records: list[dict], taps: list[int], top_k: int, autocast=None,
                  root: Path | None = None) -> list[dict]:
    """teacher_forward's output for corpus records, read from (or first written to) the per-shard store: a shard
    computed once for any taps and top-k serves every trainer that asks for a subset of them."""
    root = root or store_root(target_path)
    by_shard: dict[Path, list[int]] = {}
    for i, r in enumerate(records):
        by_shard.setdefault(Path(r["shard"]), []).append(i)
    out: list[dict] = [{} for _ in records]
    for shard, idx in by_shard.items():
        path = covering_file(root, shard, taps, top_k) or build_shard_file(target, shard, taps, top_k, root, autocast)
        flat = torch.load(path, mmap=True, weights_only=True)
        off = flat["offsets"]
        for i in idx:
            a, b = int(off[records[i]["row"]]), int(off[records[i]["row"] + 1])
            if taps:
                out[i]["hidden"] = torch.cat([flat[f"tap.{t}"][a:b] for t in taps], dim=-1)
            if top_k:
                out[i]["top_ids"] = flat["top_ids"][a:b, :top_k].clone()
                out[i]["top_logprobs"] = flat["top_logprobs"][a:b, :top_k].clone()
    return out


def teacher_signals(target, target_path: str, records: list[dict], taps: list[int], top_k: int, cache_dir: Path,
                    autocast=None, desc: str = "teacher") -> list[dict]:
    """The one entry point of every trainer: corpus records go through the per-shard store; others (an older
    selfgen directory, records built in memory) through a whole-set cache file under cache_dir."""
    if records and all("shard" in r for r in records):
        return store_signals(target, target_path, records, taps, top_k, autocast)
    return cached_teacher(target, target_path, records, taps, top_k, cache_dir, autocast, desc)


def precompute(target, target_path: str, data: str | Path, taps: list[int], top_k: int, autocast=None) -> dict:
    """`specserve train teacher`: fills the store for every shard of a corpus (the union of the taps the trainers
    read), so that each trainer afterwards only reads."""
    root = store_root(target_path)
    built, kept = [], []
    for shard in AnswerCorpus(data).shards:
        if covering_file(root, shard, taps, top_k):
            kept.append(shard.name)
        else:
            build_shard_file(target, shard, taps, top_k, root, autocast)
            built.append(shard.name)
    return {"store": str(root), "taps": taps, "top_k": top_k, "built": built, "already_there": kept}


def with_top_k(records: list[dict], target, target_path: str, cache_dir: Path, top_k: int = 20,
               autocast=None) -> list[dict]:
    """Records that lack the target's top-k (the kept corpus stores ids only) get it, teacher-forced, at the answer
    positions' predicting rows (the selfgen format: top_ids[j] is the distribution of output token j)."""
    missing = [r for r in records if "top_ids" not in r]
    if missing:
        for r, t in zip(missing, teacher_signals(target, target_path, missing, [], top_k, cache_dir, autocast,
                                                 "teacher top-k")):
            n_prompt = len(r["prompt_ids"])
            r["top_ids"] = t["top_ids"][n_prompt - 1: -1]
            r["top_logprobs"] = t["top_logprobs"][n_prompt - 1: -1]
    return records
