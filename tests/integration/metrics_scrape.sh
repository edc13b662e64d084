#!/usr/bin/env bash
# zoffloadd's metrics endpoint: the exposition passes `promtool check metrics`, a Unix-socket
# endpoint answers curl, and a real Prometheus scrapes the TCP endpoint and answers a query
# with the figure zoffctl stats shows.
# Every query of the Grafana dashboard (contrib/grafana/zoffload.json) is valid PromQL there.
# usage: metrics_scrape.sh ZOFFLOADD ZOFFCTL MLP_TRAIN DASHBOARD_JSON.  Exit 77 (skipped) without promtool,
# prometheus or curl.
set -uo pipefail

zoffloadd=$(realpath "$1")
zoffctl=$(realpath "$2")
mlp_train=$(realpath "$3")
dashboard=$(realpath "$4")
for tool in promtool prometheus curl; do
	command -v $tool >/dev/null || { echo "no $tool: skipped (Debian packages prometheus, curl)"; exit 77; }
done

tmp=$(mktemp -d /tmp/zoff-metrics-XXXXXX)
daemon_pid="" prom_pid=""
cleanup() {
	[ -n "$prom_pid" ] && kill "$prom_pid" 2>/dev/null && wait "$prom_pid" 2>/dev/null
	[ -n "$daemon_pid" ] && kill "$daemon_pid" 2>/dev/null && wait "$daemon_pid" 2>/dev/null
	rm -rf "$tmp"
}
trap cleanup EXIT
fail() {
	echo "FAIL: $*"
	for f in "$tmp"/daemon.log "$tmp"/prometheus.log; do
		[ -f "$f" ] && { echo "--- $f"; tail -30 "$f"; }
	done
	exit 1
}

# Bounded wait for a condition (a command), polling every 0.2 s.
wait_for() {
	local what=$1 limit=$2
	shift 2
	for _ in $(seq $((limit * 5))); do
		"$@" && return 0
		sleep 0.2
	done
	fail "$what did not happen within ${limit} s"
}

start_daemon() {
	cat > "$tmp/zoffload.conf" <<CONF
{ "socket": { "path": "$tmp/zoffload.sock" },
  "memory": { "pinned_budget": "4M" },
  "compute": { "worker_threads": 2 },
  "swap": { "paths": [ { "path": "$tmp", "capacity": "64M" } ] },
  "metrics": { "listen": "$1" } }
CONF
	: > "$tmp/daemon.log"
	"$zoffloadd" --config "$tmp/zoffload.conf" >"$tmp/daemon.log" 2>&1 &
	daemon_pid=$!
	wait_for "zoffloadd serving metrics" 20 grep -q "metrics: serving" "$tmp/daemon.log"
	wait_for "zoffloadd listening" 20 test -S "$tmp/zoffload.sock"
}

stop_daemon() {
	kill "$daemon_pid"
	wait "$daemon_pid" || fail "zoffloadd exited $? on SIGTERM"
	daemon_pid=""
}

# 1. Unix socket: curl gets /metrics, promtool finds nothing to say, other paths are 404.
start_daemon "unix:$tmp/metrics.sock"
"$mlp_train" --socket "$tmp/zoffload.sock" --steps 3 >"$tmp/train.log" 2>&1 ||
	fail "mlp_train: $(tail -3 "$tmp/train.log")"
curl -sS --fail --max-time 10 --unix-socket "$tmp/metrics.sock" http://localhost/metrics \
	> "$tmp/metrics.txt" || fail "GET /metrics on the Unix socket"
out=$(promtool check metrics < "$tmp/metrics.txt" 2>&1) ||
	fail "promtool check metrics: $out"
[ -z "$out" ] || fail "promtool check metrics has remarks: $out"
grep -q '^zoffload_step_batches_total{status="applied"} 3$' "$tmp/metrics.txt" ||
	fail "3 applied steps not in the exposition: $(grep batches_total "$tmp/metrics.txt")"
grep -q '^zoffload_step_latency_seconds_count 3$' "$tmp/metrics.txt" ||
	fail "latency histogram does not count 3 steps"
