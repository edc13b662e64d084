#!/usr/bin/env bash
# Fetches, on a Debian 12 machine with a package mirror, the Debian packages that
# benchmarks/device/run.sh builds against on a GPU machine that can reach none: the build's
# libraries with their headers, Criterion with what it loads, and pkg-config.  run.sh unpacks
# them under its temporary folder (never over /) and takes from them only the shared
# libraries the machine lacks.
#
# Usage: benchmarks/device/bundle-deps.sh [DIR]      (default .devdeps at the repository root;
# git ignores nothing there by itself: add it to .git/info/exclude, and carry it)
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
dir=${1:-$repo/.devdeps}
mkdir -p "$dir"
cd "$dir"
# Criterion's own shared-library dependencies (libgit2 and what it loads, nanomsg) are not on
# a CUDA image; glibc, libstdc++, zlib and OpenSSL are, and stay the machine's.
packages="liburing-dev liburing2 libnuma-dev libnuma1 libjemalloc-dev libjemalloc2
libevent-dev libevent-2.1-7 libevent-core-2.1-7 libevent-extra-2.1-7 libevent-pthreads-2.1-7
libevent-openssl-2.1-7 libcjson-dev libcjson1 libcriterion-dev libcriterion3 libboxfort-dev
libgit2-1.5 libhttp-parser2.9 libmbedcrypto7 libmbedtls14 libmbedx509-1 libnanomsg5 libssh2-1
libffi8 libpcre2-8-0 libgssapi-krb5-2 libk5crypto3 libkrb5-3 libkrb5support0 libkeyutils1
libcom-err2 pkgconf pkgconf-bin libpkgconf3"
# shellcheck disable=SC2086
apt-get download $packages
echo "$(ls "$dir"/*.deb | wc -l) packages in $dir"
