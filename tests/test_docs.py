"""The documentation stays usable: README.md short with its two commands on
the first screen, every relative link in README.md and docs/ pointing at a
file that exists, and docs/configuration.md describing every command-line
flag and every CAFFEMPI_* variable in exactly one table row."""
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
CONFIGURATION = DOCS / "configuration.md"

# [text](target) and [text](target "title"); images too
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def markdown_files():
    return [README] + sorted(DOCS.rglob("*.md"))


def prose(text):
    """The text outside fenced code blocks (links there are not links)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return "\n".join(out)


def relative_links(path):
    for target in LINK.findall(prose(path.read_text(encoding="utf-8"))):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):    # http:, https:, mailto:
            continue
        target = target.split("#", 1)[0]
        if target:                                            # not a bare #anchor
            yield target


def table_first_cells(path):
    """The first cell of every markdown table row, stripped."""
    cells = []
    for line in prose(path.read_text(encoding="utf-8")).splitlines():
        line = line.strip()
        if line.startswith("|") and line.count("|") >= 2:
            cells.append(line.split("|")[1].strip())
    return cells


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, "README.md has %d lines (at most 200)" % len(lines)


def test_readme_shows_demo_and_test_first():
    head = "\n".join(README.read_text(encoding="utf-8").splitlines()[:25])
    assert "make demo" in head
    assert "make test" in head


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(path):
    missing = [t for t in relative_links(path) if not (path.parent / t).exists()]
    assert not missing, "%s links to missing files: %s" % (path.relative_to(REPO), missing)


def test_link_parser():
    sample = ('see [a](docs/x.md#part), [b](https://example.org/y), [c](#here), '
              '![d](img/e.png "title") and [f](../g.md)\n```\n[h](not/a/link.md)\n```\n')
    tmp = prose(sample)
    assert LINK.findall(tmp) == ["docs/x.md#part", "https://example.org/y", "#here", "img/e.png", "../g.md"]


def test_every_flag_documented_once():
    from caffempi.cli import FLAGS
    cells = table_first_cells(CONFIGURATION)
    for name in FLAGS:
        want = "`--%s`" % name
        assert cells.count(want) == 1, "%s: %d table rows in docs/configuration.md (want 1)" % (
            want, cells.count(want))


def test_every_setting_documented_once():
    from caffempi.config import SETTINGS
    cells = table_first_cells(CONFIGURATION)
    for var, _parse, _default in SETTINGS.values():
        want = "`%s`" % var
        assert cells.count(want) == 1, "%s: %d table rows in docs/configuration.md (want 1)" % (
            want, cells.count(want))


def test_no_undocumented_flag_rows():
    """A row for a flag or variable that no longer exists is caught too."""
    from caffempi.cli import FLAGS
    from caffempi.config import SETTINGS
    cells = table_first_cells(CONFIGURATION)
    flags = {c[3:-1] for c in cells if re.fullmatch(r"`--[a-z_]+`", c)}
    variables = {c[1:-1] for c in cells if re.fullmatch(r"`CAFFEMPI_[A-Z0-9_]+`", c)}
    assert flags <= set(FLAGS), "documented but not defined: %s" % sorted(flags - set(FLAGS))
    known = {var for var, _p, _d in SETTINGS.values()}
    assert variables <= known, "documented but not in config.SETTINGS: %s" % sorted(variables - known)
