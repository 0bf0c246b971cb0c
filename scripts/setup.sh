#!/usr/bin/env bash
# Installs the Debian packages r3 builds and tests with. Idempotent: silent and fast when
# everything is already there.
set -euo pipefail
pkgs=(cmake ninja-build g++ nlohmann-json3-dev libcpp-httplib-dev libgtest-dev libgmock-dev
      libbenchmark-dev pybind11-dev python3-dev python3-numpy python3-pytest)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "setup: installing ${missing[*]}"
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
