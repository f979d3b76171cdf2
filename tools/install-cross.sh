#!/usr/bin/env bash
# Installs an aarch64 cross compiler and qemu-user (Debian's crossbuild-essential-arm64, qemu-user), with which
# tests/unit/test_kernel_check.py builds the CPU kernels for ARM and runs their C check. Best effort: prints why and
# exits 0 when they can't be had (that one test then skips).
set -uo pipefail
if command -v aarch64-linux-gnu-gcc >/dev/null && command -v qemu-aarch64 >/dev/null; then exit 0; fi
if ! command -v apt-get >/dev/null || [ "$(id -u)" != 0 ]; then
  echo "install-cross: no apt-get or not root; the aarch64 kernel check will skip"; exit 0
fi
{ apt-get install -y -q crossbuild-essential-arm64 qemu-user >/dev/null 2>&1 ||
  { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -q crossbuild-essential-arm64 qemu-user >/dev/null 2>&1; }; } ||
  { echo "install-cross: apt-get install failed; the aarch64 kernel check will skip"; exit 0; }
echo "install-cross: $(aarch64-linux-gnu-gcc --version | head -1), $(qemu-aarch64 --version | head -1)"
