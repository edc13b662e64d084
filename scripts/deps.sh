# Sourced by demo.sh, test.sh and fuzz.sh: installs the Debian packages they need, if missing.
# install_deps: what builds and runs zoffload (python3-dev: the zoffload._zclient extension for
# /usr/bin/python3; scdoc for the man pages: -Dman=auto builds without them where it is
# missing); install_deps demo: also Debian's torch, for the PyTorch example; install_deps test:
# also what the tests use (Criterion, pytest and torch, fio for the swap benchmark, clang for
# the fuzzers and the clang build, systemd-analyze for the unit, promtool, prometheus and curl
# for the metrics endpoint, python3-venv for the checkpoint test's venv in which it installs
# safetensors from PyPI, ccache, which meson uses where it finds it, for the test builds).
ZOFFLOAD_BUILD_PACKAGES="build-essential pkg-config meson ninja-build liburing-dev libnuma-dev
libjemalloc-dev libevent-dev libcjson-dev python3-dev scdoc"
ZOFFLOAD_TORCH_PACKAGES="python3-torch python3-numpy"
ZOFFLOAD_TEST_PACKAGES="libcriterion-dev fio clang libclang-rt-14-dev systemd python3-pytest
prometheus curl python3-venv ccache $ZOFFLOAD_TORCH_PACKAGES"

install_deps() {
	local missing=() pkg packages=$ZOFFLOAD_BUILD_PACKAGES
	[ "${1:-}" = test ] && packages="$packages $ZOFFLOAD_TEST_PACKAGES"
	[ "${1:-}" = demo ] && packages="$packages $ZOFFLOAD_TORCH_PACKAGES"
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
