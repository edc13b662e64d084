#!/usr/bin/env bash
# Install what is missing, build with warnings as errors, run every test.
# --sanitize: the same in a separate AddressSanitizer + UBSan build (build-sanitize).
# Other arguments go to `meson test` (a suite: --suite service).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh
install_deps test

build=build-test
setup=(-Dwerror=true -Dtests=enabled)
test_args=()
if [ "${1:-}" = "--sanitize" ]; then
	shift
	build=build-sanitize
	# jemalloc is dropped under sanitizers (meson.build); the runtime resolves at load time.
	setup+=(-Db_sanitize=address,undefined -Db_lundef=false)
	# ASan makes the numerics and the 64M-element fairness test a few times slower.
	test_args+=(--timeout-multiplier 4)
fi
[ -f "$build/build.ninja" ] || meson setup "$build" "${setup[@]}" >/dev/null
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
