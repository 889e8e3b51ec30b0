#!/usr/bin/env bash
# Installs the Debian packages that kvq's build, tests and benchmarks need, if any is missing. Extra package names
# may be passed as arguments. On a system without dpkg it only says what it would need.
set -euo pipefail

packages=(build-essential cmake ninja-build catch2 nlohmann-json3-dev libbenchmark-dev libfmt-dev "$@")
# qemu-x86_64 runs the mixed-instruction-set test on an emulated CPU without AVX.
if [ "$(uname -m)" = x86_64 ]; then packages+=(qemu-user); fi

if ! command -v dpkg >/dev/null 2>&1; then
  echo "install-deps: no dpkg here; make sure these (or their equivalents) are installed: ${packages[*]}"
  exit 0
fi

missing=()
for package in "${packages[@]}"; do
  if ! dpkg -s "$package" 2>/dev/null | grep -q '^Status: install ok installed'; then
    missing+=("$package")
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

sudo=()
if [ "$(id -u)" -ne 0 ]; then
  if ! command -v sudo >/dev/null 2>&1; then
    echo "install-deps: missing packages: ${missing[*]}; run as root or install them with apt-get" >&2
    exit 1
  fi
  sudo=(sudo)
fi
echo "install-deps: installing ${missing[*]}"
"${sudo[@]}" apt-get update
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
