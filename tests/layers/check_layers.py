#!/usr/bin/env python3
"""docs/architecture.md as a map that stays true.

Reads two things from it: every source file named in its file tables, and the table of
which directory may include which.  Fails (exit 1, each problem on a line) when a source
file of a layer is missing from the map, when the map names a file that is not there, when
an #include "..." crosses directories against the table, when a file includes another
directory's *_impl.h (internal to its own directory, whatever the table says), or when
daemon/'s files call one another's zd_* functions (client/'s their zci_* ones) in a circle.

Standard library only: it runs on the first python3 on PATH.
    check_layers.py SOURCE_ROOT [--print-edges]
"""
import os
import re
import sys

DOC = os.path.join("docs", "architecture.md")
# The layers' directories; a file's directory is the longest of these that holds it.
SOURCE = (".c", ".h", ".cu", ".cuh")
# Generated into the build directory by meson: anyone may include it.
GENERATED = {"build_config.h"}

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def doc_text(root):
    with open(os.path.join(root, DOC), encoding="utf-8") as f:
        return f.read()


def section(text, title):
    """The body of the '## title' section (up to the next '## ')."""
    m = re.search(r"^## " + re.escape(title) + r"\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    if m is None:
        sys.exit("%s: no '## %s' section" % (DOC, title))
    return m.group(1)


def table_rows(body):
    for line in body.splitlines():
        line = line.strip()
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        yield [c.strip() for c in line.strip("|").split("|")]


def ticked(cell):
    return re.findall(r"`([^`]+)`", cell)


def include_rules(text):
    """{dir: set of dirs it may include}, from the '## Who may include whom' table."""
    rules = {}
    for cells in table_rows(section(text, "Who may include whom")):
        dirs = ticked(cells[0])
        if len(cells) < 2 or len(dirs) != 1:
            continue
        rules[dirs[0].rstrip("/")] = {d.rstrip("/") for d in ticked(cells[1])}
    if not rules:
        sys.exit("%s: the include table has no rows" % DOC)
    return rules


def mapped_files(text):
    """The files in the first column of the '## Source files' tables."""
    out = set()
    for cells in table_rows(section(text, "Source files")):
        out.update(t for t in ticked(cells[0]) if "/" in t)
    return out


def layer_of(path, layers):
    best = None
    for d in layers:
        if path.startswith(d + "/") and "/" not in path[len(d) + 1:]:
            best = d
    return best


def sources(root, layers):
    out = []
    for d in layers:
        full = os.path.join(root, d)
        if not os.path.isdir(full):
            continue
        for name in sorted(os.listdir(full)):
            if name.endswith(SOURCE) and os.path.isfile(os.path.join(full, name)):
                out.append(d + "/" + name)
    return out


def resolve(inc, src, by_name, root):
    """The source file an include names: beside the includer first, else by name in a layer."""
    here = os.path.dirname(src)
    cand = os.path.normpath(os.path.join(here, inc))
    if os.path.isfile(os.path.join(root, cand)):
        return cand
    hits = by_name.get(os.path.basename(inc), [])
    hits = [h for h in hits if h.endswith(inc)]
    return hits[0] if len(hits) == 1 else (None if not hits else hits)


# Directories whose files must call one another without a circle, and their functions' prefix.
# client/: zci_ is libzclient's internal prefix (zclient_impl.h); the hooks it fills
# (struct zci_hooks) are how a lower file hands something up without a call back.
NO_CALL_CIRCLE = {"daemon": "zd_", "client": "zci_"}


def call_circles(root, d, prefix):
    """Circles among d's .c files, calling each other's prefix* functions (defined at column 0)."""
    defs, bodies = {}, {}
    full = os.path.join(root, d)
    for name in sorted(os.listdir(full)):
        if not name.endswith(".c"):
            continue
        with open(os.path.join(full, name), encoding="utf-8", errors="replace") as fh:
            body = re.sub(r"/\*.*?\*/", "", fh.read(), flags=re.S)
        bodies[name] = body
        for m in re.finditer(r"^(" + prefix + r"\w+)\(", body, re.M):
            defs[m.group(1)] = name
    calls = {}
    for name, body in bodies.items():
        for m in re.finditer(r"\b(" + prefix + r"\w+)\s*\(", body):
            callee = defs.get(m.group(1))
            if callee is not None and callee != name:
                calls.setdefault(name, {}).setdefault(callee, set()).add(m.group(1))
    # Tarjan's strongly connected components, iteratively.
    index, low, on, stack, out = {}, {}, set(), [], []
    for start in sorted(bodies):
        if start in index:
            continue
        work = [(start, iter(sorted(calls.get(start, {}))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(calls.get(w, {})))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    desc = []
    for comp in out:
        links = ["%s -> %s (%s)" % (a, b, " ".join(sorted(calls[a][b])))
                 for a in comp for b in sorted(calls.get(a, {})) if b in comp]
        desc.append("%s/: %s call one another in a circle: %s" % (d, ", ".join(comp),
                    "; ".join(links)))
    return desc


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "."
    text = doc_text(root)
    rules = include_rules(text)
    layers = sorted(rules)
    files = sources(root, layers)
    mapped = mapped_files(text)
    problems = []

    for f in files:
        if f not in mapped:
            problems.append("%s: not in %s's file tables" % (f, DOC))
    for f in sorted(mapped):
        if not os.path.isfile(os.path.join(root, f)):
            problems.append("%s: %s names it, but there is no such file" % (f, DOC))
    by_name = {}
    for f in files:
        by_name.setdefault(os.path.basename(f), []).append(f)
    edges = {}
    for f in files:
        me = layer_of(f, layers)
        with open(os.path.join(root, f), encoding="utf-8", errors="replace") as fh:
            body = fh.read()
        for inc in INCLUDE.findall(body):
            if inc in GENERATED:
                continue
            target = resolve(inc, f, by_name, root)
            if target is None:
                problems.append('%s: #include "%s" is no file of a layer in the map' % (f, inc))
                continue
            if isinstance(target, list):
                problems.append('%s: #include "%s" could be any of %s' % (f, inc,
                                ", ".join(target)))
                continue
            them = layer_of(target, layers)
            if them == me:
                continue
            edges.setdefault(me, set()).add(them)
            if os.path.basename(target).endswith("_impl.h"):
                problems.append('%s: includes %s, internal to %s/' % (f, target, them))
            elif them not in rules[me]:
                problems.append('%s: includes %s, but %s/ may not include %s/ (%s)' % (
                    f, target, me, them, DOC))
    for d, prefix in NO_CALL_CIRCLE.items():
        problems.extend(call_circles(root, d, prefix))
    if "--print-edges" in sys.argv:
        for d in sorted(edges):
            print("%s -> %s" % (d, " ".join(sorted(edges[d]))))
    for p in problems:
        print(p)
    if problems:
        print("%d problem(s)" % len(problems))
        return 1
    print("%d files, %d directories: every file mapped, every include allowed, no call "
          "circle in %s" % (len(files), len(layers), ", ".join(d + "/" for d in NO_CALL_CIRCLE)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
