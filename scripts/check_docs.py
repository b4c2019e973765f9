#!/usr/bin/env python3
"""Checks that every relative link in the project's markdown resolves: the file it names
exists, and an anchor (#section) names a heading of that file, spelled as GitHub spells it.
  python3 scripts/check_docs.py        exit 1 listing each broken link
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def prose_lines(path):
    """The lines outside fenced code blocks: a link in an example is not a link."""
    fenced = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            yield number, line


def github_anchor(heading):
    """GitHub's slug: lower case, inline code marks and punctuation dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors_of(path, cache={}):
    if path not in cache:
        seen, anchors = {}, set()
        for _, line in prose_lines(path):
            match = re.match(r"#{1,6}\s+(.*)", line)
            if match:
                slug = github_anchor(match.group(1))
                count = seen.get(slug, 0)
                seen[slug] = count + 1
                anchors.add(slug if count == 0 else f"{slug}-{count}")
        cache[path] = anchors
    return cache[path]


def broken_links(path):
    for number, line in prose_lines(path):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not checked offline
            file_part, _, anchor = target.partition("#")
            resolved = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(ROOT)}:{number}: {target}"
            if not resolved.exists():
                yield f"{where}: no such file"
            elif anchor and resolved.suffix == ".md" and anchor not in anchors_of(resolved):
                yield f"{where}: no heading with the anchor #{anchor} in {resolved.relative_to(ROOT)}"


def main():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted(p for d in ("bench", "examples", "tests", "python") for p in (ROOT / d).rglob("*.md"))]
    problems = [problem for f in files for problem in broken_links(f)]
    for problem in problems:
        print(problem)
    print(f"check_docs: {len(files)} files, {len(problems)} broken links")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
