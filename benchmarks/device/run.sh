#!/usr/bin/env bash
# GPU machine check, one run (< 5 min on one H100): build with CUDA, CUDA tests, AVX-512 kernels, zoffload.torch on CUDA params and under FSDP2 over NCCL (python/tests/test_gpu.py), gpu_train vs GPU AdamW (plain, param offload, per-layer handoff), slot bandwidth.
#
# Usage: benchmarks/device/run.sh [BUILD_DIR]        (default build-device, wiped first)
# Writes its whole output to $OUT/zoffload-device.log when $OUT is set (the device
# runner brings $OUT back), else to /tmp/zoffload-device/zoffload-device.log.  Exit status 0 only
# when every step that ran passed; steps that cannot run here are SKIP, not FAIL.
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
build=${1:-build-device}
# Outside the build dir, which is wiped below.
logdir=${OUT:-/tmp/zoffload-device}
mkdir -p "$logdir"
log="$logdir/zoffload-device.log"
: >"$log"
exec > >(tee -a "$log") 2>&1

start_all=$SECONDS
results=()
failed=0

section() { printf '\n==== %s  (t=%ds) ====\n' "$*" $((SECONDS - start_all)); }

# run_step NAME CMD...: runs CMD with errexit off, records PASS / SKIP (77) / FAIL (rc).
run_step() {
	local name=$1 t0=$SECONDS rc=0
	shift
	set +e
	"$@"
	rc=$?
	set -e
	local verdict
	# Where nvidia-smi sees a GPU, a step that says "no GPU" is broken, not skipped.
	if [ "$rc" -eq 77 ] && [ "${gpu_required:-0}" -eq 1 ]; then
		rc=78
		echo "(exit 77 on a machine with ${ngpu} GPU(s): counted as a failure)"
	fi
	case $rc in
	0) verdict=PASS ;;
	77) verdict=SKIP ;;
	124) verdict="FAIL (timed out)"; failed=$((failed + 1)) ;;
	*) verdict="FAIL (exit $rc)"; failed=$((failed + 1)) ;;
	esac
	results+=("$(printf '%-34s %-18s %4ds' "$name" "$verdict" $((SECONDS - t0)))")
	return 0
}

summary() {
	section "summary"
	local line
	for line in "${results[@]}"; do
		echo "  $line"
	done
	echo "  total $((SECONDS - start_all))s; log: $log"
	[ -n "${daemon_log:-}" ] && [ -f "$daemon_log" ] && cp "$daemon_log" "$logdir/" 2>/dev/null || true
	[ -f "$build/meson-logs/testlog.txt" ] && cp "$build/meson-logs/testlog.txt" "$logdir/" 2>/dev/null || true
}

daemon_pid=
tmp=$(mktemp -d /tmp/zoffload-device.XXXXXX)
cleanup() {
	if [ -n "$daemon_pid" ] && kill -0 "$daemon_pid" 2>/dev/null; then
		kill -TERM "$daemon_pid" 2>/dev/null || true
		wait "$daemon_pid" 2>/dev/null || true
	fi
	rm -rf "$tmp"
}
trap cleanup EXIT

section "machine"
uname -a || true
nproc || true
if command -v nvidia-smi >/dev/null 2>&1; then
	nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv || true
	ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
else
	echo "nvidia-smi not found; the example will count the GPUs itself"
	ngpu=0
fi
gpu_required=0
[ "${ngpu:-0}" -gt 0 ] && gpu_required=1
avx512=no
grep -qw avx512f /proc/cpuinfo && avx512=yes
echo "GPUs: ${ngpu:-0}   CPU AVX-512: $avx512"
for tool in cc gcc meson ninja pkg-config python3; do
	printf '%s: %s\n' "$tool" "$(command -v "$tool" >/dev/null 2>&1 && "$tool" --version 2>&1 | head -1 || echo missing)"
done

# CUDA: the usual prefix, else wherever nvcc is on PATH.
cudadir=/usr/local/cuda
if [ ! -x "$cudadir/bin/nvcc" ] && command -v nvcc >/dev/null 2>&1; then
	cudadir=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
fi
echo "CUDA: $cudadir ($("$cudadir/bin/nvcc" --version 2>/dev/null | tail -1 || echo 'nvcc missing'))"
export PATH="$cudadir/bin:$PATH"

