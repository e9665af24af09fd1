"""Every relative link and ``#anchor`` between the repository's markdown files resolves.

The README is an entry page that sends readers into docs/ and scripts/BENCHMARKS.md by links; a page renamed or a
heading reworded would break them silently. The oracle is the file system (the target exists) and the target's own
headings, turned into anchors by GitHub's rule: the heading's text, lowercased, punctuation other than ``-`` and ``_``
dropped, each space a ``-``, and ``-1``, ``-2``, ... for repeats. Links inside code (fenced blocks, inline spans) are
not links, and links with a scheme (``https:``) are outside the repository. Costs well under a second.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[1]

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
# [text](target) or ![alt](target); the text may hold one level of brackets; an optional "title" after the target.
LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*<?([^()\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def markdown_files(root: Path = ROOT) -> list[Path]:
    """The pages a reader follows links between: the README, docs/, and the markdown beside scripts and recipes."""
    files = [root / "README.md"] if (root / "README.md").exists() else []
    for folder in ("docs", "scripts", "recipes"):
        files += sorted((root / folder).rglob("*.md"))
    return files


def fenced_blocks(text: str) -> Iterator[tuple[int, str, str]]:
    """(line number of the opening fence, info string, body) of every fenced code block."""
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        marker, info = opening.group(1), opening.group(2).strip()
        end = i + 1
        while end < len(lines) and not re.match(rf"^ {{0,3}}{marker[0]}{{{len(marker)},}}\s*$", lines[end]):
            end += 1
        yield i + 1, info, "\n".join(lines[i + 1:end])
        i = end + 1


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) outside fenced blocks, with inline code spans blanked out."""
    inside = {line for start, _, body in fenced_blocks(text) for line in range(start, start + body.count("\n") + 3)}
    for number, line in enumerate(text.split("\n"), 1):
        if number not in inside:
            yield number, CODE_SPAN.sub(lambda span: " " * len(span.group(0)), line)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its rendered text, lowercased, punctuation but ``-`` and ``_`` dropped,
    each space a ``-``."""
    text = re.sub(r"!\[[^\]]*\]\([^)]*\)", "", heading)  # images render no text
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link renders its text
    text = re.sub(r"<[^>]+>", "", text)  # HTML tags render none
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a page defines: its headings' slugs (repeats numbered as GitHub does) and ``<a name=...>``."""
    text = path.read_text(encoding="utf-8")
    seen: dict[str, int] = {}
    found: set[str] = set()
    inside = {line for start, _, body in fenced_blocks(text) for line in range(start, start + body.count("\n") + 3)}
    for number, line in enumerate(text.split("\n"), 1):
        heading = HEADING.match(line)
        if heading and number not in inside:
            slug = github_slug(heading.group(2))
            found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
        found.update(HTML_ANCHOR.findall(line))
    return found


def broken_links(files: list[Path], root: Path = ROOT) -> list[str]:
    """One line per link that does not resolve: ``file:line: target (why)``."""
    problems = []
    for path in files:
        for number, line in prose_lines(path.read_text(encoding="utf-8")):
            for match in LINK.finditer(line):
                target = match.group(2)
                if not target or SCHEME.match(target):
                    continue
                where = f"{path.relative_to(root)}:{number}: {target}"
                file_part, _, anchor = target.partition("#")
                file_part = unquote(file_part)
                dest = (root / file_part.lstrip("/")) if file_part.startswith("/") else (path.parent / file_part)
                dest = dest.resolve() if file_part else path
                if not dest.exists():
                    problems.append(f"{where} (no such file: {dest})")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    problems.append(f"{where} (no heading of {dest.name} has the anchor #{anchor})")
                elif anchor and dest.is_dir():
                    problems.append(f"{where} (an anchor on a folder)")
    return problems


def test_github_slug_by_hand() -> None:
    """Headings of these docs, slugged by hand with GitHub's rule."""
    assert github_slug("The `decent-train` command and its configs") == "the-decent-train-command-and-its-configs"
    assert github_slug("Local steps: `algorithm=diloco` and `algorithm=localsgd`") == \
        "local-steps-algorithmdiloco-and-algorithmlocalsgd"
    assert github_slug("Local steps against per-step gossip and DDP (issue 28)") == \
        "local-steps-against-per-step-gossip-and-ddp-issue-28"
    assert github_slug("A 4 Gbit/s link per worker") == "a-4-gbits-link-per-worker"
    assert github_slug("Fixed relative to decent-dp 0.2.3 (each has a test in `tests/test_defects.py`)") == \
        "fixed-relative-to-decent-dp-023-each-has-a-test-in-teststest_defectspy"
    assert github_slug("Where [the docs](docs/README.md) are") == "where-the-docs-are"
    assert github_slug("Schedules of algorithms (`phases`)") == "schedules-of-algorithms-phases"


def test_broken_links_are_reported(tmp_path: Path) -> None:
    """A page with good links, a missing file, a missing anchor, and link-like text inside code: exactly the two
    broken links are reported, with their lines."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# A page\n\n## Twice\n\n## Twice\n\n### Why: the *reasons* (1)\n")
    (tmp_path / "README.md").write_text(
        "# Top\n\n"
        "[ok](docs/page.md) [ok](docs/page.md#twice-1) [ok](#top) [ok](docs/) [web](https://example.org/x.md)\n"
        "[ok](docs/page.md#why-the-reasons-1) ![img](docs/page.md)\n"
        "[missing file](docs/gone.md) and `[in code](nowhere.md)`\n"
        "```\n[in a fence](nowhere.md)\n```\n"
        "[missing anchor](docs/page.md#twice-2)\n"
    )
    problems = broken_links(markdown_files(tmp_path), tmp_path)
    assert [problem.split(" (")[0] for problem in problems] == [
        "README.md:5: docs/gone.md", "README.md:9: docs/page.md#twice-2"]


def test_repository_links_resolve() -> None:
    files = markdown_files()
    assert ROOT / "README.md" in files and any(path.parent.name == "docs" for path in files)
    problems = broken_links(files)
    assert not problems, "links that do not resolve:\n" + "\n".join(problems)
