#!/usr/bin/env bash
# Installs the Debian packages r3 builds and tests with. Idempotent: silent and fast when
# everything is already there.
set -euo pipefail
pkgs=(cmake ninja-build g++ nlohmann-json3-dev libcpp-httplib-dev libgtest-dev libgmock-dev
      libbenchmark-dev pybind11-dev python3-dev python3-numpy python3-pytest pkg-config
      python3-pip python3-venv python3-setuptools python3-wheel libpcre2-dev libutf8proc-dev
      python3-jinja2 python3-torch openmpi-bin libopenmpi-dev pyflakes3 shellcheck clang-format)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# The e2e test drives `r3 serve` with the openai npm package: any node/npm will do (the machine
# may carry NodeSource's nodejs, which bundles npm and conflicts with Debian's npm package).
command -v npm >/dev/null 2>&1 || missing+=(nodejs npm)
[ ${#missing[@]} -eq 0 ] && exit 0
echo "setup: installing ${missing[*]}"
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