# A machine that cannot reach a package mirror takes the build's libraries from Debian
# packages carried beside the tree (benchmarks/device/bundle-deps.sh makes .devdeps), unpacked
# under $tmp, never over /: a library the machine already has stays the machine's.
use_bundle() {
	local debs=$1 root="$tmp/deps" f so name known
	mkdir -p "$root" "$root/missing"
	for f in "$debs"/*.deb; do dpkg -x "$f" "$root"; done
	# The .pc files name /usr: point them at the unpacked tree, and drop what only a static
	# link needs (Requires.private would want every private dependency's .pc too).
	for f in "$root"/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc "$root"/usr/share/pkgconfig/*.pc; do
		[ -f "$f" ] || continue
		sed -i -e "s|=/usr\$|=$root/usr|" -e "s|=/usr/|=$root/usr/|" \
			-e '/^Requires.private:/d' -e '/^Libs.private:/d' "$f"
	done
	# By soname (libgit2.so.1.5, libcriterion.so.3), read from each library itself, in
	# /usr/lib and, for the packages not yet merged into /usr, /lib.  ldconfig is read once:
	# grep -q on its pipe would end it early, a failure under pipefail.
	known=$(ldconfig -p)
	for so in "$root"/usr/lib/x86_64-linux-gnu/lib*.so.* "$root"/lib/x86_64-linux-gnu/lib*.so.*; do
		[ -L "$so" ] && continue
		name=$(objdump -p "$so" 2>/dev/null | awk '$1 == "SONAME" { print $2 }')
		[ -n "$name" ] || continue
		grep -q "^[[:space:]]*$name " <<<"$known" || ln -sf "$so" "$root/missing/$name"
	done
	export PATH="$PATH:$root/usr/bin"
	export PKG_CONFIG_PATH="$root/usr/lib/x86_64-linux-gnu/pkgconfig:$root/usr/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
	export LD_LIBRARY_PATH="$root/missing${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
	export LIBRARY_PATH="$root/usr/lib/x86_64-linux-gnu${LIBRARY_PATH:+:$LIBRARY_PATH}"
	# Their headers as the system's, as they are where /usr/include holds them (liburing's
	# are not -Wpedantic clean): pkg-config leaves out the -I, the compiler takes the folder
	# as -isystem.
	export PKG_CONFIG_SYSTEM_INCLUDE_PATH="$root/usr/include"
	export C_INCLUDE_PATH="$root/usr/include${C_INCLUDE_PATH:+:$C_INCLUDE_PATH}"
	echo "libraries from $debs (unpacked in $root); taken from there: $(ls "$root/missing" | tr '\n' ' ')"
}

section "dependencies"
debs=${ZOFFLOAD_DEVICE_DEBS:-$repo/.devdeps}
if [ -d "$debs" ] && compgen -G "$debs/*.deb" >/dev/null; then
	use_bundle "$debs"
else
	# No network here except perhaps the package mirrors: bounded, and a failure is not
	# fatal; the build below says what is really missing.
	install_ok=0
	# "test": Criterion too; without it the CUDA tests are not built (a FAIL below).
	timeout 150 bash -c '. scripts/deps.sh && install_deps test' || install_ok=$?
	[ "$install_ok" -eq 0 ] || echo "warning: installing missing packages failed (exit $install_ok); trying the build anyway"
fi
# NCCL where the toolkit has none: the one a pip-installed torch brings (nvidia.nccl).
if ! compgen -G "$cudadir/lib*/libnccl.so*" >/dev/null; then
	nccl_dir=$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__) if nvidia.nccl.__file__ else list(nvidia.nccl.__path__)[0])' 2>/dev/null || true)
	if [ -n "$nccl_dir" ] && [ -e "$nccl_dir/lib/libnccl.so.2" ]; then
		mkdir -p "$tmp/nccl"
		ln -sf "$nccl_dir/lib/libnccl.so.2" "$tmp/nccl/libnccl.so"
		export LIBRARY_PATH="$tmp/nccl:$nccl_dir/lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
		export LD_LIBRARY_PATH="$nccl_dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
		# As -isystem, like the toolkit's own headers: nccl.h is not -Wundef clean.
		export C_INCLUDE_PATH="$nccl_dir/include${C_INCLUDE_PATH:+:$C_INCLUDE_PATH}"
		export CPLUS_INCLUDE_PATH="$nccl_dir/include${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}"
		echo "NCCL: $nccl_dir (Python's nvidia.nccl)"
	else
		echo "NCCL: none in $cudadir, nor Python's nvidia.nccl"
	fi
