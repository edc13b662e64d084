#!/usr/bin/env bash
# Under -Dgpu_standin nothing CUDA may be installed: not the stand-in, not libzclient_cuda built
# against it, not its header or pkg-config file.  Usage: standin_not_installed.sh BUILD_ROOT
set -euo pipefail
installed=$(meson introspect --installed "$1")
bad=$(python3 -c '
import json, sys
for src, dst in json.loads(sys.argv[1]).items():
    if "cuda" in src.rsplit("/", 1)[-1] or "cuda" in dst.rsplit("/", 1)[-1]:
        print(dst)' "$installed")
if [ -n "$bad" ]; then
	echo "installed from a stand-in build:" >&2
	echo "$bad" >&2
	exit 1
fi
echo "nothing CUDA installed"
