#!/usr/bin/env bash
# The main job end to end: install what is missing, build, start zoffloadd on a temporary
# socket with built-in defaults, train the example MLP through it, show the stats, stop.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh
install_deps

build=build-demo
[ -f "$build/build.ninja" ] || meson setup "$build" --buildtype=release >/dev/null
ninja -C "$build" >/dev/null

tmp=$(mktemp -d /tmp/zoffload-demo.XXXXXX)
daemon_pid=
cleanup() {
	if [ -n "$daemon_pid" ] && kill -0 "$daemon_pid" 2>/dev/null; then
		kill -TERM "$daemon_pid"
		wait "$daemon_pid" || true
	fi
	rm -rf "$tmp"
}
trap cleanup EXIT

sock="$tmp/zoffload.sock"
echo "==> starting zoffloadd on $sock"
"$build/daemon/zoffloadd" --no-config --socket "$sock" 2>"$tmp/zoffloadd.log" &
daemon_pid=$!
for _ in $(seq 100); do
	[ -S "$sock" ] && break
	kill -0 "$daemon_pid" 2>/dev/null || { cat "$tmp/zoffloadd.log"; exit 1; }
	sleep 0.05
done
sed 's/^/    /' "$tmp/zoffloadd.log"

echo "==> training the example MLP (optimizer steps in zoffloadd)"
"$build/examples/mlp_train" --socket "$sock" "$@" >"$tmp/train.log" &
train_pid=$!
tail -f --pid=$train_pid "$tmp/train.log" &
# A snapshot while the job is attached: its tensors and state show in the tiers.
for _ in $(seq 200); do
	grep -q "^step   10 " "$tmp/train.log" 2>/dev/null && break
	kill -0 $train_pid 2>/dev/null || break
	sleep 0.05
done
if kill -0 $train_pid 2>/dev/null; then
	"$build/client/zoffctl" --socket "$sock" stats >"$tmp/stats-during.txt" || true
fi
wait $train_pid
sleep 0.2
if [ -s "$tmp/stats-during.txt" ]; then
	echo "==> zoffctl stats, during training"
	cat "$tmp/stats-during.txt"
fi
echo "==> zoffctl stats, after training"
"$build/client/zoffctl" --socket "$sock" stats

kill -TERM "$daemon_pid"
wait "$daemon_pid"
daemon_pid=
echo "==> zoffloadd stopped cleanly"
