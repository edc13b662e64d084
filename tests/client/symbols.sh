#!/bin/sh
# libzclient's exported symbols: every function zclient.h declares, nothing else, the names
# listed under ZCLIENT_0.1 in zclient.map at that version (frozen), the rest at a later one.
# Usage: symbols.sh LIBZCLIENT_SO ZCLIENT_H ZCLIENT_MAP
set -u
so=$1
header=$2
map=$3
command -v nm >/dev/null 2>&1 || { echo "nm not found: skipped"; exit 77; }
tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT
status=0

nm -D --defined-only "$so" | awk '$2 == "T" { print $3 }' | sort > "$tmp/exported"
[ -s "$tmp/exported" ] || { echo "$so exports no functions"; exit 1; }
# Declarations: "ZC_API <type> [*]name(" possibly across the type's words.
grep -v '^#' "$header" | grep -o 'ZC_API[^(]*(' | sed 's/($//; s/.*[ *]//' | sort -u > "$tmp/declared"
sed 's/@.*//' "$tmp/exported" | sort -u > "$tmp/names"
missing=$(comm -23 "$tmp/declared" "$tmp/names")
extra=$(comm -13 "$tmp/declared" "$tmp/names")
[ -z "$missing" ] || { echo "declared in zclient.h, not exported:" $missing; status=1; }
[ -z "$extra" ] || { echo "exported, not declared in zclient.h:" $extra; status=1; }

# The frozen node: the names between "ZCLIENT_0.1 {" and its "};".
sed -n '/^ZCLIENT_0\.1 {/,/^}/p' "$map" | sed -n 's/^[[:space:]]*\(zc_[a-z0-9_]*\);$/\1/p' |
    sort > "$tmp/v01"
[ -s "$tmp/v01" ] || { echo "$map lists no ZCLIENT_0.1 names"; exit 1; }
# A 0.1 function whose argument struct grew keeps its 0.1 behaviour as the non-default
# name@ZCLIENT_0.1 beside a newer default name@@ZCLIENT_0.x (zc_job_open_opts).
while read -r name; do
	grep -qx "$name@@ZCLIENT_0.1" "$tmp/exported" && continue
	grep -qx "$name@ZCLIENT_0.1" "$tmp/exported" &&
	    grep -q "^$name@@ZCLIENT_0\.[0-9]*$" "$tmp/exported" && continue
	echo "$name is not exported as ZCLIENT_0.1: $(grep "^$name@" "$tmp/exported")"
	status=1
done < "$tmp/v01"
while read -r sym; do
	name=${sym%%@*}
	grep -qx "$name" "$tmp/v01" && continue
	case $sym in
	*@@ZCLIENT_0.1) echo "$name is new but versioned ZCLIENT_0.1"; status=1 ;;
	*@@ZCLIENT_*) ;;
	*) echo "$sym has no ZCLIENT version"; status=1 ;;
	esac
done < "$tmp/exported"
[ $status -eq 0 ] && echo "$(wc -l < "$tmp/exported") symbols, $(wc -l < "$tmp/v01") of them ZCLIENT_0.1"
exit $status
