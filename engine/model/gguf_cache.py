"""A small GGUF file converted once: the dequantised fp32 weights, config, generation config and tokenizer that
transformers builds from the file, saved as an HF directory under $SPECSERVE_CACHE/gguf (default
~/.cache/specserve/gguf), and read from there on later starts.

Reading a GGUF through transformers parses the whole file several times (its tokenizer's 49k strings field by field,
a tensor-name map rebuilt per module): the demo target took ~16 s to load and ~5 s for its tokenizer; from the
converted directory, well under a second each, with the same weights, tokenizer and chat template (tested). Only files
up to MAX_FILE_BYTES are converted (their fp32 copy is ~8x the file on disk); larger ones load from the file as before.

The entry is named by the file's resolved path, size and modification time and by the transformers version, so a
changed file or library converts again; a cache that cannot be written (a read-only home) only costs the time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from pathlib import Path

log = logging.getLogger("specserve.engine")

VERSION = 1
MAX_FILE_BYTES = 512 << 20
META = "specserve_gguf.json"  # written last: a directory with it is complete


def cache_root() -> Path:
    return Path(os.environ.get("SPECSERVE_CACHE") or Path.home() / ".cache" / "specserve") / "gguf"


def cacheable(path: str | os.PathLike) -> bool:
    try:
        return Path(path).expanduser().stat().st_size <= MAX_FILE_BYTES
    except OSError:
        return False


def entry(path: str | os.PathLike) -> Path:
    import transformers

    p = Path(path).expanduser().resolve()
    st = p.stat()
    key = f"{p}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}|{VERSION}"
    return cache_root() / f"{p.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def lookup(path: str | os.PathLike) -> Path | None:
    """The converted directory of `path`, if a complete one exists."""
    if not cacheable(path):
        return None
    d = entry(path)
    return d if (d / META).is_file() else None


def decoder_tensor_types(path: str | os.PathLike) -> set[str] | None:
    """GGUF types of the file's blk.* matrices (None: unreadable), from the cache when converted."""
    found = lookup(path)
    if found is not None:
        return set(json.loads((found / META).read_text())["decoder_tensor_types"])
    from gguf import GGUFReader  # transformers' own GGUF dependency

    try:
        tensors = GGUFReader(str(path)).tensors
    except Exception:  # noqa: BLE001  unreadable: load_model reports it, naming the file and the field
        return None
    return {t.tensor_type.name for t in tensors if t.name.startswith("blk.") and len(t.shape) == 2}


def store(path: str | os.PathLike, model) -> None:
    """Save `model` (loaded from the file in fp32, nothing changed yet) with the file's tokenizer; never raises."""
    if not cacheable(path):
        return
    try:
        from transformers import AutoTokenizer

        final = entry(path)
        tmp = final.parent / f".{final.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        try:
            p = Path(path).expanduser()
            model.save_pretrained(tmp)
            AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name).save_pretrained(tmp)
            (tmp / META).write_text(json.dumps({"source": str(p.resolve()),
                                                "decoder_tensor_types": sorted(decoder_tensor_types(p) or ())}))
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone after the rename; a partial or losing copy otherwise
        log.info("gguf: %s converted once into %s (later starts read it)", path, final)
    except Exception as exc:  # noqa: BLE001  a cache is an optimisation: loading already succeeded
        log.info("gguf: %s not cached (%s: %s)", path, type(exc).__name__, exc)
