#!/usr/bin/env bash
# Mutation testing, for developers (not CI): small plausible bugs put into the sources one at
# a time, each built and run against the tests; a mutant the tests do not notice is a gap.
#
#   scripts/mutate.sh [OPTIONS] [BASE]        the C and Python files changed since BASE (main)
#   scripts/mutate.sh [OPTIONS] -- FILE...    these files
#
#   --max N       at most N mutants of each file are built and tested (a random sample,
#                 drawn with --seed); 0: all of them.  Default 20.
#   --seed S      the sample's seed (default 1): the same seed, the same mutants.
#   --timeout S   seconds the tests of one mutant may take (default 900); past it the
#                 mutant counts as killed (a hang), and says so.
#   --no-full     a mutant that passes the tests covering its file (scripts/mutate-map.txt)
#                 is reported as surviving them, without the whole suite after.
#   --work DIR    where the copy of the tree, its build and the mutants live
#                 (default ~/.cache/zoffload/mutate-work); kept between runs, so the next
#                 build is incremental.
#
# The mutants come from universalmutator (PyPI), installed on first use into its own venv
# (~/.cache/zoffload/mutate-venv, from /usr/bin/python3), for C and Python alike.  Nothing in
# the checkout is touched: the tree is copied to DIR/src (tracked and untracked files, not
# ignored ones) and built in DIR/build with test.sh's options; each mutant replaces its file
# there, is built incrementally and tested, and the file is put back.
#
# Skipped, and counted apart:
#   invalid     does not compile (or, with -Werror, warns), or for Python does not parse;
#   equivalent  compiles to the same object as the original (trivial compiler equivalence:
#               the file's own compile command at -O2 without debug information), or for
#               Python parses to the same syntax tree, docstrings and a `pass` beside
#               other statements left out;
#   duplicate   compiles to the same object as a mutant already tested.
# The kill rate is killed / (killed + survived).  Each survivor is printed with its diff,
# and the report is kept in DIR/report.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
top=$PWD

max=20
seed=1
timeout_s=900
full=1
work=${HOME}/.cache/zoffload/mutate-work
base=main
files=()
while [ $# -gt 0 ]; do
	case $1 in
	--max) max=$2; shift ;;
	--seed) seed=$2; shift ;;
	--timeout) timeout_s=$2; shift ;;
	--no-full) full=0 ;;
	--work) work=$2; shift ;;
	--) shift; files=("$@"); break ;;
	-h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
	-*) echo "mutate.sh: unknown option $1" >&2; exit 2 ;;
	*) base=$1 ;;
	esac
	shift
