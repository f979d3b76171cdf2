"""Training text: the running interpreter's standard-library sources (PSF licence) or a user path.

Owns file discovery, the deterministic train/held-out split, and held-out prompts for benchmarks.
"""
from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

EXCLUDED_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "__pycache__"})
TEXT_SUFFIXES = frozenset({".py", ".txt", ".md", ".rst", ".json", ".jsonl", ".toml"})


@dataclass(frozen=True)
class Corpus:
    """An ordered list of text files under `root`; `heldout_percent` of them never reach training."""

    root: Path
    files: tuple[Path, ...]
    heldout_percent: float = 2.0

    def is_heldout(self, path: Path) -> bool:
        # Hash of the relative path, not of contents or order, so the split survives new files.
        rel = path.relative_to(self.root).as_posix() if path != self.root else path.name
        bucket = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:4], "big") % 10_000
        return bucket < self.heldout_percent * 100

    def split_files(self, split: str) -> list[Path]:
        if split not in ("train", "heldout"):
            raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
        if len(self.files) == 1:
            return list(self.files)  # a single text file is split by chunks in iter_texts instead
        want = split == "heldout"
        return [p for p in self.files if self.is_heldout(p) == want]

    def iter_texts(self, split: str = "train") -> Iterator[str]:
        """Yield documents of one split; a single-file corpus keeps every 50th paragraph block held out."""
        if len(self.files) == 1:
            text = _read(self.files[0])
            blocks = text.split("\n\n")
            step = max(2, round(100 / self.heldout_percent))
            for i in range(0, len(blocks), 8):
                held = (i // 8) % step == step - 1
                if held == (split == "heldout"):
                    yield "\n\n".join(blocks[i:i + 8])
            return
        for path in self.split_files(split):
            text = _read(path)
            if text.strip():
                yield text

    def num_chars(self, split: str = "train") -> int:
        return sum(len(t) for t in self.iter_texts(split))


def _read(path: Path) -> str:
    # Some stdlib files are Latin-1 test fixtures; replacing bad bytes keeps the reader total.
    return path.read_text(encoding="utf-8", errors="replace")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def load_corpus(path: str | Path | None = None, heldout_percent: float = 2.0) -> Corpus:
    """`None` means the stdlib; a directory means its text files; a file means that one file."""
    if path is None:
        root = stdlib_root()
        files = _walk(root, suffixes=frozenset({".py"}))
    else:
        root = Path(path).expanduser().resolve()
        if root.is_file():
            return Corpus(root=root.parent, files=(root,), heldout_percent=heldout_percent)
        if not root.is_dir():
            raise ValueError(f"corpus: {root} is neither a file nor a directory")
        files = _walk(root, suffixes=TEXT_SUFFIXES)
    if not files:
        raise ValueError(f"corpus: no text files found under {root}")
    return Corpus(root=root, files=tuple(files), heldout_percent=heldout_percent)


def _walk(root: Path, suffixes: frozenset[str]) -> list[Path]:
    out = []
    for p in root.rglob("*"):
        rel_parts = p.relative_to(root).parts[:-1]
        if any(part in EXCLUDED_DIRS or part.startswith(".") for part in rel_parts):
            continue
        if p.suffix in suffixes and p.is_file():
            out.append(p)
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def heldout_prompts(corpus: Corpus, num_prompts: int = 64, max_chars: int = 200,
                    stride_chars: int = 2000) -> list[str]:
    """First ≤`max_chars` characters of held-out chunks, cut at a line boundary; deterministic order."""
    prompts: list[str] = []
    for text in corpus.iter_texts("heldout"):
        for start in range(0, len(text), stride_chars):
            chunk = text[start:start + max_chars]
            if start:
                # Begin at a line start so prompts look like what a user would paste.
                nl = chunk.find("\n")
                chunk = chunk[nl + 1:] if nl >= 0 else ""
            cut = chunk.rfind("\n")
            chunk = chunk[:cut + 1] if cut > 0 else chunk
            if len(chunk.strip()) >= 40:
                prompts.append(chunk)
            if len(prompts) >= num_prompts:
                return prompts
    return prompts
