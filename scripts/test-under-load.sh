#!/usr/bin/env bash
# The whole suite, 5 times, with the CPU saturated by two busy loops (`yes > /dev/null`,
# twice): a test whose outcome depends on how a loaded scheduler interleaves things fails
# here first.  Not part of CI: it takes five full runs.  Every round's results are kept
# (build-test/meson-logs/under-load-N.json) and the end lists each test that failed, with
# the rounds it failed in.
# usage: scripts/test-under-load.sh [--rounds N] [arguments of scripts/test.sh, e.g. --suite service]
set -euo pipefail
cd "$(dirname "$0")/.."

rounds=5
if [ "${1:-}" = --rounds ]; then
	rounds=$2
	shift 2
fi
build=build-test
for a in "$@"; do
	[ "$a" = --sanitize ] && build=build-sanitize
done

busy=()
stop_busy() {
	for pid in "${busy[@]}"; do
		kill "$pid" 2>/dev/null || true
		wait "$pid" 2>/dev/null || true
	done
	busy=()
}
trap stop_busy EXIT
for _ in 1 2; do
	yes > /dev/null &
	busy+=($!)
done

status=0
for round in $(seq "$rounds"); do
	echo "=== round $round of $rounds, under 2 busy loops"
	scripts/test.sh "$@" || status=1
	cp "$build/meson-logs/testlog.json" "$build/meson-logs/under-load-$round.json"
done
stop_busy

python3 - "$build/meson-logs" "$rounds" <<'PY'
import json, sys
logs, rounds = sys.argv[1], int(sys.argv[2])
failed = {}
for r in range(1, rounds + 1):
    for line in open(f"{logs}/under-load-{r}.json"):
        t = json.loads(line)
        if t.get("result") in ("FAIL", "TIMEOUT", "ERROR"):
            failed.setdefault(t["name"], []).append(r)
if not failed:
    print(f"under load: every test passed in all {rounds} rounds")
for name, rs in sorted(failed.items()):
    print(f"under load: {name} failed in round(s) {', '.join(map(str, rs))} of {rounds}")
PY
exit $status