done
if [ ${#files[@]} -eq 0 ]; then
	mapfile -t files < <(git diff --name-only --diff-filter=AM "$base" -- '*.c' '*.py' |
	    grep -E '^(engine|daemon|client|tiers|kernels|proto|python/zoffload)/' || true)
fi
if [ ${#files[@]} -eq 0 ]; then
	echo "mutate.sh: no C or Python sources changed since $base" >&2
	exit 0
fi
for f in "${files[@]}"; do
	[ -f "$f" ] || { echo "mutate.sh: $f: no such file" >&2; exit 2; }
done

# The mutation tool, in a venv of its own.
venv=${HOME}/.cache/zoffload/mutate-venv
if [ ! -x "$venv/bin/mutate" ]; then
	/usr/bin/python3 -m venv "$venv"
	"$venv/bin/pip" install -q universalmutator
fi

# The copy of the tree and its build.
src=$work/src
build=$work/build
mkdir -p "$src" "$work/mutants"
git ls-files -co --exclude-standard -z | tar -C "$top" --null -T - -cf - | tar -C "$src" -xf -
# A run cut short with a mutant built: the copy has the original's older time again, so
# ninja must be told that file changed.
if [ -f "$work/dirty" ]; then
	touch "$src/$(cat "$work/dirty")"
	rm -f "$work/dirty"
fi
. scripts/pyenv.sh
if [ -z "${ZOFFLOAD_VENV:-}" ]; then
	ZOFFLOAD_VENV=$(pyenv_path 2>/dev/null || true)
fi
if [ ! -f "$build/build.ninja" ]; then
	setup=(-Dwerror=true -Dtests=enabled -Dgpu_standin=enabled)
	if [ -n "${ZOFFLOAD_VENV:-}" ] && [ -x "$ZOFFLOAD_VENV/bin/python" ]; then
		setup+=(-Dpython_require=true
		    "-Dpython_interpreters=/usr/bin/python3,$ZOFFLOAD_VENV/bin/python")
	fi
	meson setup "$build" "$src" "${setup[@]}" >"$work/setup.log" ||
	    { cat "$work/setup.log"; exit 1; }
fi
echo "mutate.sh: building the unmutated copy in $build"
ninja -C "$build" >"$work/build.log" 2>&1 || { tail -40 "$work/build.log"; exit 1; }

# The tests covering path: the longest prefix in mutate-map.txt, as meson test arguments.
tests_for() {
	local path=$1 best="" words="" prefix rest
	while read -r prefix rest; do
		case $prefix in ''|'#'*) continue ;; esac
		if [ "${path#"$prefix"}" != "$path" ] && [ ${#prefix} -gt ${#best} ]; then
			best=$prefix
			words=$rest
		fi
	done <"$top/scripts/mutate-map.txt"
	# A suite as its tests' names: meson test takes names or suites, not a union of both.
	for w in $words; do
		case $w in
		suite:*) meson test -C "$build" --no-rebuild --list --suite "${w#suite:}" 2>/dev/null |
		    sed -n 's|.* / ||p' | tr '\n' ' ' ;;
		*) printf '%s ' "$w" ;;
		esac
	done
}

# The file's compile command (compile_commands.json) at -O2 without debug information,
# writing the object to $2; empty for a file no target compiles.
tce_cmd() {
	/usr/bin/python3 - "$build" "$src/$1" "$2" <<'EOF'
import json, os, shlex, sys
build, source, out = sys.argv[1:]
for e in json.load(open(os.path.join(build, "compile_commands.json"))):
    if os.path.realpath(os.path.join(e["directory"], e["file"])) != os.path.realpath(source):
        continue
    args = shlex.split(e["command"])
    keep, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in ("-o", "-MF", "-MQ", "-MT"):
            skip = True
            continue
        if a in ("-MD", "-MMD") or a.startswith("-g") or a.startswith("-O"):
            continue
        keep.append(a)
    print("cd %s && %s -O2 -g0 -o %s" % (shlex.quote(e["directory"]), shlex.join(keep),
                                       shlex.quote(out)))
    break
EOF
}

# Python: a digest of the syntax tree (comments, layout and docstrings do not count, nor a
# `pass` beside other statements: universalmutator turns a comment line into one); fails if
# it does not parse.
py_digest() {
	/usr/bin/python3 -c 'import ast, hashlib, sys
try:
    t = ast.parse(open(sys.argv[1]).read())
except SyntaxError:
    sys.exit(1)
for n in ast.walk(t):
    body = getattr(n, "body", None)
    if (isinstance(body, list) and body and isinstance(body[0], ast.Expr) and
            isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
        body[0] = ast.Pass()
for n in ast.walk(t):
    for field in ("body", "orelse", "finalbody"):
        stmts = getattr(n, field, None)
        if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt):
            kept = [s for s in stmts if not isinstance(s, ast.Pass)]
            setattr(n, field, kept or [ast.Pass()])
print(hashlib.sha256(ast.dump(t).encode()).hexdigest())' "$1"
}

obj=$work/tce.o
report=$work/report.txt
: >"$report"
total_killed=0 total_survived=0 total_invalid=0 total_equivalent=0 total_duplicate=0
total_redundant=0 total_generated=0
survivors=()
restore_file=""
put_back() {
	if [ -n "$restore_file" ]; then
		cp "$work/original" "$src/$restore_file"
		restore_file=""
	fi
	# The original is back, but what was built may be the mutant's: the next build redoes it.
}
trap 'put_back' EXIT
trap 'put_back; exit 130' INT TERM

for f in "${files[@]}"; do
	id=$(echo "$f" | tr '/.' '__')
	mdir=$work/mutants/$id
	rm -rf "$mdir"
	mkdir -p "$mdir"
	case $f in *.py) lang=python ;; *) lang=c ;; esac
	cp "$top/$f" "$src/$f"
	cp "$src/$f" "$work/original"
	"$venv/bin/mutate" "$src/$f" "$lang" --noCheck --mutantDir "$mdir/" >"$mdir/mutate.log" 2>&1
	generated=$(ls "$mdir" | grep -c '\.mutant\.' || true)
	redundant=$(grep -c 'REDUNDANT' "$mdir/mutate.log" || true)
	total_generated=$((total_generated + generated))
	total_redundant=$((total_redundant + redundant))
	args=$(tests_for "$f")
	# The original's object (or tree): what an equivalent mutant compiles (parses) to.
	declare -A seen=()
	if [ $lang = c ]; then
		cmd=$(tce_cmd "$f" "$obj")
		[ -n "$cmd" ] || { echo "mutate.sh: $f: no compile command in $build" >&2; exit 1; }
		(eval "$cmd") >/dev/null 2>&1 || { echo "mutate.sh: $f does not compile" >&2; exit 1; }
		orig_digest=$(sha256sum "$obj" | cut -c1-64)
	else
		orig_digest=$(py_digest "$src/$f")
	fi
	echo "== $f: $generated mutants ($redundant redundant with the source, not written);" \
	    "tests: ${args:-the whole suite}" | tee -a "$report"
	killed=0 survived=0 invalid=0 equivalent=0 duplicate=0 tested=0
	while read -r m; do
		[ "$max" -gt 0 ] && [ $tested -ge "$max" ] && break
		name=$(basename "$m")
		restore_file=$f
		echo "$f" >"$work/dirty"
		cp "$m" "$src/$f"
		if [ $lang = c ]; then
			if ! (eval "$cmd") >/dev/null 2>&1; then
				invalid=$((invalid + 1)); put_back; continue
			fi
			digest=$(sha256sum "$obj" | cut -c1-64)
		else
			if ! digest=$(py_digest "$src/$f"); then
				invalid=$((invalid + 1)); put_back; continue
			fi
		fi
		if [ "$digest" = "$orig_digest" ]; then
			equivalent=$((equivalent + 1)); put_back; continue
		fi
		if [ -n "${seen[$digest]:-}" ]; then
			duplicate=$((duplicate + 1)); put_back; continue
		fi
		seen[$digest]=$name
		# -Werror: a mutant that warns does not build, and is not a mutant of the product.
		if ! timeout 1200 nice ninja -C "$build" >"$mdir/$name.build.log" 2>&1; then
			invalid=$((invalid + 1)); put_back; continue
		fi
		tested=$((tested + 1))
		start=$(date +%s)
		verdict=survived
		rc=0
		: >"$mdir/$name.test.log"
		if [ -z "$args" ]; then
			timeout "$timeout_s" nice meson test -C "$build" --no-rebuild -q --maxfail 1 \
			    >"$mdir/$name.test.log" 2>&1 || rc=$?
		fi
		# One at a time: the first failing test decides, the rest need not run (meson's
		# --maxfail still starts the next test after a timeout).
		for t in $args; do
			left=$((timeout_s - ($(date +%s) - start)))
			[ $left -gt 0 ] || { rc=124; break; }
			timeout "$left" nice meson test -C "$build" --no-rebuild -q "$t" \
			    >>"$mdir/$name.test.log" 2>&1 || rc=$?
			[ $rc -eq 0 ] || break
		done
		if [ $rc -eq 124 ]; then
			verdict="killed (a hang: past --timeout)"
		elif [ $rc -ne 0 ]; then
			verdict=killed
		elif [ -n "$args" ] && [ $full -eq 1 ] && ! timeout "$timeout_s" nice meson test \
		    -C "$build" --no-rebuild -q --maxfail 1 >"$mdir/$name.full.log" 2>&1; then
			verdict="killed by the whole suite"
		fi
		took=$(( $(date +%s) - start ))
		if [ "$verdict" = survived ]; then
			survived=$((survived + 1))
			survivors+=("$f $name")
			{
				echo "SURVIVED $f $name (${took} s)$([ $full -eq 0 ] && echo ", tests of the map only")"
				diff -u --label "a/$f" --label "b/$f" "$work/original" "$m" || true
			} | tee -a "$report"
		else
			killed=$((killed + 1))
			echo "killed $f $name: $verdict (${took} s)" | tee -a "$report"
		fi
		put_back
	done < <(ls "$mdir"/*.mutant.* 2>/dev/null | shuf --random-source=<(yes "$seed"))
	echo "   $f: tested $tested, killed $killed, survived $survived; skipped $invalid" \
	    "invalid, $equivalent equivalent (same object), $duplicate duplicate" | tee -a "$report"
	total_killed=$((total_killed + killed))
	total_survived=$((total_survived + survived))
	total_invalid=$((total_invalid + invalid))
	total_equivalent=$((total_equivalent + equivalent))
	total_duplicate=$((total_duplicate + duplicate))
	unset seen
done
# The copy built from the original again, for the next run.
ninja -C "$build" >"$work/build.log" 2>&1 || true

n=$((total_killed + total_survived))
{
	echo
	echo "mutants generated: $total_generated (and $total_redundant redundant with the source)"
	echo "skipped: $total_invalid invalid, $total_equivalent equivalent, $total_duplicate duplicate"
	if [ $n -gt 0 ]; then
		echo "killed $total_killed of $n: $(awk -v k=$total_killed -v n=$n \
		    'BEGIN { printf "%.1f", 100 * k / n }')%"
	else
		echo "no mutant was tested"
	fi
	for s in "${survivors[@]}"; do echo "survivor: $s"; done
} | tee -a "$report"
