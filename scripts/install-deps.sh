#!/usr/bin/env bash
# Installs everything moerl needs to build and test on Debian 12 (bookworm).
# Runs apt-get as root (through sudo when not root).
set -euo pipefail

packages=(
  build-essential cmake pkg-config git
  libzmq3-dev libuv1-dev libmsgpack-dev libcunit1-dev libopenblas-dev libfyaml-dev
  libopenmpi-dev openmpi-bin libcjson-dev libpcre2-dev libmicrohttpd-dev
  clang libclang-rt-14-dev libomp-14-dev
  python3 python3-torch python3-numpy python3-zmq python3-msgpack
)

as_root=()
if [ "$(id -u)" -ne 0 ]; then
  as_root=(sudo)
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get update -q
if [ "${#missing[@]}" -gt 0 ]; then
  echo "moerl: installing ${missing[*]}"
  "${as_root[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
else
  echo "moerl: all Debian packages present"
fi
