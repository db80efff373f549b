"""The manual's links hold: every relative link and image of every markdown file of the repository
(README.md, docs/) names a file that exists, and every ``#anchor`` names a heading of its target
as GitHub renders it. README.md stays a front page: at most 25,000 bytes, its first section the
Quickstart with its two one-line commands. No network, no server: the files are only read."""

from __future__ import annotations

import os
import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Folders that hold no markdown of the project's own.
SKIP_DIRS = {".git", ".venv", "venv", "node_modules", "__pycache__", ".pytest_cache", ".ruff_cache",
             ".hypothesis", "build", "dist"}
SKIP_PATHS = {ROOT / "tests" / "artifacts"}
README_MAX_BYTES = 25_000
SHELL_INFO = {"sh", "shell", "bash"}
#: Files that live outside the repository: the manual must not send a reader to them.
OUTSIDE = re.compile(r"\b(?:API|DESIGN|STYLE)\.md\b|shared/spec|office-scheduler")

FENCE = re.compile(r"^\s*(`{3,}|~{3,})(.*)$")
HEADING = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
CODE_SPAN = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)", re.S)
#: [text](dest "title") and ![alt](dest); the text may hold one level of brackets.
INLINE_LINK = re.compile(r"(!?)\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^\s()]*)(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)", re.M)
HTML_LINK = re.compile(r"<(a|img)\b[^>]*?\b(href|src)=\"([^\"]*)\"", re.I)
HTML_ID = re.compile(r"<[a-z]+\b[^>]*?\b(?:id|name)=\"([^\"]*)\"", re.I)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^//")


def markdown_files(root: Path = ROOT) -> list[Path]:
    found = []
    for folder, dirs, files in os.walk(root):
        here = Path(folder)
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")
                         and here / d not in SKIP_PATHS)
        found += [here / f for f in sorted(files) if f.endswith(".md")]
    return found


