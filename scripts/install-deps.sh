#!/usr/bin/env bash
# Installs what luma needs to build and test on Debian (as root or with sudo):
# a C compiler, CMake, Lua 5.4 with its headers, busted, luarocks, clang (the
# fuzzer), python3 with pip (the default model's download).
set -euo pipefail
pkgs=(build-essential cmake pkg-config liblua5.4-dev lua5.4 lua-busted luarocks
      clang libclang-rt-14-dev python3 python3-pip)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
fi
# pip may come from another python3 than Debian's; either works for downloads.
python3 -m pip --version >/dev/null
