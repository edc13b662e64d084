#!/usr/bin/env bash
# Builds the libFuzzer targets with clang + ASan + UBSan (build-fuzz) and runs each for a bounded time.
# usage: scripts/fuzz.sh [SECONDS each target runs, side by side, default 60]
# Inputs that crash are kept as build-fuzz/artifacts/<target>/crash-*; a crash fails the script.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh
install_deps test

seconds=${1:-60}
build=build-fuzz
if ! command -v clang >/dev/null; then
	echo "fuzz: no clang: skipped"
	exit 0
fi
# Every library instrumented for coverage (fuzzer-no-link); the targets link libFuzzer itself.
[ -f "$build/build.ninja" ] || CC=clang meson setup "$build" -Dfuzz=enabled -Dcuda=disabled \
	-Db_sanitize=address,undefined -Db_lundef=false -Dc_args=-fsanitize=fuzzer-no-link >/dev/null
ninja -C "$build" tests/fuzz/fuzz_proto tests/fuzz/fuzz_config tests/fuzz/gen_corpus

export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# One target: its corpus, its run, its figures (in build-fuzz/fuzz_TARGET.report).
fuzz_one() {
	local target=$1 work="$build/corpus/$1" art="$build/artifacts/$1" status=0
	local report="$build/fuzz_$1.report"
	# A working corpus outside the tree: libFuzzer adds what it finds; the seeds stay as committed.
	mkdir -p "$work" "$art"
	cp -n tests/fuzz/corpus/$target/* "$work/" 2>/dev/null || true
	# Fresh seeds of every message type, in case the wire format moved on since the commit.
	[ $target = proto ] && "$build/tests/fuzz/gen_corpus" "$work" >/dev/null
	local dict=()
	[ -f tests/fuzz/$target.dict ] && dict=(-dict=tests/fuzz/$target.dict)
	echo "==> fuzz_$target for ${seconds}s" > "$report"
	if ! "$build/tests/fuzz/fuzz_$target" "$work" "${dict[@]}" -max_total_time="$seconds" \
		-max_len=70000 -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
		-artifact_prefix="$art/" 2> "$build/fuzz_$target.log"; then
		status=1
		tail -40 "$build/fuzz_$target.log" >> "$report"
		echo "fuzz_$target: FAILED, inputs in $art" >> "$report"
	fi
	# The last status line and the totals: executions, speed, coverage.
	{ grep -E '^#[0-9]+.*(DONE|pulse|NEW)' "$build/fuzz_$target.log" | tail -1 || true
	grep -E 'stat::(number_of_executed_units|average_exec_per_sec|new_units_added|peak_rss_mb)' \
		"$build/fuzz_$target.log" | tr '\n' ' '
	echo; } >> "$report"
	return $status
}

# The targets side by side (one core each): the run takes SECONDS, not SECONDS per target.
targets=(proto config)
pids=()
for target in "${targets[@]}"; do
	fuzz_one "$target" &
	pids+=($!)
done
status=0
for i in "${!targets[@]}"; do
	wait "${pids[$i]}" || status=1
	cat "$build/fuzz_${targets[$i]}.report"
done
exit $status
