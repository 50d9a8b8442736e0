#!/usr/bin/env bash
# Installs a build into a temporary prefix, then builds tests/consumer against it twice (with
# CMake's find_package, and with g++ and pkg-config) and runs both; the installed rd2h
# binary must report the version.
# Usage: run.sh BUILD_DIR LIBDIR VERSION CMAKE CXX GENERATOR
set -euo pipefail
build=$1 libdir=$2 version=$3 cmake=$4 cxx=$5
export CMAKE_GENERATOR=$6
here=$(cd "$(dirname "$0")" && pwd)
prefix=$(mktemp -d)
trap 'rm -rf "$prefix"' EXIT

"$cmake" --install "$build" --prefix "$prefix/usr" >/dev/null
root=$prefix/usr
export LD_LIBRARY_PATH="$root/$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

echo "== installed"
(cd "$root" && find . \( -type f -o -type l \) | sort)
if [ -n "$(find "$root/include" -mindepth 1 -maxdepth 1 ! -name rd2h)" ]; then
  echo "installed headers outside include/rd2h"; exit 1
fi

echo "== find_package(rd2h)"
"$cmake" -S "$here" -B "$prefix/cmake-build" -DCMAKE_PREFIX_PATH="$root" \
  -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_BUILD_TYPE=Release >/dev/null
"$cmake" --build "$prefix/cmake-build" >/dev/null
"$prefix/cmake-build/app"

echo "== pkg-config rd2h"
static=()  # a static librd2h brings its dependencies: pkg-config --static
[ -e "$root/$libdir/librd2h.so" ] || static=(--static)
flags=$(PKG_CONFIG_PATH="$root/$libdir/pkgconfig" pkg-config "${static[@]}" --cflags --libs rd2h)
echo "pkg-config: $flags"
# shellcheck disable=SC2086  # the flags are words
"$cxx" -std=c++20 "$here/main.cc" -o "$prefix/app-pc" $flags
"$prefix/app-pc"

echo "== rd2h --version"
out=$(env -u LD_LIBRARY_PATH "$root/bin/rd2h" --version)
echo "$out"
[ "$out" = "rd2h $version" ]
