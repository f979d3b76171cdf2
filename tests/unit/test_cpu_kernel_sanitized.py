"""The kernel tests again against libraries built with AddressSanitizer and UBSan, at every level this CPU executes
(slow tier; portable C, AVX2 and this CPU's own): a kernel that reads past a buffer or shifts out of range crashes the whole server, every stream lost,
and a plain build may read garbage silently. A child process preloads the sanitizer runtimes (Python is not built
with them) and runs tests/unit/test_cpu_kernel_ops.py with SPECSERVE_CPU_SANITIZE=1 (checked to catch a kernel that reads out of
bounds: the test's own sabotage run)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from specserve.engine.model.cpu_kernels import build

ROOT = Path(__file__).resolve().parents[2]
# the kernels' own tests; not those of the build machinery (refused libraries, prebuilt ones), which only build more
KERNEL_TESTS = "not refused and not built_ahead and not failed_build and not forced and not switched_off"
pytestmark = [pytest.mark.slow, pytest.mark.skipif(build.compiler() is None, reason="no C compiler")]


def runtime(name: str) -> str | None:
    out = subprocess.run([build.compiler(), f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    return out if out and Path(out).is_file() else None


def sanitized_env(tmp_path) -> dict:
    asan, ubsan = runtime("libasan.so"), runtime("libubsan.so")
    if asan is None or ubsan is None:
        pytest.skip("the compiler has no sanitizer runtimes")
    return dict(os.environ, SPECSERVE_CPU_SANITIZE="1", SPECSERVE_CACHE=str(tmp_path), LD_PRELOAD=f"{asan} {ubsan}",
                ASAN_OPTIONS="detect_leaks=0:abort_on_error=1", UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")


def test_a_sanitized_build_catches_an_out_of_bounds_read(tmp_path):
    """The set-up itself (build.py's flags, the preloaded runtimes) stops a kernel that reads one past its buffer."""
    env = sanitized_env(tmp_path)
    source = tmp_path / "oob.c"
    source.write_text("#include <stdlib.h>\nint oob(int n) { int *a = malloc(4 * sizeof(int)); a[0] = n; "
                      "int v = a[n]; free(a); return v; }\n")
    code = ("import ctypes, sys; from pathlib import Path; from specserve.engine.model.cpu_kernels import build; "
            f"build.build(build.compiler(), Path({str(tmp_path / 'oob.so')!r}), source=Path({str(source)!r})); "
            f"lib = ctypes.CDLL({str(tmp_path / 'oob.so')!r}); lib.oob(1); print('in bounds'); lib.oob(4)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert "in bounds" in done.stdout and done.returncode != 0
    assert "AddressSanitizer: heap-buffer-overflow" in done.stderr or "runtime error: load of address" in done.stderr


@pytest.mark.timeout(600)
def test_the_kernel_tests_pass_under_address_and_undefined_behaviour_sanitizers(tmp_path):
    # each kind of vector code once (plain C, AVX2, this CPU's best): every level would take minutes
    env = dict(sanitized_env(tmp_path), SPECSERVE_TEST_CPU_LEVELS="portable,x86-64-v3,native")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                           "tests/unit/test_cpu_kernel_ops.py", "-k", KERNEL_TESTS], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=580)
    tail = (done.stdout + done.stderr)[-4000:]
    assert done.returncode == 0, tail
    assert " passed" in done.stdout and "ERROR: AddressSanitizer" not in done.stderr, tail
    assert list(tmp_path.rglob("specserve_cpu_*.so")), "no sanitized library was built"