# Buckets are cumulative: never falling, the +Inf one equal to the count.
awk '/^zoffload_step_latency_seconds_bucket/ { v = $NF + 0; if (v < prev) bad = 1; prev = v; last = v }
	/^zoffload_step_latency_seconds_count/ { count = $NF + 0 }
	END { exit !(bad == 0 && last == count && count > 0) }' "$tmp/metrics.txt" ||
	fail "latency buckets not cumulative: $(grep latency_seconds "$tmp/metrics.txt")"
grep -q "^zoffload_swap_path_capacity_bytes{path=\"$tmp\"} 67108864$" "$tmp/metrics.txt" ||
	fail "swap path capacity missing"
code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 10 --unix-socket "$tmp/metrics.sock" \
	http://localhost/other)
[ "$code" = 404 ] || fail "GET /other answered $code, not 404"
code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 10 -X POST \
	--unix-socket "$tmp/metrics.sock" http://localhost/metrics)
[ "$code" = 405 ] || fail "POST /metrics answered $code, not 405"
stop_daemon
[ ! -e "$tmp/metrics.sock" ] || fail "the metrics socket was left behind"
echo "ok: Unix-socket endpoint, promtool check metrics clean"

# 2. TCP on a loopback port the daemon picks; a real Prometheus scrapes it.
rm -f "$tmp/zoffload.sock"
start_daemon "127.0.0.1:0"
port=$(sed -n 's|.*metrics: serving http://127.0.0.1:\([0-9]*\)/metrics.*|\1|p' "$tmp/daemon.log")
[ -n "$port" ] || fail "no port in the daemon's log"
"$mlp_train" --socket "$tmp/zoffload.sock" --steps 4 >"$tmp/train.log" 2>&1 ||
	fail "mlp_train: $(tail -3 "$tmp/train.log")"
applied=$("$zoffctl" --socket "$tmp/zoffload.sock" stats --json |
	sed -n 's/.*"steps":{"applied":\([0-9]*\).*/\1/p')
[ "$applied" = 4 ] || fail "zoffctl stats says $applied steps applied, not 4"

cat > "$tmp/prometheus.yml" <<CONF
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: zoffload
    static_configs:
      - targets: ['127.0.0.1:$port']
CONF
promtool check config "$tmp/prometheus.yml" >/dev/null 2>&1 || fail "prometheus.yml does not check"
# A free port for Prometheus's own API: bind 0, read it back, let go.
prom_port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
prometheus --config.file="$tmp/prometheus.yml" --storage.tsdb.path="$tmp/tsdb" \
	--web.listen-address="127.0.0.1:$prom_port" >"$tmp/prometheus.log" 2>&1 &
prom_pid=$!

query() {
	curl -sS --max-time 5 "http://127.0.0.1:$prom_port/api/v1/query" \
		--data-urlencode 'query=zoffload_step_batches_total{status="applied"}' 2>/dev/null
}
answered() {
	query | grep -q "\"value\":\[[0-9.]*,\"$applied\"\]"
}
wait_for "Prometheus answering zoffload_step_batches_total = $applied" 60 answered
up=$(curl -sS --max-time 5 "http://127.0.0.1:$prom_port/api/v1/query" --data-urlencode 'query=up{job="zoffload"}')
echo "$up" | grep -q '"value":\[[0-9.]*,"1"\]' || fail "up{job=\"zoffload\"} is not 1: $up"
echo "ok: Prometheus scraped 127.0.0.1:$port and answers: $(query)"

# The dashboard's queries, with Grafana's variables filled in, against this Prometheus.
python3 - "$dashboard" "$prom_port" <<'PY' || fail "dashboard queries"
import json, sys, urllib.parse, urllib.request
dash = json.load(open(sys.argv[1]))
bad = 0
for panel in dash["panels"]:
    for t in panel["targets"]:
        expr = t["expr"].replace("$instance", ".*").replace("$__rate_interval", "1m")
        url = "http://127.0.0.1:%s/api/v1/query?%s" % (sys.argv[2], urllib.parse.urlencode({"query": expr}))
        try:
            r = json.load(urllib.request.urlopen(url, timeout=5))
        except Exception as e:
            r = {"status": "error", "error": str(e)}
        if r.get("status") != "success":
            print("panel %r: %s: %s" % (panel["title"], expr, r.get("error")))
            bad += 1
sys.exit(1 if bad else 0)
PY
echo "ok: every dashboard query is valid PromQL over these metrics"
stop_daemon
exit 0