class Markdown:
    """What the checks need of one file: headings, fenced blocks, and the prose between them
    (paragraphs with their first line number), all outside code blocks."""

    def __init__(self, text: str):
        self.headings: list[tuple[int, str, int]] = []          # (level, text, line number)
        self.fences: list[tuple[str, list[str], int]] = []      # (info string, lines, line number)
        self.paragraphs: list[tuple[str, int]] = []
        fence, info, body, start, para, para_start = None, "", [], 0, [], 0
        for number, line in enumerate(text.split("\n"), 1):
            m = FENCE.match(line)
            if fence is None and m:
                fence, info, body, start = m.group(1), m.group(2).strip(), [], number
                continue
            if fence is not None:
                if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not m.group(2).strip():
                    self.fences.append((info, body, start))
                    fence = None
                else:
                    body.append(line)
                continue
            h = HEADING.match(line)
            if h:
                self.headings.append((len(h.group(1)), (h.group(2) or "").strip(), number))
            if not line.strip() or h:
                if para:
                    self.paragraphs.append(("\n".join(para), para_start))
                para = []
                if h:
                    self.paragraphs.append((line, number))
                continue
            if not para:
                para_start = number
            para.append(line)
        if para:
            self.paragraphs.append(("\n".join(para), para_start))

    def anchors(self) -> set[str]:
        """Every anchor GitHub makes for this file: heading slugs (a repeat gets -1, -2, ...) and
        the ids of HTML elements."""
        seen: dict[str, int] = {}
        found = set()
        for _, text, _ in self.headings:
            base = slug(text)
            if base in seen:
                seen[base] += 1
                found.add(f"{base}-{seen[base]}")
            else:
                seen[base] = 0
                found.add(base)
        for text, _ in self.paragraphs:
            found.update(HTML_ID.findall(text))
        return found

    def links(self) -> list[tuple[str, bool, int]]:
        """(destination, is an image, line number) of every link outside code."""
        found = []
        for text, start in self.paragraphs:
            prose = CODE_SPAN.sub(lambda m: "code" + "\n" * m.group(0).count("\n"), text)
            for m in INLINE_LINK.finditer(prose):
                found.append((m.group(2).strip("<>"), m.group(1) == "!", start + prose.count("\n", 0, m.start())))
            for m in REFERENCE_DEF.finditer(prose):
                found.append((m.group(1).strip("<>"), False, start + prose.count("\n", 0, m.start())))
            for m in HTML_LINK.finditer(prose):
                found.append((m.group(3), m.group(1).lower() == "img", start + prose.count("\n", 0, m.start())))
        return found


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: the rendered text lowercased, every character but letters,
    marks, numbers, ``_``, ``-`` and spaces dropped, spaces made ``-`` (never collapsed)."""
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\([^)]*\)", r"\1", heading)   # a link: its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return "".join(ch for ch in text if ch in " -_" or unicodedata.category(ch)[0] in "LMN").replace(" ", "-")


_PARSED: dict[Path, Markdown] = {}


def parsed(path: Path) -> Markdown:
    if path not in _PARSED:
        _PARSED[path] = Markdown(path.read_text(encoding="utf-8"))
    return _PARSED[path]


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """One sentence per link of ``path`` that leads nowhere."""
    problems = []
    where = path.relative_to(root)
    for dest, image, line in parsed(path).links():
        if not dest or SCHEME.match(dest):
            continue   # the web, mail: not checked here (no network)
        target_part, _, anchor = dest.partition("#")
        target_part = unquote(target_part)
        if not target_part:
            target = path
        elif target_part.startswith("/"):
            target = (root / target_part.lstrip("/")).resolve()
        else:
            target = (path.parent / target_part).resolve()
        if not target.is_relative_to(root.resolve()):
            problems.append(f"{where}:{line}: {dest} leads out of the repository")
            continue
        if not target.exists():
            problems.append(f"{where}:{line}: {dest}: no such file {target.relative_to(root.resolve())}")
            continue
        if image and not target.is_file():
            problems.append(f"{where}:{line}: image {dest} is not a file")
            continue
        if anchor:
            if target.suffix != ".md":
                if not re.fullmatch(r"L\d+(-L\d+)?", anchor):
                    problems.append(f"{where}:{line}: {dest}: #{anchor} in a file that is not markdown")
                continue
            if unquote(anchor) not in parsed(target).anchors():
                problems.append(f"{where}:{line}: {dest}: {target.name} has no heading whose anchor is #{anchor}")
    return problems


MARKDOWN = markdown_files()


def test_the_manual_is_found():
    names = {p.relative_to(ROOT).as_posix() for p in MARKDOWN}
    assert "README.md" in names
    assert "docs/README.md" in names
    assert len([n for n in names if n.startswith("docs/")]) >= 10, names


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_and_anchor_resolves(path):
    problems = broken_links(path)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_citation_of_files_outside_the_repository(path):
    hits = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
            for n, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1) if OUTSIDE.search(line)]
    assert not hits, "these name files a reader does not have:\n" + "\n".join(hits)


def test_readme_is_a_front_page():
    size = (ROOT / "README.md").stat().st_size
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; move detail into docs/"


def test_the_readme_starts_with_the_quickstart_and_its_two_one_line_commands():
    readme = parsed(ROOT / "README.md")
    sections = [(text, line) for level, text, line in readme.headings if level == 2]
    assert sections and sections[0][0] == "Quickstart", f"the first ## section is {sections[:1]}"
    start = sections[0][1]
    end = sections[1][1] if len(sections) > 1 else float("inf")
    blocks = [(info, body) for info, body, line in readme.fences if start < line < end]
    assert len(blocks) == 2, f"Quickstart holds {len(blocks)} fenced blocks, not 2"
    for info, body in blocks:
        language = info.split()[0] if info else ""
        assert language in SHELL_INFO, f"a Quickstart block is {info!r}, not a shell block"
        assert len(body) == 1 and body[0].strip(), f"a Quickstart command is not one line: {body}"


# --- the checker itself: it finds what breaks -----------------------------------------------------

@pytest.mark.parametrize("heading, anchor", [
    ("Configuration: `outpost.toml`", "configuration-outposttoml"),
    ('Claude Code (`preset = "claude-code"`)', "claude-code-preset--claude-code"),
    ("The run's diff", "the-runs-diff"),
    ("Routines: schedule, webhook and manual triggers", "routines-schedule-webhook-and-manual-triggers"),
    ("`skip_if_unchanged` and DST", "skip_if_unchanged-and-dst"),
    ("See [the API](http-api.md) now", "see-the-api-now"),
    ("Café au lait", "café-au-lait"),
])
def test_slugs_are_githubs(heading, anchor):
    assert slug(heading) == anchor


def test_the_checker_finds_a_broken_path_anchor_and_image(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "img.png").write_bytes(b"png")
    (tmp_path / "docs" / "page.md").write_text(
        "# Page\n\n## Twice\n\n## Twice\n\n```sh\n# not a heading\n```\n")
    (tmp_path / "README.md").write_text(
        "# Front\n\n## Quick start\n\n"
        "[ok](docs/page.md) [ok](docs/page.md#twice-1) [ok](#quick-start) ![ok](img.png)\n"
        "[web](https://example.com/x.md#nowhere) `[code](nowhere.md)`\n\n"
        "```\n[in a block](nowhere.md)\n```\n\n"
        "[gone](docs/missing.md) [bad anchor](docs/page.md#twice-2)\n"
        "[no heading in a block](docs/page.md#not-a-heading) ![no image](img/none.png)\n"
        "[out](../elsewhere.md) [wrapped\ntext](#nowhere)\n")
    problems = broken_links(tmp_path / "README.md", root=tmp_path)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "docs/missing.md: no such file docs/missing.md",
        "docs/page.md#twice-2: page.md has no heading whose anchor is #twice-2",
        "docs/page.md#not-a-heading: page.md has no heading whose anchor is #not-a-heading",
        "img/none.png: no such file img/none.png",
        "../elsewhere.md leads out of the repository",
        "#nowhere: README.md has no heading whose anchor is #nowhere",
    ]
    assert [p.split(": ", 1)[0] for p in problems] == ["README.md:12"] * 2 + ["README.md:13"] * 2 + [
        "README.md:14"] * 2
