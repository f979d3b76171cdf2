"""Runs every causal-LM family transformers registers through the engine (tiny random model, fp32 greedy, plain and
self-speculative, against HF generate()) and prints a markdown table: family | exact / refused: reason / error.

    .venv/bin/python tools/families.py [FAMILY ...] [--timeout S] [--unchecked]

--unchecked skips the config rules of the load-time check (the probe forward still runs), to show what each
config-driven refusal prevents.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

from specserve.engine.model.support import unsupported_features  # noqa: E402
from tests import tiny_families  # noqa: E402

REFUSAL_PREFIX = "is not supported by the paged attention: "


class FamilyTimeout(Exception):
    pass


TABLE_START, TABLE_END = "<!-- families:start -->", "<!-- families:end -->"


def _alarm(signum, frame):
    raise FamilyTimeout()


def family_status(model_type: str, root: Path, timeout: int) -> str:
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(timeout)
    try:
        model_class = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type], None)
        if model_class is not None and not getattr(model_class, "_supports_attention_backend", False):
            reasons = _config_reasons(model_type) + [f"{model_class.__name__} does not route attention through "
                                                     "transformers' AttentionInterface"]
            return f"refused: {'; '.join(reasons)}"  # what load_model says, without building the model
        try:
            path = tiny_families.save_family(model_type, root)
        except FamilyTimeout:
            raise
        except Exception as exc:  # noqa: BLE001 - a family transformers cannot build tiny is reported, not fatal
            reasons = _config_reasons(model_type)
            if reasons:
                return f"refused: {'; '.join(reasons)} (from its full-size config: no tiny model, {_short(exc)})"
            return f"error: cannot build a tiny model ({_short(exc)})"
        status = tiny_families.check_family(path)
        if status.startswith("refused: "):
            reason = status.removeprefix("refused: ")
            if REFUSAL_PREFIX in reason:
                reason = reason.split(REFUSAL_PREFIX, 1)[1]
            elif reason.startswith("model "):  # "model <path>: <reason>"
                reason = reason.split(": ", 1)[-1]
            return f"refused: {reason}"
        return status
    except FamilyTimeout:
        return f"error: timed out after {timeout} s"
    except AssertionError as exc:
        return f"error: {str(exc).split(':', 1)[0]}"
    except Exception as exc:  # noqa: BLE001
        return f"error: {_short(exc)}"
    finally:
        signal.alarm(0)


def _config_reasons(model_type: str) -> list[str]:
    try:
        return unsupported_features(transformers.AutoConfig.for_model(model_type))
    except Exception:  # noqa: BLE001
        return []


def _short(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}".replace("|", "/")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("families", nargs="*", help="model_type names (default: all)")
    ap.add_argument("--timeout", type=int, default=120, help="seconds per family")
    ap.add_argument("--unchecked", action="store_true", help="skip the config rules of the load-time check")
    ap.add_argument("--write-doc", action="store_true", help="also put the table into docs/model-families.md "
                                                                  "(between its family-table markers)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # tiny models: one thread is many times faster than two contending ones
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if args.unchecked:
        import specserve.engine.model.support
        specserve.engine.model.support.unsupported_features = lambda config: []
    names = args.families or tiny_families.families()
    rows, t0 = [], time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(names):
            t = time.time()
            status = family_status(name, Path(tmp), args.timeout)
            rows.append((name, status))
            print(f"[{i + 1}/{len(names)}] {name}: {status} ({time.time() - t:.1f} s)", file=sys.stderr, flush=True)
    counts = {k: sum(s.startswith(k) for _, s in rows) for k in ("exact", "refused", "error")}
    text = (f"transformers {transformers.__version__}: {len(rows)} families, {counts['exact']} exact, "
            f"{counts['refused']} refused, {counts['error']} error\n\n| family | status |\n|---|---|\n"
            + "".join(f"| {name} | {status} |\n" for name, status in rows))
    print(text + f"\n({time.time() - t0:.0f} s)")
    if args.write_doc:
        write_doc(text)
    return 0


def write_doc(table: str) -> None:
    """Replace the text between the family-table markers of docs/model-families.md."""
    path = Path(__file__).resolve().parents[1] / "docs" / "model-families.md"
    doc = path.read_text()
    start, end = doc.index(TABLE_START) + len(TABLE_START), doc.index(TABLE_END)
    path.write_text(doc[:start] + "\n" + table + doc[end:])


if __name__ == "__main__":
    sys.exit(main())
