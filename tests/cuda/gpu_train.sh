#!/usr/bin/env bash
# examples/gpu_train (and a bench_slots pass) against a real zoffloadd on a temporary socket.
# Usage: gpu_train.sh ZOFFLOADD GPU_TRAIN BENCH_SLOTS standin|gpu
#   standin: 1 and 2 ranks on the CUDA stand-in, held bit for bit to the GPU-only AdamW (--exact),
#            2 again with pageable param slots, then bench_slots through the registered slots (figures meaningless, the path is not);
#   gpu:     1 rank on the real runtime, within bf16 tolerance (exits 77 without a GPU).
set -euo pipefail
zoffloadd=$1 gpu_train=$2 bench_slots=$3 mode=$4

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
"$zoffloadd" --no-config --socket "$sock" 2>"$tmp/zoffloadd.log" &
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
	run "ratio" "$bench_slots" --socket "$sock" --size 1M --iters 2 --min-ratio 0
else
	run "agree within bf16 tolerance" "$gpu_train" --socket "$sock" --ranks 1 "${small[@]}"
fi
