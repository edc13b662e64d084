#!/usr/bin/env bash
# The main job end to end: install what is missing, build, start zoffloadd on a temporary
# socket with built-in defaults plus a small pinned budget and a temporary swap directory,
# train the example MLP through it (its optimizer state is twice the pinned budget, so it
# spills to the swap directory; its parameters are offloaded too), then a small character-level
# GPT in PyTorch through zoffload.torch.AdamW on the same daemon, show the stats, stop.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh
install_deps demo

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
mkdir "$tmp/swap"
# Everything else stays at the built-in defaults.
cat >"$tmp/zoffload.conf" <<CONF
{
  "memory": { "pinned_budget": "16M" },
  "swap": { "paths": [ { "path": "$tmp/swap", "capacity": "512M" } ], "chunk_elements": 1048576 }
}
CONF
echo "==> starting zoffloadd on $sock (pinned budget 16 MiB, swap in $tmp/swap)"
"$build/daemon/zoffloadd" --config "$tmp/zoffload.conf" --socket "$sock" 2>"$tmp/zoffloadd.log" &
daemon_pid=$!
for _ in $(seq 100); do
	[ -S "$sock" ] && break
	kill -0 "$daemon_pid" 2>/dev/null || { cat "$tmp/zoffloadd.log"; exit 1; }
	sleep 0.05
done
sed 's/^/    /' "$tmp/zoffloadd.log"

echo "==> training the example MLP (optimizer steps in zoffloadd)"
"$build/examples/mlp_train" --socket "$sock" --offload-params "$@" >"$tmp/train.log" &
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

# The PyTorch front end: Debian's torch is installed for /usr/bin/python3, and meson built
# zoffload._zclient for it (-Dpython_interpreters).
if ls "$build"/python/zoffload/_zclient*.so >/dev/null 2>&1 &&
	/usr/bin/python3 -c 'import torch' 2>/dev/null; then
	echo "==> training a character-level GPT in PyTorch with zoffload.torch.AdamW (same daemon)"
	PYTHONPATH="$build/python" /usr/bin/python3 examples/train_gpt.py --socket "$sock"
else
	echo "==> PyTorch example skipped: /usr/bin/python3 lacks torch or the zoffload extension"
fi

kill -TERM "$daemon_pid"
wait "$daemon_pid"
daemon_pid=
echo "==> zoffloadd stopped cleanly"
