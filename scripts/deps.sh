# Sourced by demo.sh and test.sh: installs the Debian packages zoffload builds with, if missing.
ZOFFLOAD_PACKAGES="build-essential pkg-config meson ninja-build liburing-dev libnuma-dev
libjemalloc-dev libevent-dev libcjson-dev libcriterion-dev fio clang libclang-rt-14-dev
systemd"

install_deps() {
	local missing=() pkg
	for pkg in $ZOFFLOAD_PACKAGES; do
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