fi
for tool in meson ninja pkg-config; do
	command -v "$tool" >/dev/null 2>&1 || echo "warning: $tool not found"
done

section "configure and build ($build, -Dcuda=enabled)"
rm -rf "$build"
setup_ok=0
# The Python package for the interpreter that has torch (python/tests/test_gpu.py below).
pyargs=()
torch_py=$(command -v python3 || true)
if [ -n "$torch_py" ] && "$torch_py" -c 'import torch, pytest' 2>/dev/null; then
	pyargs=(-Dpython_interpreters="$torch_py")
fi
meson setup "$build" -Dcuda=enabled -Dcudadir="$cudadir" --buildtype=release \
	${pyargs[@]+"${pyargs[@]}"} || setup_ok=$?
if [ "$setup_ok" -ne 0 ]; then
	# jemalloc is the one optional library that defaults to required.
	echo "meson setup failed; retrying without jemalloc"
	rm -rf "$build"
	setup_ok=0
	meson setup "$build" -Dcuda=enabled -Dcudadir="$cudadir" --buildtype=release \
		-Djemalloc=disabled ${pyargs[@]+"${pyargs[@]}"} || setup_ok=$?
fi
if [ "$setup_ok" -ne 0 ]; then
	tail -n 40 "$build/meson-logs/meson-log.txt" 2>/dev/null || true
	results+=("$(printf '%-34s %-18s %4ds' configure "FAIL (exit $setup_ok)" 0)")
	failed=$((failed + 1))
	summary
	exit 1
fi
# -k 0: a target that fails to build must not keep the independent ones (the CUDA
# library and its tests) from being built and run.
run_step "build" ninja -C "$build" -k 0

# test_result NAME: meson's verdict on the test whose name ends in NAME in the last run
# (OK, SKIP, FAIL...), or "absent".
test_result() {
	python3 - "$build/meson-logs/testlog.json" "$1" <<'PY'
import json, sys
result = "absent"
try:
    for line in open(sys.argv[1]):
        r = json.loads(line)
        if r.get("name", "").endswith(sys.argv[2]):
            result = r.get("result")
except OSError:
    pass
print(result)
PY
}

section "CUDA tests (meson test --suite cuda)"
# `meson test --suite cuda` with no such test (Criterion missing: tests/ is skipped) finds
# nothing and exits 0: the tests must exist before their pass means anything.
cuda_tests=$(meson test -C "$build" --no-rebuild --list --suite cuda 2>/dev/null || true)
missing=()
for t in cuda-host cuda-kernels cuda-casts-all cuda-reconnect cuda-gpu-train; do
	# "zoffload:cuda / cuda-host" (meson 1.0), "cuda - zoffload:cuda-host" (later ones).
	grep -Eq "(/ |:)$t\$" <<<"$cuda_tests" || missing+=("$t")
