#!/usr/bin/env python3
"""Finds import circles between the top-level modules of a Rust crate.

    scripts/module-cycles.py crates/sandgate-service/src [-v]

Reads every `.rs` file under the crate's `src/`, takes the paths it names (`crate::x::…`,
`super::…` resolved against the file's own module, `use crate::{a, b::c}` groups) outside
comments and `#[cfg(test)] mod tests`, and keeps the edges between top-level modules (`x` of
`src/x.rs` or `src/x/`). Prints each strongly connected group of modules (a circle) with the
files behind every edge, and exits 1 if there is one. `-v` lists every edge first.

A rough reader of Rust, not a parser: a path inside a string literal counts too, and a `//`
inside a string ends what is read of its line. Good enough to keep a crate's modules one-way.
"""
import os
import re
import sys


def module_path(rel):
    """The module path of a file relative to src/: `a/b.rs` -> [a, b], `a/mod.rs` -> [a]."""
    parts = rel[:-3].split(os.sep)
    if parts[-1] == "mod":
        parts.pop()
    if parts in (["lib"], ["main"]):
        return []
    return parts


def named_paths(text):
    """Every `crate::…` or `super::…` path the text names, with `{a, b}` groups expanded."""
    for m in re.finditer(r"\b((?:crate|super)(?:::super)*)::(\{[^}]*\}|\w+)", text, re.S):
        head, rest = m.group(1), m.group(2)
        if rest.startswith("{"):
            for part in rest[1:-1].split(","):
                part = part.strip()
                if part:
                    yield head, re.split(r"\W", part)[0]
        else:
            yield head, rest


def edges_of(src):
    edges = {}
    for root, _, files in os.walk(src):
        for name in files:
            if not name.endswith(".rs"):
                continue
            path = os.path.join(root, name)
            rel = os.path.relpath(path, src)
            here = module_path(rel)
            if not here:
                continue
            text = open(path, encoding="utf-8").read()
            cut = re.search(r"#\[cfg\(test\)\]\s*mod tests", text)
            if cut:
                text = text[: cut.start()]
            text = re.sub(r"//[^\n]*", "", text)
            top = here[0]
            targets = edges.setdefault(top, {})
            for head, first in named_paths(text):
                if head == "crate":
                    target = first
                else:
                    ups = head.count("super")
                    base = here[: len(here) - ups]
                    target = base[0] if base else first
                if target != top and target not in ("self", "super", "crate"):
                    targets.setdefault(target, set()).add(rel)
    modules = set(edges)
    return {a: {b: f for b, f in bs.items() if b in modules} for a, bs in edges.items()}


def circles(edges):
    """Tarjan's strongly connected components of more than one module."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def main():
    args = [a for a in sys.argv[1:] if a != "-v"]
    if len(args) != 1:
        sys.exit(__doc__)
    edges = edges_of(args[0])
    if "-v" in sys.argv:
        for a in sorted(edges):
            for b in sorted(edges[a]):
                print(f"{a} -> {b}   ({', '.join(sorted(edges[a][b]))})")
    found = circles(edges)
    for group in found:
        print("circle among:", ", ".join(group))
        for a in group:
            for b in sorted(set(edges[a]) & set(group)):
                print(f"  {a} -> {b}   ({', '.join(sorted(edges[a][b]))})")
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
