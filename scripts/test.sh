#!/usr/bin/env bash
# Install what is missing, build with warnings as errors, run every test.  The Python suites
# run twice: under Debian's /usr/bin/python3 (torch 1.13, the oldest supported) and under the
# torch 2.x venv of python/requirements-lock.txt (scripts/pyenv.sh, made once per machine).
# --sanitize: the same in a separate AddressSanitizer + UBSan build (build-sanitize).
# --clang: built with clang instead of the default compiler (build-clang; with --sanitize,
# build-clang-sanitize), so that both compilers' warnings stay errors.
# Other arguments go to `meson test` (a suite: --suite service).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh
. scripts/pyenv.sh
install_deps test
pyenv_ensure

# ccache (where meson found it): a clean clone elsewhere hits what an earlier one cached, the
# paths under this checkout hashed as relative ones and the working directory left out.
export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=1

sanitize=0
clang=0
while [ $# -gt 0 ]; do
	case $1 in
	--sanitize) sanitize=1 ;;
	--clang) clang=1 ;;
	*) break ;;
	esac
	shift
done

build=build-test
# gpu_standin: the CUDA side (tests/cuda, gpu_train, bench_slots) runs on the CPU stand-in
# of the CUDA runtime and NCCL (tests/cuda_standin); nothing CUDA is installed from it.
setup=(-Dwerror=true -Dtests=enabled -Dgpu_standin=enabled -Dpython_require=true
	"-Dpython_interpreters=/usr/bin/python3,$ZOFFLOAD_VENV/bin/python")
test_args=()
if [ $clang -eq 1 ]; then
	build=build-clang
	# The clang pass is for the C: the extension is built with clang (warnings as errors),
	# and its Python suites are left to the gcc pass, which runs them under both interpreters.
	setup[4]="-Dpython_interpreters=$ZOFFLOAD_VENV/bin/python"
	test_args+=(--no-suite python)
	export CC=clang
	# The CUDA stand-in and the kernels compiled through it are C++.
	export CXX=clang++
fi
if [ $sanitize -eq 1 ]; then
	[ $clang -eq 1 ] && build=build-clang-sanitize || build=build-sanitize
	# jemalloc is dropped under sanitizers (meson.build); the runtime resolves at load time.
	setup+=(-Db_sanitize=address,undefined -Db_lundef=false)
	# ASan makes the numerics and the 64M-element fairness test a few times slower.
	test_args+=(--timeout-multiplier 4)
fi
# An existing build dir takes the options again (one from before an option existed, or set up
# by hand, would otherwise skip tests: the CUDA tests must run on the stand-in).
if [ -f "$build/build.ninja" ]; then
	meson setup --reconfigure "$build" "${setup[@]}" >/dev/null
else
	meson setup "$build" "${setup[@]}" >/dev/null
fi
# A build dir set up by hand with the other compiler would test the wrong one.
# The compiler after any launcher meson put first (ccache, where it is installed).
cc_cmd=$(awk '/^rule c_COMPILER$/ { getline
	for (i = 3; i <= NF; i++) if ($i != "ccache" && $i != "sccache") { print $i; exit } }' \
	"$build/build.ninja")
is_clang=0
if [[ "$cc_cmd" == *clang* ]]; then is_clang=1; fi
if [ $is_clang -ne $clang ]; then
	echo "$build compiles with $cc_cmd: remove it and run again" >&2
	exit 1
fi
ninja -C "$build"

set +e
meson test -C "$build" --print-errorlogs --num-processes 2 "${test_args[@]}" "$@"
status=$?
set -e
# One closing line in the form every CI reader understands.
python3 - "$build/meson-logs/testlog.json" <<'PY'
import json, sys
counts = {"OK": 0, "FAIL": 0, "SKIP": 0, "TIMEOUT": 0, "ERROR": 0, "EXPECTEDFAIL": 0}
for line in open(sys.argv[1]):
    r = json.loads(line).get("result")
    counts[r] = counts.get(r, 0) + 1
failed = counts["FAIL"] + counts["TIMEOUT"] + counts["ERROR"]
print(f"tests: {counts['OK']} passed, {failed} failed, {counts['SKIP']} skipped")
PY
exit $status
