#!/usr/bin/env bash
# examples/gpu_train (and a bench_slots pass) against a real zoffloadd on a temporary socket.
# Usage: gpu_train.sh ZOFFLOADD GPU_TRAIN BENCH_SLOTS standin|gpu [LIBCUDA_STANDIN]
#   standin: 1 and 2 ranks on the CUDA stand-in, held bit for bit to the GPU-only AdamW (--exact),
#            2 again with pageable param slots, with param offload (slots released between
#            steps), and without check_finite at both extremes of cudaEventQuery (every shard
#            handed over during backward, or none), then bench_slots through the registered
#            slots (figures meaningless, the path is not).  zoffloadd runs with the stand-in
#            preloaded, so its hole punches in slots still registered by a rank are seen;
#   gpu:     1 rank on the real runtime, within bf16 tolerance, plain, with param offload and
#            without check_finite (exits 77 without a GPU).
set -euo pipefail
zoffloadd=$1 gpu_train=$2 bench_slots=$3 mode=$4 standin_lib=${5:-}

tmp=$(mktemp -d "${TMPDIR:-/tmp}/zoffload-gpu-train.XXXXXX")
pid=
cleanup() {
	if [ -n "$pid" ]; then
		kill -TERM "$pid" 2>/dev/null || true
		wait "$pid" 2>/dev/null || true
	fi
	rm -rf "$tmp"
}
trap cleanup EXIT

sock="$tmp/sock"
preload=
if [ "$mode" = standin ]; then
	# Every registration is published here; zoffloadd's fallocate (the stand-in's) marks the
	# ones it punches, and the rank dies at its next copy through them (tests/cuda_standin/pins.c).
	export ZS_CUDA_PINS="$tmp/pins"
	mkdir "$ZS_CUDA_PINS"
	preload=$standin_lib
	# Under ASan its runtime must come first.
	asan=$(ldd "$zoffloadd" | awk '/libasan/ { print $3 }')
	[ -z "$asan" ] || preload="$asan:$preload"
fi
LD_PRELOAD=$preload "$zoffloadd" --no-config --socket "$sock" 2>"$tmp/zoffloadd.log" &
pid=$!
for _ in $(seq 200); do
	[ -S "$sock" ] && break
	kill -0 "$pid" 2>/dev/null || break
	sleep 0.05
done
if [ ! -S "$sock" ]; then
	echo "zoffloadd did not come up:" >&2
	cat "$tmp/zoffloadd.log" >&2
	exit 1
fi

# run NAME CMD...: CMD must exit 0 (77 passes through as a skip) and print EXPECT.
run() {
	local expect=$1 rc=0
	shift
	echo "+ $*"
	"$@" >"$tmp/out" 2>&1 || rc=$?
	cat "$tmp/out"
	[ "$rc" -eq 77 ] && exit 77
	if [ "$rc" -ne 0 ]; then
		echo "FAIL: exit $rc" >&2
		exit 1
	fi
	if ! grep -q "$expect" "$tmp/out"; then
		echo "FAIL: no '$expect' in the output" >&2
		exit 1
	fi
}

# expect_count N TEXT: the last run's output says TEXT N times (once per rank).
expect_count() {
	local got
	got=$(grep -cF "$2" "$tmp/out" || true)
	if [ "$got" -ne "$1" ]; then
		echo "FAIL: '$2' $got times, not $1" >&2
		exit 1
	fi
}

small=(--steps 12 --hidden 64 --batch 16)
if [ "$mode" = standin ]; then
	for ranks in 1 2; do
		run "agree bit for bit" "$gpu_train" --socket "$sock" --ranks "$ranks" --job "gt-$ranks" \
			--exact "${small[@]}"
		# Every rank says so, not only the first.
		[ "$(grep -c 'agree bit for bit' "$tmp/out")" -eq "$ranks" ] || { echo "FAIL: not every rank agreed" >&2; exit 1; }
	done
	# A device that cannot register read-only memory: the param slots stay pageable.
	run "agree bit for bit" env ZS_CUDA_NO_READONLY_REGISTER=1 "$gpu_train" --socket "$sock" \
		--ranks 2 --job gt-pageable --exact "${small[@]}"
	# Param offload: released after every step but the last; the unpin hook lets go first.
	run "agree bit for bit" "$gpu_train" --socket "$sock" --ranks 2 --job gt-offload \
		--offload-params --exact "${small[@]}"
	expect_count 2 "param slots released 11 times each, 0 of 3 still pinned"
	# No check_finite: each layer's shard goes to the daemon from zcc_zero3_poll as it lands.
	# How many do depends only on the stand-in's query answers: all at 0, none at never.
	for pending in 0 1 never; do
		case $pending in 0) early=36 ;; 1) early=24 ;; never) early=0 ;; esac
		run "agree bit for bit" env ZS_CUDA_QUERY_PENDING=$pending "$gpu_train" --socket \
			"$sock" --ranks 2 --job "gt-nocheck-$pending" --no-check-finite --exact \
			"${small[@]}"
		expect_count 2 "$early of 36 layer shards handed to zoffloadd during backward"
	done
	run "agree bit for bit" env ZS_CUDA_QUERY_PENDING=never "$gpu_train" --socket "$sock" \
		--ranks 1 --job gt-both --offload-params --no-check-finite --exact "${small[@]}"
	run "ratio" "$bench_slots" --socket "$sock" --size 1M --iters 2 --min-ratio 0
else
	run "agree within bf16 tolerance" "$gpu_train" --socket "$sock" --ranks 1 "${small[@]}"
	run "agree within bf16 tolerance" "$gpu_train" --socket "$sock" --ranks 1 --job gt-offload \
		--offload-params "${small[@]}"
	run "agree within bf16 tolerance" "$gpu_train" --socket "$sock" --ranks 1 --job gt-nocheck \
		--no-check-finite "${small[@]}"
fi
