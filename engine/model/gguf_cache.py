"""A small GGUF file converted once: the dequantised fp32 weights, config, generation config and tokenizer that
transformers builds from the file, saved as an HF directory under $SPECSERVE_CACHE/gguf (default
~/.cache/specserve/gguf), and read from there on later starts.

Reading a GGUF through transformers parses the whole file several times (its tokenizer's 49k strings field by field,
a tensor-name map rebuilt per module): the demo target took ~16 s to load and ~5 s for its tokenizer; from the
converted directory, well under a second each, with the same weights, tokenizer and chat template (tested). Only files
up to MAX_FILE_BYTES are converted (their fp32 copy is ~8x the file on disk); larger ones load from the file as before.

Converting costs what one start used to (one read of the weights, one of the tokenizer); later starts read the
directory. The entry is named by the file's resolved path, size and modification time and by the transformers
version, so a changed file or library converts again; where the cache cannot be written (a read-only home) the file
is read directly, as before. A conversion needs room for the fp32 copy (ROOM_PER_FILE_BYTE bytes per byte of the
file, with a margin); where the cache's disk lacks it, or converting fails, the file is read directly and a warning says
why (every start then pays the slow read).
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
ROOM_PER_FILE_BYTE = 10  # the fp32 copy of a 4-5 bit file is ~6-8x the file (SmolLM2 Q4_1: 92 MB -> 540 MB), + margin
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


def converted(path: str | os.PathLike) -> Path | None:
    """The converted directory of `path`, converting it now if it is small and the cache is writable; None: read
    the file itself (too large, no writable cache, or transformers cannot read it: the caller reports that)."""
    if not cacheable(path):
        return None
    final = entry(path)
    if (final / META).is_file():
        return final
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        probe = final.parent / f".probe.{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError:
        return None  # read-only: converting would read the file twice for nothing
    need, free = room_needed(path), shutil.disk_usage(final.parent).free
    if free < need:
        log.warning("gguf: %s not converted: %s has %d MB free, the fp32 copy needs ~%d MB; every start reads the "
                    "file itself (slower)", path, final.parent, free >> 20, need >> 20)
        return None
    try:
        _convert(Path(path).expanduser(), final)
    except Exception as exc:  # noqa: BLE001  the direct read reports an unreadable file with its field
        log.warning("gguf: %s not converted (%s: %s); every start reads the file itself (slower)",
                    path, type(exc).__name__, exc)
        return None
    return final


def room_needed(path: str | os.PathLike) -> int:
    """Bytes of free disk a conversion of `path` asks for."""
    return Path(path).expanduser().stat().st_size * ROOM_PER_FILE_BYTE


def decoder_tensor_types(path: str | os.PathLike) -> set[str] | None:
    """GGUF types of the file's blk.* matrices (None: unreadable)."""
    found = converted(path)
    if found is not None:
        return set(json.loads((found / META).read_text())["decoder_tensor_types"])
    return _read_tensor_types(path)


def _read_tensor_types(path) -> set[str] | None:
    from gguf import GGUFReader  # transformers' own GGUF dependency

    try:
        tensors = GGUFReader(str(path)).tensors
    except Exception:  # noqa: BLE001  unreadable: load_model reports it, naming the file and the field
        return None
    return {t.tensor_type.name for t in tensors if t.name.startswith("blk.") and len(t.shape) == 2}


def _convert(path: Path, final: Path) -> None:
    """Read the file once (fp32 weights, tokenizer, tensor types) and save it as an HF directory, atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    types = _read_tensor_types(path)
    if types is None:
        raise ValueError("not a readable GGUF file")
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                 quantization_config=GgufConfig(dequantize=True))
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tmp = final.parent / f".{final.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / META).write_text(json.dumps({"source": str(path.resolve()), "decoder_tensor_types": sorted(types)}))
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / META).is_file():  # not another process's finished copy
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after the rename; a partial or losing copy otherwise
    log.info("gguf: %s converted once into %s (later starts read it)", path, final)
