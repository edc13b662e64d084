#!/bin/sh
# libzclient carries no optimizer kernels: none of the kernel library's functions and no
# AVX-512 instruction.  It needs only dtype sizes and the header-only conversions (convert.h).
# Usage: no_kernels.sh LIBZCLIENT_SO LIBZKERNELS_A
set -u
so=$1
kernels=$2
command -v nm >/dev/null 2>&1 && command -v objdump >/dev/null 2>&1 || {
	echo "nm/objdump not found: skipped"; exit 77; }
[ -f "$so" ] || { echo "no such library: $so"; exit 1; }
[ -f "$kernels" ] || { echo "no such archive: $kernels"; exit 1; }

# Every function the kernel library defines (T: global text), then which of them the .so has,
# as a local or global symbol alike: the version script hides them from nm -D.
tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT
nm --defined-only "$kernels" 2>/dev/null | awk '$2 == "T" { print $3 }' | sort -u > "$tmp/kernels"
[ -s "$tmp/kernels" ] || { echo "$kernels defines no functions: wrong archive?"; exit 1; }
nm --defined-only "$so" | awk '{ print $3 }' | sort -u > "$tmp/so"
[ -s "$tmp/so" ] || { echo "$so has no symbol table: cannot check it"; exit 1; }
leaked=$(comm -12 "$tmp/kernels" "$tmp/so")
status=0
if [ -n "$leaked" ]; then
	echo "$so carries kernel-library functions:"
	printf '  %s\n' $leaked | head -20
	status=1
fi
# zmm registers appear only in AVX-512 code, which libzclient must not carry.
zmm=$(objdump -d --no-show-raw-insn "$so" | grep -c '%zmm')
if [ "$zmm" -ne 0 ]; then
	echo "$so has $zmm instructions on AVX-512 registers"
	status=1
fi
[ $status -eq 0 ] && echo "$so: no kernel functions, no AVX-512 code"
exit $status
