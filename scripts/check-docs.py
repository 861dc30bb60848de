#!/usr/bin/env python3
"""Checks that README.md and docs/*.md point at things that exist.

    scripts/check-docs.py [-v]

- Every relative Markdown link or image, `[x](path)`, `[x](path#anchor)` or `[x](#anchor)`,
  resolves to an existing file (relative to the document), and its anchor to a heading of the
  target (GitHub's slugs: lower case, punctuation dropped, spaces to hyphens, `-1`, `-2` … for
  repeated headings).
- Every repository path written in backticks outside code blocks that starts with `crates/`,
  `scripts/`, `deploy/`, `config/`, `docs/`, `tests/` or `migrations/` exists (the first word of
  the span: `scripts/sandgate admin …` names `scripts/sandgate`; a `*` must match something;
  spans with a placeholder, `<…>`, `…`, `{…}` or `$…`, are skipped, and so is a path `.gitignore`
  names, which the reader makes: `deploy/.env`).
- Every `scripts/…` command in the README's ```sh / ```bash blocks (at the start of a line or
  after `$(`, `|`, `&&`, `;`) names a script that exists and is executable.

Prints each failure as `file:line: what` and exits 1 if there is one. Python 3, stdlib only.
"""
import glob
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOTS = ("crates/", "scripts/", "deploy/", "config/", "docs/", "tests/", "migrations/")
FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
COMMAND = re.compile(r"(?:^|\$\(|\||&&|;)\s*(scripts/[\w.+-]+)")


def documents():
    """README.md and every docs/*.md, as paths relative to the repository."""
    docs = sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))
    return ["README.md"] + docs


def read_lines(rel):
    with open(os.path.join(REPO, rel), encoding="utf-8") as f:
        return f.read().split("\n")


def prose_and_blocks(lines):
    """Yields (line number, text, block language or None): None outside fenced code blocks."""
    fence, lang = None, None
    for number, line in enumerate(lines, 1):
        m = FENCE.match(line)
        if m and fence is None:
            fence, lang = m.group(1), line.strip()[3:].strip().lower()
            continue
        if m and line.strip().startswith(fence) and line.strip() == fence:
            fence, lang = None, None
            continue
        yield number, line, (lang if fence else None)


def slug(heading):
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").replace("*", "")
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # keeps letters, digits, _, -, space
    return text.replace(" ", "-")


def ignored_paths():
    """The paths `.gitignore` names literally (`/deploy/.env`): files a reader makes, never committed."""
    try:
        with open(os.path.join(REPO, ".gitignore"), encoding="utf-8") as f:
            lines = f.read().split("\n")
    except FileNotFoundError:
        return set()
    return {l.strip("/") for l in lines if l.startswith("/") and not re.search(r"[*?\[]", l)}


IGNORED = ignored_paths()
_anchors = {}


def anchors(rel):
    """The anchors of a Markdown file's headings (outside code blocks)."""
    if rel not in _anchors:
        seen, found = {}, set()
        for _, line, lang in prose_and_blocks(read_lines(rel)):
            m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
            if lang is None and m:
                base = slug(m.group(1))
                n = seen.get(base, 0)
                seen[base] = n + 1
                found.add(base if n == 0 else f"{base}-{n}")
        _anchors[rel] = found
    return _anchors[rel]


def check_link(doc, target):
    """None if the link resolves, else why not."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto: …
        return None
    path, _, anchor = target.partition("#")
    rel = doc if not path else os.path.normpath(os.path.join(os.path.dirname(doc), path))
    if rel.startswith(".."):
        return f"link {target} leaves the repository"
    if not os.path.exists(os.path.join(REPO, rel)):
        return f"link {target}: {rel} does not exist"
    if anchor and rel.endswith(".md") and anchor not in anchors(rel):
        return f"link {target}: {rel} has no heading with the anchor #{anchor}"
    return None


def check_path(span):
    """None if the backticked span names no repository path or one that exists, else why not."""
    words = span.split()
    if not words or not words[0].startswith(ROOTS):
        return None
    path = words[0].rstrip(".,:;)")
    path = re.sub(r":\d+(-\d+)?$", "", path)  # file:line
    if re.search(r"[<>{}$…]", path) or path.rstrip("/") in IGNORED:
        return None
    full = os.path.join(REPO, path)
    if "*" in path or "?" in path:
        return None if glob.glob(full) else f"`{path}` matches no file"
    if not os.path.exists(full):
        return f"`{path}` does not exist"
    return None


def check_document(doc, failures):
    for number, line, lang in prose_and_blocks(read_lines(doc)):
        where = f"{doc}:{number}"
        if lang is None:
            for m in LINK.finditer(line):
                problem = check_link(doc, m.group(1))
                if problem:
                    failures.append(f"{where}: {problem}")
            for m in CODE_SPAN.finditer(line):
                problem = check_path(m.group(2).strip())
                if problem:
                    failures.append(f"{where}: {problem}")
        elif doc == "README.md" and lang in ("sh", "bash", "shell", "console"):
            for m in COMMAND.finditer(line):
                script = m.group(1)
                full = os.path.join(REPO, script)
                if not os.path.isfile(full):
                    failures.append(f"{where}: the command {script} does not exist")
                elif not os.access(full, os.X_OK):
                    failures.append(f"{where}: the command {script} is not executable")


def main():
    verbose = "-v" in sys.argv[1:]
    failures = []
    docs = documents()
    for doc in docs:
        check_document(doc, failures)
    for failure in failures:
        print(failure)
    if failures:
        print(f"check-docs: {len(failures)} broken link(s), path(s) or command(s)", file=sys.stderr)
        return 1
    if verbose:
        print(f"check-docs: {len(docs)} documents, every link, path and command resolves")
    return 0


if __name__ == "__main__":
    sys.exit(main())
