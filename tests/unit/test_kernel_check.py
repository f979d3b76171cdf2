"""tests/native/kernel_check.c — the kernels checked from C alone — built at every level this CPU executes, proven
able to fail on a broken kernel, and built for aarch64 and run under qemu-user where a cross compiler and qemu are
installed (`apt-get install crossbuild-essential-arm64 qemu-user`): the portable C level is what ARM runs today."""

import shutil
import subprocess
from pathlib import Path

import pytest

from specserve.engine.model.cpu_kernels import build

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "tests" / "native" / "kernel_check.c"
pytestmark = pytest.mark.skipif(build.compiler() is None, reason="no C compiler")
# the library's flags, as an executable
FLAGS = [f for f in build.FLAGS if f not in ("-shared", "-fPIC", "-march=native")]


def compile_check(cc: str, march: list[str], out: Path, source: Path = CHECK) -> Path:
    done = subprocess.run([cc, *FLAGS, *march, str(source), "-o", str(out), "-lm"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.parametrize("level", build.runnable_levels() if build.compiler() else [])
def test_the_c_check_passes_at_every_level(tmp_path, level):
    exe = compile_check(build.compiler(), build._march(level), tmp_path / "check")
    done = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.endswith("ok: 0 failed\n"), done.stdout


def test_the_c_check_catches_a_broken_kernel(tmp_path):
    """A softmax normalised by a slightly wrong total: the check says which kernel failed, and exits non-zero."""
    (tmp_path / "tests" / "native").mkdir(parents=True)
    (tmp_path / "engine" / "model" / "cpu_kernels").mkdir(parents=True)
    shutil.copy(CHECK, tmp_path / "tests" / "native" / CHECK.name)
    source = build.SOURCE.read_text()
    broken = source.replace("1.0f / total : 0.0f", "1.0f / (total * 1.001f) : 0.0f")
    assert broken != source
    (tmp_path / "engine" / "model" / "cpu_kernels" / "kernels.c").write_text(broken)
    exe = compile_check(build.compiler(), build._march("portable"), tmp_path / "check",
                        tmp_path / "tests" / "native" / CHECK.name)
    done = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "FAIL attention" in done.stdout and "ok q4_linear" in done.stdout


CROSS, QEMU, SYSROOT = "aarch64-linux-gnu-gcc", "qemu-aarch64", "/usr/aarch64-linux-gnu"


@pytest.mark.skipif(shutil.which(CROSS) is None or shutil.which(QEMU) is None,
                    reason="no aarch64 cross compiler and qemu-user (apt-get install crossbuild-essential-arm64 "
                           "qemu-user)")
def test_the_portable_level_builds_and_passes_on_aarch64_under_qemu(tmp_path):
    """armv8-a: the plain C loops (NEON only where the compiler vectorises them), as an ARM server builds them."""
    exe = compile_check(shutil.which(CROSS), [f"-march={build.PORTABLE['aarch64']}"],
                        tmp_path / "check")
    done = subprocess.run([QEMU, "-L", SYSROOT, str(exe)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.endswith("ok: 0 failed\n"), done.stdout + done.stderr
