#!/usr/bin/env bash
# Builds the root Dockerfile and checks the image as a user would (docker/check_image.py): health, chat and a
# streamed chat through the OpenAI SDK, /metrics, HEALTHCHECK, non-root uid, --read-only, and `docker stop` with a
# stream in flight -> exit 0. Needs root (or a running Docker daemon). Where the daemon is missing it installs
# Debian's docker.io and starts dockerd (stopped again at the end).
#
# Nothing is fetched from Docker Hub or PyTorch's index: the base image is a Debian bookworm root made with
# debootstrap (host CA bundle inside, PIP_CERT set, so pip in the build trusts what the host trusts), and the torch
# index is a local directory of the CPU torch wheel and its dependencies served on 127.0.0.1. Both are made once and
# cached in $SPECSERVE_DOCKER_CACHE (default ~/.cache/specserve-docker). Build and run use --network host, so no
# traffic leaves the loopback interface except pip's to PyPI during the build.
#
#   bash docker/test-image.sh                  # fails (exit 1) where Docker cannot run
#   bash docker/test-image.sh --skip-unavailable   # exits 0 with a loud SKIPPED line instead (never a silent pass)
set -euo pipefail
cd "$(dirname "$0")/.."

SKIP_UNAVAILABLE=0
[ "${1:-}" = "--skip-unavailable" ] && SKIP_UNAVAILABLE=1
CACHE=${SPECSERVE_DOCKER_CACHE:-$HOME/.cache/specserve-docker}
TAG=${SPECSERVE_IMAGE_TAG:-specserve:test}
BASE_TAG=specserve-test/bookworm-python:1
TORCH_VERSION=$(sed -n 's/^ARG TORCH_VERSION=//p' Dockerfile)
CA_BUNDLE=${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}
PYTHON=${PYTHON:-.venv/bin/python}
mkdir -p "$CACHE"

say() { echo "test-image: $*"; }
unavailable() {
  if [ "$SKIP_UNAVAILABLE" = 1 ]; then say "SKIPPED: Docker cannot run here: $*"; exit 0; fi
  say "FAILED: Docker cannot run here: $*"; exit 1
}
apt_install() {
  command -v apt-get >/dev/null || unavailable "no apt-get to install $*"
  apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null \
    || unavailable "apt-get install $* failed"
}

started_dockerd=""
index_server=""
cleanup() {
  [ -n "$index_server" ] && kill "$index_server" 2>/dev/null || true
  if [ -n "$started_dockerd" ]; then kill "$started_dockerd" 2>/dev/null || true; fi
}
trap cleanup EXIT

# ---- 1. a Docker daemon ------------------------------------------------------------------------------------------
if ! docker info >/dev/null 2>&1; then
  [ "$(id -u)" = 0 ] || unavailable "no running Docker daemon, and starting one needs root"
  command -v dockerd >/dev/null || { say "installing Debian's docker.io"; apt_install docker.io; }
  say "starting dockerd (log: $CACHE/dockerd.log)"
  dockerd >"$CACHE/dockerd.log" 2>&1 &
  started_dockerd=$!
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || unavailable "dockerd did not start: $(tail -3 "$CACHE/dockerd.log")"
fi

# ---- 2. the stand-in base image: Debian bookworm + python3 + the host's CA bundle --------------------------------
if ! docker image inspect "$BASE_TAG" >/dev/null 2>&1; then
  rootfs_tar=$CACHE/bookworm-python-rootfs.tar
  if [ ! -s "$rootfs_tar" ]; then
    command -v debootstrap >/dev/null || { say "installing debootstrap"; apt_install debootstrap; }
    root=$(mktemp -d "$CACHE/rootfs.XXXXXX")
    say "debootstrap bookworm into $root"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" \
      http://deb.debian.org/debian >"$CACHE/debootstrap.log" 2>&1 \
      || { say "debootstrap failed: $(tail -3 "$CACHE/debootstrap.log")"; exit 1; }
    cp "$CA_BUNDLE" "$root/etc/ssl/certs/ca-certificates.crt"
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" -cf "$rootfs_tar.part" . && mv "$rootfs_tar.part" "$rootfs_tar"
    rm -rf "$root"
  fi
  say "importing $BASE_TAG"
  docker import --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    --change 'ENV LANG=C.UTF-8' "$rootfs_tar" "$BASE_TAG" >/dev/null
fi

# ---- 3. the stand-in torch index: torch==$TORCH_VERSION+cpu and its dependencies, one folder per project ---------
index=$CACHE/torch-index-$TORCH_VERSION
if [ ! -f "$index/.complete" ]; then
  say "making the torch index in $index"
  rm -rf "$index" && mkdir -p "$index/.wheels"
  # +cpu, so a machine without the CPU wheel fails here instead of downloading the CUDA build (several GB)
  python3 -m pip download -q --only-binary=:all: --python-version 3.11 --dest "$index/.wheels" \
    "torch==$TORCH_VERSION+cpu"
  for whl in "$index"/.wheels/*.whl; do
    name=$(basename "$whl" | cut -d- -f1 | tr 'A-Z' 'a-z' | sed -E 's/[-_.]+/-/g')
    mkdir -p "$index/$name" && mv "$whl" "$index/$name/"
  done
  touch "$index/.complete"
fi
# a fixed port by default: the index URL is a build argument, and a new value would invalidate the torch layer
port=${SPECSERVE_TORCH_INDEX_PORT:-38517}
python3 -m http.server --bind 127.0.0.1 --directory "$index" "$port" >/dev/null 2>&1 &
index_server=$!
for _ in $(seq 50); do
  python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/torch/', timeout=1)" 2>/dev/null && break
  kill -0 "$index_server" 2>/dev/null || { say "FAILED: the torch index could not serve on port $port"; exit 1; }
  sleep 0.2
done

# ---- 4. build -----------------------------------------------------------------------------------------------------
say "building $TAG (base $BASE_TAG, torch from http://127.0.0.1:$port/)"
build_start=$(date +%s)
# the legacy builder: Debian's docker.io has no buildx plugin, which a newer docker CLI needs for BuildKit
DOCKER_BUILDKIT=0 docker build --network host -t "$TAG" \
  --build-arg BASE_IMAGE="$BASE_TAG" --build-arg TORCH_INDEX_URL="http://127.0.0.1:$port/" . >"$CACHE/build.log" 2>&1 \
  || { tail -40 "$CACHE/build.log"; say "FAILED: docker build (log: $CACHE/build.log)"; exit 1; }
kill "$index_server" 2>/dev/null || true
index_server=""
say "built in $(( $(date +%s) - build_start )) s, $(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.2f GB", $1/1e9}')"

# ---- 5. run it as a user would --------------------------------------------------------------------------------------
if [ ! -x "$PYTHON" ]; then
  python3 -m venv .venv && .venv/bin/pip install -q openai httpx
  PYTHON=.venv/bin/python
fi
"$PYTHON" docker/check_image.py "$TAG"
