#!/usr/bin/env bash
# Fetches Debian's prometheus package (prometheus + promtool) into .cache/prometheus without installing it
# system-wide; the metrics tests use it. Best effort: prints why and exits 0 when the package can't be had.
set -uo pipefail
cd "$(dirname "$0")/.."
dest=.cache/prometheus
if [ -x "$dest/usr/bin/promtool" ] && [ -x "$dest/usr/bin/prometheus" ]; then exit 0; fi
if ! command -v apt-get >/dev/null || ! command -v dpkg >/dev/null; then
  echo "install-prometheus: no apt-get/dpkg here; the Prometheus tests will skip"; exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && { apt-get download prometheus >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 &&
  apt-get download prometheus >/dev/null 2>&1; }; }) || { echo "install-prometheus: download failed; tests will skip"; exit 0; }
mkdir -p "$dest" && dpkg -x "$tmp"/prometheus_*.deb "$dest" && echo "install-prometheus: $("$dest/usr/bin/promtool" --version 2>&1 | head -1)"
