"""The kept corpus of the target's own answers: token ids only, in the repository (models/corpus/<name>/), appended
shard by shard and never rewritten. What a proposer learns from the target (logits, hidden states) is recomputed
teacher-forced from these ids; the ids are what costs generation time, so they are what is kept.

A shard is a safetensors file of flat uint16 arrays (every vocabulary here has < 65,536 ids) with offsets:
prompt_ids / prompt_offsets, output_ids / output_offsets, and per record its pass, temperature and whether it hit
max_tokens. `manifest.json` says where the data came from (target, prompt sources, sampling settings) and counts
it; a record is identified by (prompt ids, pass), so a rerun on any machine skips what is already there."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

FORMAT = 1
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Answer:
    prompt_ids: list[int]
    output_ids: list[int]
    pass_: int  # 0: greedy; 1, 2, ...: sampled (the manifest names each pass's temperature)
    temperature: float
    truncated: bool  # stopped at max_tokens rather than at the end of the turn


def record_key(prompt_ids: list[int], pass_: int) -> str:
    return hashlib.sha1(np.asarray(prompt_ids, dtype=np.uint32).tobytes() + bytes([pass_])).hexdigest()


def _flat(seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(s) for s in seqs])
    ids = np.fromiter((t for s in seqs for t in s), dtype=np.int64, count=int(offsets[-1]))
    if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np.uint16).max):
        raise ValueError("answers: token ids must fit uint16 (vocabulary < 65,536)")
    return ids.astype(np.uint16), offsets


class AnswerCorpus:
    """One corpus directory: read every shard, append new ones."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        path = self.dir / MANIFEST
        self.manifest: dict = json.loads(path.read_text()) if path.exists() else {"format": FORMAT, "shards": []}
        if self.manifest.get("format") != FORMAT:
            raise ValueError(f"answers: {path}: format {self.manifest.get('format')!r}, expected {FORMAT}")

    @property
    def shards(self) -> list[Path]:
        return [self.dir / s["file"] for s in self.manifest["shards"]]

    def __iter__(self):
        for shard in self.shards:
            yield from read_shard(shard)

    def keys(self) -> set[str]:
        return {record_key(a.prompt_ids, a.pass_) for a in self}

    def num_tokens(self) -> int:
        return sum(s["output_tokens"] for s in self.manifest["shards"])

    def describe(self, **fields) -> None:
        """Set where the data comes from (target, prompt sources, sampling); kept across appends."""
        self.manifest.update(fields)
        self._write_manifest()

    def append(self, answers: list[Answer]) -> Path:
        """Write one new shard and list it in the manifest (written last, so a crash leaves no listed half-shard)."""
        if not answers:
            raise ValueError("answers: an empty shard")
        self.dir.mkdir(parents=True, exist_ok=True)
        name = f"shard_{len(self.manifest['shards']):05d}.safetensors"
        prompts, p_off = _flat([a.prompt_ids for a in answers])
        outputs, o_off = _flat([a.output_ids for a in answers])
        save_file({"prompt_ids": prompts, "prompt_offsets": p_off, "output_ids": outputs, "output_offsets": o_off,
                   "pass": np.array([a.pass_ for a in answers], dtype=np.uint8),
                   "temperature": np.array([a.temperature for a in answers], dtype=np.float32),
                   "truncated": np.array([a.truncated for a in answers], dtype=np.uint8)}, str(self.dir / name))
        self.manifest["shards"].append({"file": name, "records": len(answers), "prompt_tokens": int(p_off[-1]),
                                        "output_tokens": int(o_off[-1])})
        self._write_manifest()
        return self.dir / name

    def _write_manifest(self) -> None:
        shards = self.manifest["shards"]
        self.manifest["totals"] = {"records": sum(s["records"] for s in shards),
                                   "prompt_tokens": sum(s["prompt_tokens"] for s in shards),
                                   "output_tokens": sum(s["output_tokens"] for s in shards)}
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(self.manifest, indent=1) + "\n")
        tmp.replace(self.dir / MANIFEST)


def read_shard(path: str | Path) -> list[Answer]:
    t = load_file(str(path))
    p, po, o, oo = t["prompt_ids"], t["prompt_offsets"], t["output_ids"], t["output_offsets"]
    return [Answer(p[po[i]:po[i + 1]].astype(np.int64).tolist(), o[oo[i]:oo[i + 1]].astype(np.int64).tolist(),
                   int(t["pass"][i]), round(float(t["temperature"][i]), 6), bool(t["truncated"][i]))
            for i in range(len(po) - 1)]
