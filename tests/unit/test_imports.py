"""The engine and config never pull in the web stack (server imports engine, never the other way round), and the
config imports nothing from the engine."""

import json
import subprocess
import sys
from pathlib import Path

WEB_STACK = ["fastapi", "uvicorn", "starlette", "sse_starlette", "prometheus_client"]
ROOT = Path(__file__).resolve().parents[2]

SCRIPT = f"""
import json, sys
import specserve.engine, specserve.engine.async_engine, specserve.config
web = {WEB_STACK!r}
print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in web)))
"""


def test_engine_and_config_do_not_import_the_web_stack():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_the_check_sees_a_web_import():
    # guard against a vacuous check: importing a web module in the same way is detected
    script = SCRIPT.replace("import specserve.engine, specserve.engine.async_engine, specserve.config",
                            "sys.modules['starlette.fake'] = json")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == ["starlette.fake"]


def test_config_imports_nothing_from_the_engine():
    script = ("import json, sys\nimport specserve.config, specserve.config.loader\n"
              "print(json.dumps(sorted(m for m in sys.modules if m.startswith('specserve.engine'))))")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
