"""How every benchmark ends: the JSON document to `--out` (or stdout) and the human-readable table to stderr."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def emit(doc: dict, out: str | None, table: str | None = None) -> None:
    text = json.dumps(doc, indent=2)
    if out:
        Path(out).write_text(text + "\n")
    else:
        print(text)
    if table:
        print(table, file=sys.stderr)