done
if [ ${#missing[@]} -gt 0 ]; then
	echo "CUDA tests not built: ${missing[*]} (is Criterion installed? meson setup says)"
	echo "the suite lists: ${cuda_tests:-nothing}"
	results+=("$(printf '%-34s %-18s %4ds' "tests: cuda suite built" FAIL 0)")
	failed=$((failed + 1))
else
	run_step "tests: cuda suite" timeout 240 meson test -C "$build" --no-rebuild --suite cuda \
		--print-errorlogs
	# meson counts a 77 as skipped and exits 0: with a GPU present, the kernels (and the
	# slots through a reconnect, on real registrations) must have run.
	if [ "$gpu_required" -eq 1 ]; then
		for t in cuda-kernels cuda-reconnect; do
			t_result=$(test_result "$t")
			if [ "$t_result" != OK ]; then
				echo "$t: $t_result although nvidia-smi lists ${ngpu} GPU(s)"
				results+=("$(printf '%-34s %-18s %4ds' "tests: $t OK on the GPU" \
					"FAIL ($t_result)" 0)")
				failed=$((failed + 1))
			fi
		done
	fi
fi

section "CPU kernel tests (meson test --suite kernels)"
if [ "$avx512" = yes ]; then
	run_step "tests: kernels (AVX-512 CPU)" timeout 240 meson test -C "$build" --no-rebuild \
		--suite kernels --print-errorlogs
else
	echo "this CPU has no AVX-512: the kernels suite is CI's job"
	results+=("$(printf '%-34s %-18s %4ds' "tests: kernels (AVX-512 CPU)" SKIP 0)")
fi

section "zoffload.torch on the GPU (python/tests/test_gpu.py: CUDA params, FSDP2 over NCCL)"
gpu_py=$(meson test -C "$build" --no-rebuild --list 2>/dev/null | grep -Eo 'python_gpu_[A-Za-z0-9._]+$' |
	head -1 || true)
if [ -z "$gpu_py" ]; then
	echo "no python_gpu test: no interpreter with torch and pytest (meson setup says)"
	results+=("$(printf '%-34s %-18s %4ds' "python: test_gpu" SKIP 0)")
else
	run_step "python: test_gpu" timeout 300 meson test -C "$build" --no-rebuild \
		--print-errorlogs --verbose "$gpu_py"
	# Skipped (77) is no pass where a GPU is there.
	gpu_result=$(test_result "$gpu_py")
	if [ "$gpu_required" -eq 1 ] && [ "$gpu_result" != OK ]; then
		results+=("$(printf '%-34s %-18s %4ds' "python: test_gpu ran on the GPU" \
			"FAIL ($gpu_result)" 0)")
		failed=$((failed + 1))
	fi
fi

if [ ! -x "$build/daemon/zoffloadd" ]; then
	echo "no zoffloadd was built: the example and the slot benchmark cannot run"
	results+=("$(printf '%-34s %-18s %4ds' "zoffloadd built" FAIL 0)")
	failed=$((failed + 1))
	summary
	exit 1
fi

section "zoffloadd on a temporary socket"
sock="$tmp/zoffload.sock"
daemon_log="$tmp/zoffloadd.log"
"$build/daemon/zoffloadd" --no-config --socket "$sock" 2>"$daemon_log" &
daemon_pid=$!
for _ in $(seq 200); do
	[ -S "$sock" ] && break
	kill -0 "$daemon_pid" 2>/dev/null || break
	sleep 0.05
done
sed 's/^/    /' "$daemon_log" || true
if [ ! -S "$sock" ]; then
	echo "zoffloadd did not come up"
	results+=("$(printf '%-34s %-18s %4ds' "zoffloadd start" FAIL 0)")
	failed=$((failed + 1))
	summary
	exit 1
fi
export ZOFFLOAD_SOCKET="$sock"

section "gpu_train: ZeRO-3 + AdamW in zoffloadd vs GPU-only AdamW, 50 steps"
ranks=()
ranks_label="every GPU"
if [ "${ngpu:-0}" -gt 0 ]; then
	ranks=(--ranks "$ngpu")
	ranks_label="$ngpu ranks"
fi
run_step "example: gpu_train ($ranks_label)" timeout 180 "$build/examples/gpu_train" \
	--socket "$sock" --steps 50 ${ranks[@]+"${ranks[@]}"}

# The param slots handed back to zoffloadd between steps (unpinned first, refilled by the
# step): a missing unpin leaves the GPU copying stale pages, which the comparison sees.
run_step "gpu_train --offload-params" timeout 180 "$build/examples/gpu_train" \
	--socket "$sock" --steps 50 --job gpu-offload-params --offload-params ${ranks[@]+"${ranks[@]}"}
# No check_finite: each layer's shard goes to zoffloadd from zcc_zero3_poll as its copy lands.
run_step "gpu_train --no-check-finite" timeout 180 "$build/examples/gpu_train" \
	--socket "$sock" --steps 50 --job gpu-no-check-finite --no-check-finite \
	${ranks[@]+"${ranks[@]}"}

section "bench_slots: slot H2D/D2H vs cudaMallocHost (target ratio >= 0.90)"
run_step "bench: slot bandwidth" timeout 120 "$build/benchmarks/bench_slots" --socket "$sock" \
	--size 256M --iters 20 --min-ratio 0.9

section "zoffloadd after the runs"
"$build/client/zoffctl" --socket "$sock" stats || true
kill -TERM "$daemon_pid" 2>/dev/null || true
daemon_rc=0
wait "$daemon_pid" || daemon_rc=$?
daemon_pid=
if [ "$daemon_rc" -eq 0 ]; then
	results+=("$(printf '%-34s %-18s %4ds' "zoffloadd clean stop" PASS 0)")
else
	results+=("$(printf '%-34s %-18s %4ds' "zoffloadd clean stop" "FAIL (exit $daemon_rc)" 0)")
	failed=$((failed + 1))
fi
tail -n 20 "$daemon_log" | sed 's/^/    /' || true

summary
[ "$failed" -eq 0 ]
