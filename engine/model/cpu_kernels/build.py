"""Build kernels.c once per machine with its C compiler and load it with ctypes.

The library is compiled for the CPU it runs on (`-march=native`) into $SPECSERVE_CACHE/kernels (default
~/.cache/specserve/kernels), named by a hash of the source, the compiler's version, the level and the CPU's flags, so
a changed source, compiler or CPU builds again; a build takes about a second. `SPECSERVE_CPU_LEVEL` builds for a
lower level instead (portable, x86-64-v3, x86-64-v4, x86-64-v4-bf16, x86-64-v4-amx: what a CPU of that kind would
run, for benchmarks and tests); the kernel tests run every level this CPU can execute (`runnable_levels`). Plain C
expressions are never contracted into fused multiply-adds (`-ffp-contract=off`): a level computes them as written,
so levels differ only where their vector code does. A loaded library must report this source's version and struct
layout. Without a compiler, or where the build or cache
fails, `load()` returns None and says why once: the engine then runs torch's kernels (the same model, slower).
`SPECSERVE_CPU_KERNELS=0` turns them off.

Without a compiler, libraries built ahead for x86-64 feature levels (`python -m
specserve.engine.model.cpu_kernels.build DIR`, what the Docker image does in its build stage) are used from
$SPECSERVE_CPU_KERNELS_DIR: the highest level this CPU has, built from the same source.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import uuid
from pathlib import Path

import torch  # noqa: F401  (loads torch's libgomp.so.1 first: the kernels then share its OpenMP threads)

log = logging.getLogger("specserve.engine")

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-ffp-contract=off"]
VERSION = 10  # kernels.c's specserve_kernels_version: a library that says otherwise is not this source's
ENV_SWITCH = "SPECSERVE_CPU_KERNELS"
ENV_LEVEL = "SPECSERVE_CPU_LEVEL"
ENV_PREBUILT = "SPECSERVE_CPU_KERNELS_DIR"
ENV_AMX = "SPECSERVE_CPU_AMX"  # 0: no AMX tiles (bf16 models' int4 products then run on AVX-512)
# 1: libraries built with AddressSanitizer and UBSan (tests only: the process must preload libasan, see
# tests/unit/test_cpu_kernel_sanitized.py); any out-of-bounds read or undefined operation aborts with a report
ENV_SANITIZE = "SPECSERVE_CPU_SANITIZE"
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer", "-g", "-O1"]
# x86-64 feature levels a prebuilt library may target, best first, with the CPU flags each needs
V4 = ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
LEVELS = {"x86-64-v4-amx": V4 + ("avx512_bf16", "amx_tile", "amx_bf16"), "x86-64-v4-bf16": V4 + ("avx512_bf16",),
          "x86-64-v4": V4, "x86-64-v3": ("avx2", "fma", "bmi2", "f16c", "movbe")}
MARCH = {"x86-64-v4-amx": ["-march=x86-64-v4", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"],
         "x86-64-v4-bf16": ["-march=x86-64-v4", "-mavx512bf16"], "native": ["-march=native"]}  # else -march=<level>
PORTABLE = {"x86_64": "x86-64", "AMD64": "x86-64", "aarch64": "armv8-a", "arm64": "armv8-a"}  # the plain C loops

I64, F32, PTR, INT = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
SIGNATURES = {
    "specserve_q4_linear": [PTR, INT, I64, I64, PTR, PTR, PTR, PTR, I64, PTR],
    "specserve_q4_linear_bf16": [PTR, I64, I64, PTR, PTR, PTR, PTR, I64, PTR],
    "specserve_q8_linear": [PTR, INT, I64, I64, PTR, PTR, I64, PTR],
    "specserve_llama_layer": [PTR, PTR, PTR, PTR, PTR, PTR],
    "specserve_llama_stack": [PTR, I64, PTR, PTR, PTR, PTR, PTR],
    "specserve_bf16_linear": [PTR, INT, I64, I64, PTR, PTR, I64, PTR],
    "specserve_attention": [PTR, INT, I64, I64, I64, PTR, PTR, INT, PTR, PTR, I64, I64, PTR, PTR, I64, F32, PTR],
}


def compiler() -> str | None:
    name = os.environ.get("CC") or "cc"
    return shutil.which(name) or shutil.which("gcc") or shutil.which("clang")


def cache_root() -> Path:
    return Path(os.environ.get("SPECSERVE_CACHE") or Path.home() / ".cache" / "specserve") / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def runnable_levels() -> list[str]:
    """The levels this CPU can execute, lowest first, ending with native."""
    levels = ["portable"] if platform.machine() in PORTABLE else []
    if platform.machine() in ("x86_64", "AMD64"):
        flags = set(_cpu_flags().split())
        levels += [level for level, needs in reversed(LEVELS.items()) if flags.issuperset(needs)]
    return levels + ["native"]


def _march(level: str) -> list[str]:
    if level == "portable":
        return [f"-march={PORTABLE[platform.machine()]}"]
    return MARCH.get(level, [f"-march={level}"])


def _sanitized() -> bool:
    return os.environ.get(ENV_SANITIZE, "0").strip().lower() in ("1", "true", "yes", "on")


def _flags() -> list[str]:
    return FLAGS + (SANITIZE if _sanitized() else [])


def _library_name(cc: str, level: str = "native") -> str:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), version.encode(), " ".join(_flags()).encode(), _cpu_flags().encode(),
                 platform.machine().encode(), level.encode()):
        digest.update(part)
        digest.update(b"\0")
    return f"specserve_cpu_{digest.hexdigest()[:16]}.so"


def prebuilt_name(level: str) -> str:
    return f"specserve_cpu_{level}_{hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]}.so"


def _prebuilt() -> Path | None:
    """The best library built ahead in $SPECSERVE_CPU_KERNELS_DIR that this CPU can run, if any."""
    directory = os.environ.get(ENV_PREBUILT)
    if not directory or platform.machine() not in ("x86_64", "AMD64"):
        return None
    flags = set(_cpu_flags().split())
    for level, needs in LEVELS.items():
        path = Path(directory) / prebuilt_name(level)
        if flags.issuperset(needs) and path.is_file():
            return path
    return None


def build(cc: str, target: Path, march: str = "native", source: Path | None = None) -> None:
    """Compile `source` (default kernels.c) into a temporary name and rename it: concurrent first starts never load a
    half-written library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{uuid.uuid4().hex}")
    flags = [g for f in _flags() for g in ([f] if f != "-march=native" else _march(march))]
    try:
        done = subprocess.run([cc, *flags, str(source or SOURCE), "-o", str(partial), "-lm"], capture_output=True,
                              text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-2000:]}")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernels library, built on first use; None where it cannot be (the reason is logged once)."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    if platform.machine() not in ("x86_64", "AMD64", "aarch64", "arm64"):
        log.info("cpu kernels: not built for %s; torch's kernels run", platform.machine())
        return None
    level = os.environ.get(ENV_LEVEL, "native").strip().lower() or "native"
    cc = compiler()
    target = None if cc is not None else _prebuilt()
    if cc is None and target is None:
        log.warning("cpu kernels: no C compiler (cc, gcc, clang or $CC) to build them; torch's kernels run, "
                    "same outputs, slower on CPU")
        return None
    try:
        if target is None:
            if level not in runnable_levels():
                raise RuntimeError(f"{ENV_LEVEL}={level}: not a level this CPU runs ({', '.join(runnable_levels())})")
            target = level_library(cc, level)
        return open_library(target)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("cpu kernels: could not build or load them (%s); torch's kernels run", exc)
        return None


