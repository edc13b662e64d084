#!/usr/bin/env bash
# The built systemd unit passes `systemd-analyze verify` and keeps the hardening the daemon is meant to run under.
# The example NVMe drop-in (contrib/) verifies on top of it, every directive uncommented.
# usage: unit_verify.sh BUILT_UNIT DAEMON_BINARY DROP_IN [BUILT_MAN_DIR]
# With the man pages built, verify checks Documentation=man:zoffloadd(8) against them;
# without (no scdoc) it runs with --man=no and says so.  Exit 77 (skipped) where
# systemd-analyze cannot run.
set -uo pipefail

unit=$1
daemon=$(realpath "$2")
dropin=$3
mandir=${4:-}
command -v systemd-analyze >/dev/null || { echo "no systemd-analyze: skipped"; exit 77; }
[ -f "$unit" ] || { echo "FAIL: $unit is not built"; exit 1; }

tmp=$(mktemp -d /tmp/zoff-unit-XXXXXX)
trap 'rm -rf "$tmp"' EXIT

man_opt=--man=no
if [ -n "$mandir" ] && [ -f "$mandir/zoffloadd.8" ]; then
	mkdir -p "$tmp/man/man8"
	cp "$mandir/zoffloadd.8" "$tmp/man/man8/"
	export MANPATH=$tmp/man
	man_opt=--man=yes
else
	echo "note: man pages not built (no scdoc): verifying with --man=no"
fi

# verify checks that ExecStart= exists; the unit names the installed path, so point it at the build.
sed "s|^ExecStart=[^ ]*|ExecStart=$daemon|" "$unit" > "$tmp/zoffloadd.service"

# Output worth failing on: anything but the sysusers user and group not existing on this machine.
verify() {
	local out rc
	out=$(systemd-analyze verify "$man_opt" "$1" 2>&1)
	rc=$?
	out=$(printf '%s\n' "$out" | grep -v -E \
	    "(user|group|User|Group).*'?zoffload'?.*(not found|does not exist|No such|unknown|Unknown)|Failed to resolve (user|group) .?zoffload" |
	    grep -v '^$')
	printf '%s' "$out"
	[ $rc -eq 0 ] && [ -z "$out" ]
}

# A known-good unit first: if even that does not verify, this container cannot run the tool.
printf '[Unit]\nDescription=control\n[Service]\nType=simple\nExecStart=/bin/true\n' > "$tmp/control.service"
if ! msg=$(verify "$tmp/control.service"); then
	echo "systemd-analyze verify does not work here: skipped"
	printf '%s\n' "$msg"
	exit 77
fi
# And a broken one, so a filter that hides everything cannot pass.
printf '[Service]\nExecStart=/bin/true\nProtectSytem=strict\nNoNewPrivileges=maybe\n' > "$tmp/broken.service"
if verify "$tmp/broken.service" >/dev/null; then
	echo "FAIL: a unit with a misspelt key and a bad boolean verified clean"
	exit 1
fi

status=0
if ! msg=$(verify "$tmp/zoffloadd.service"); then
	echo "FAIL: systemd-analyze verify $unit:"
	printf '%s\n' "$msg"
	status=1
fi

# The drop-in admins copy, with its optional directives on, appended as a second [Service].
{ cat "$tmp/zoffloadd.service"; echo
  sed -E 's/^#((PrivateDevices|DevicePolicy|DeviceAllow|RestrictAddressFamilies)=)/\1/' "$dropin" |
	grep -v '^#'; } > "$tmp/zoffloadd-dropin.service"
if ! grep -q '^DeviceAllow=' "$tmp/zoffloadd-dropin.service"; then
	echo "FAIL: $dropin has no DeviceAllow= example"
	status=1
elif ! msg=$(verify "$tmp/zoffloadd-dropin.service"); then
	echo "FAIL: systemd-analyze verify with $dropin:"
	printf '%s\n' "$msg"
	status=1
fi

# What the daemon needs from its unit, and the hardening it is meant to run under.
for line in 'Type=notify' 'NoNewPrivileges=yes' 'ProtectSystem=strict' 'PrivateTmp=yes' \
    'RestrictAddressFamilies=AF_UNIX' 'SystemCallArchitectures=native' 'LimitMEMLOCK=infinity' \
    'ReadWritePaths=/var/lib/zoffload' 'RuntimeDirectory=zoffload' 'ExecReload=/bin/kill -HUP $MAINPID' \
    'Restart=on-failure' 'FileDescriptorStoreMax=65536'; do
	if ! grep -qxF "$line" "$unit"; then
		echo "FAIL: $unit lacks '$line'"
		status=1
	fi
done
# Nothing may take away what the daemon uses: io_uring, memfd, mlock, its socket.
for bad in '^SystemCallFilter=.*(@io-uring|io_uring|memfd|mlock)' '^LimitMEMLOCK=[0-9]' \
    '^RestrictFileSystems='; do
	if grep -qE "$bad" "$unit"; then
		echo "FAIL: $unit has '$(grep -E "$bad" "$unit")', which the daemon cannot run under"
		status=1
	fi
done

if systemd-analyze security --help 2>/dev/null | grep -q -- '--offline'; then
	systemd-analyze security --offline=true "$tmp/zoffloadd.service" 2>/dev/null | tail -1
fi
[ $status -eq 0 ] && echo "ok: $unit verifies ($man_opt), with the drop-in too"
exit $status
