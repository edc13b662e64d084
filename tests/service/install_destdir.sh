#!/usr/bin/env bash
# `meson install --destdir` keeps every file under the prefix, does not overwrite an existing
# configuration, and the installed zoffctl finds the libzclient installed beside it.
# usage: install_destdir.sh BUILDDIR PREFIX BINDIR LIBDIR SYSCONFDIR MANDIR MAN_PAGES(yes|no)
set -uo pipefail

build=$1 prefix=$2 bindir=$3 libdir=$4 sysconfdir=$5 mandir=$6 man=$7
# meson gives absolute sysconfdir (/etc with --prefix=/usr) as is, relative ones under the prefix.
case $sysconfdir in /*) etc=$sysconfdir ;; *) etc=$prefix/$sysconfdir ;; esac

tmp=$(mktemp -d /tmp/zoff-install-XXXXXX)
trap 'rm -rf "$tmp"' EXIT
status=0
fail() { echo "FAIL: $*"; status=1; }

install_once() {
	meson install -C "$build" --destdir "$tmp/root" --no-rebuild >"$tmp/install.log" 2>&1 || {
		echo "FAIL: meson install:"; tail -20 "$tmp/install.log"; exit 1; }
}
install_once

# Nothing outside the prefix (and sysconfdir, when meson made it absolute).
outside=$(cd "$tmp/root" && find . -type f -o -type l | sed 's|^\.||' |
	grep -v -e "^$prefix/" -e "^$etc/" || true)
[ -z "$outside" ] || fail "installed outside $prefix: $outside"

root=$tmp/root$prefix
for f in sbin/zoffloadd "$bindir/zoffctl" "$libdir/libzclient.so.0" include/zclient.h \
    "$libdir/pkgconfig/zclient.pc" lib/systemd/system/zoffloadd.service \
    lib/sysusers.d/zoffload.conf lib/tmpfiles.d/zoffload.conf \
    share/doc/zoffload/zoffload.conf.example share/doc/zoffload/zoffloadd-nvme.conf \
    share/doc/zoffload/zoffload-hugepages.conf \
    share/doc/zoffload/zoffload.json; do
	[ -e "$root/$f" ] || fail "$prefix/$f was not installed"
done
[ -f "$tmp/root$etc/zoffload.conf" ] || fail "$etc/zoffload.conf was not installed"
if [ "$man" = yes ]; then
	for f in man8/zoffloadd.8 man1/zoffctl.1 man5/zoffload.conf.5 man3/libzclient.3; do
		[ -s "$root/$mandir/$f" ] || fail "$prefix/$mandir/$f was not installed"
	done
	# roff escapes the dot: "zoffload.\&conf".
	# grep -c reads to the end: with pipefail, grep -q leaving early can fail sed on SIGPIPE.
	sed 's/\\&//g' "$root/$mandir/man8/zoffloadd.8" | grep -c "$etc/zoffload.conf" >/dev/null ||
		fail "zoffloadd(8) does not name $etc/zoffload.conf"
fi

# The unit runs the daemon and reads the configuration where they were installed.
grep -qxF "ExecStart=$prefix/sbin/zoffloadd --config $etc/zoffload.conf" \
	"$root/lib/systemd/system/zoffloadd.service" ||
	fail "unit's ExecStart: $(grep ExecStart "$root/lib/systemd/system/zoffloadd.service")"

# The installed zoffctl loads the installed libzclient, with no help from the environment.
out=$(env -u LD_LIBRARY_PATH "$root/$bindir/zoffctl" --version 2>&1) ||
	fail "installed zoffctl does not run: $out"
lib=$(env -u LD_LIBRARY_PATH ldd "$root/$bindir/zoffctl" | sed -n 's/.*libzclient.so.0 => \([^ ]*\).*/\1/p')
[ "$(realpath "$lib" 2>/dev/null)" = "$(realpath "$root/$libdir/libzclient.so.0")" ] ||
	fail "installed zoffctl loads libzclient from '$lib', not $prefix/$libdir"

# A second install keeps the administrator's configuration.
echo '{ "log": { "level": "debug" } }' > "$tmp/root$etc/zoffload.conf"
install_once
grep -q '"debug"' "$tmp/root$etc/zoffload.conf" || fail "reinstall overwrote $etc/zoffload.conf"

[ $status -eq 0 ] && echo "ok: installed under $prefix, configuration kept, zoffctl finds libzclient"
exit $status