def level_library(cc: str, level: str) -> Path:
    """The cached library of kernels.c built for `level`, built first if it is not there."""
    target = cache_root() / _library_name(cc, level)
    if not target.exists():
        build(cc, target, march=level)
    return target


def open_library(path: Path, strict: bool = True) -> ctypes.CDLL:
    """A built library with its functions typed, AMX tiles asked for unless $SPECSERVE_CPU_AMX is 0. Not `strict`
    (a bench's library built from an earlier kernels.c): functions it lacks are left out."""
    lib = ctypes.CDLL(str(path))
    if strict:
        check_library(lib, path)
    for name, args in SIGNATURES.items():
        if not strict and not hasattr(lib, name):
            continue
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None
    for name, args in (("specserve_amx", [INT]), ("specserve_amx_on", []), ("specserve_amx_min_rows", [])):
        if not strict and not hasattr(lib, name):
            return lib  # a library from before the AMX tiles
        getattr(lib, name).argtypes, getattr(lib, name).restype = args, INT
    if os.environ.get(ENV_AMX, "1").strip().lower() not in ("0", "false", "no", "off"):
        lib.specserve_amx(1)  # asks Linux for the tile state once; 0 where the CPU, kernel or build lacks it
    return lib


def check_library(lib: ctypes.CDLL, path: Path) -> None:
    """A library from another source, or laid out otherwise than ops.py's structs, would read garbage: refuse it."""
    from specserve.engine.model.cpu_kernels import ops  # ctypes and torch only

    lib.specserve_kernels_version.restype = INT
    if not hasattr(lib, "specserve_layout") or lib.specserve_kernels_version() != VERSION:
        raise RuntimeError(f"{path.name}: not built from this kernels.c (version {lib.specserve_kernels_version()}, "
                           f"expected {VERSION})")
    lib.specserve_layout.argtypes, lib.specserve_layout.restype = [INT], I64
    for i, struct in enumerate((ops.Q4Weights, ops.LayerWeights, ops.QueryGroupView, ops.ForwardView)):
        if lib.specserve_layout(i) != ctypes.sizeof(struct):
            raise RuntimeError(f"{path.name}: {struct.__name__} is {lib.specserve_layout(i)} bytes there, "
                               f"{ctypes.sizeof(struct)} in ops.py")


def for_device(device) -> ctypes.CDLL | None:
    """The kernels for a model on `device`: CPU only. (Callers keep them out of torch.compile: Dynamo cannot trace a
    ctypes call; a compiled forward keeps torch's kernels, which Inductor fuses.)"""
    return load() if getattr(device, "type", device) == "cpu" else None


def main(argv: list[str] | None = None) -> int:
    """`python -m specserve.engine.model.cpu_kernels.build DIR`: build one library per x86-64 level into DIR (for an
    image whose runtime has no compiler; point $SPECSERVE_CPU_KERNELS_DIR at DIR)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(main.__doc__, file=sys.stderr)
        return 2
    cc = compiler()
    if cc is None:
        print("no C compiler", file=sys.stderr)
        return 1
    for level in LEVELS:
        build(cc, Path(args[0]) / prebuilt_name(level), march=level)
        print(Path(args[0]) / prebuilt_name(level))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
