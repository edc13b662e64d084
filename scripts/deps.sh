# Sourced by demo.sh, test.sh and fuzz.sh: installs the Debian packages they need, if missing.
# install_deps: what builds and runs zoffload; install_deps test: also what the tests use
# (Criterion, fio for the swap benchmark, clang for the fuzzers and the clang build,
# systemd-analyze for the unit, python3-venv and numpy for the checkpoint test's venv in which
# it installs safetensors from PyPI).
ZOFFLOAD_BUILD_PACKAGES="build-essential pkg-config meson ninja-build liburing-dev libnuma-dev
libjemalloc-dev libevent-dev libcjson-dev"
ZOFFLOAD_TEST_PACKAGES="libcriterion-dev fio clang libclang-rt-14-dev systemd python3-venv
python3-numpy"

install_deps() {
	local missing=() pkg packages=$ZOFFLOAD_BUILD_PACKAGES
	[ "${1:-}" = test ] && packages="$packages $ZOFFLOAD_TEST_PACKAGES"
	for pkg in $packages; do
		dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" ||
			missing+=("$pkg")
	done
	[ ${#missing[@]} -eq 0 ] && return 0
	echo "==> installing: ${missing[*]}"
	local sudo=""
	[ "$(id -u)" -ne 0 ] && sudo="sudo"
	$sudo apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
		"${missing[@]}" >/dev/null
}
