"""Every repository path the docs name exists: `benchmarks/...`, `docs/...`, `radixlm/...` and
`tests/...` in inline code or a fenced block, and every relative Markdown link.

A doc that names a file after it moved or went sends a reader nowhere; this keeps the paths
true as the tree changes. Globs and placeholders (`*`, `{a,b}`, `NAME`) are not paths and are
skipped. `docs/notes/` is history (its commands name scripts removed since) and is not checked.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHECKED_DOCS = sorted(str(p.relative_to(ROOT))
                      for p in [ROOT / "README.md", *ROOT.glob("docs/*.md")])

_CODE = re.compile(r"```.*?```|`[^`\n]+`", re.DOTALL)
# a path starts a word: not the tail of ~/.cache/radixlm/... or of a URL
_REPO_PATH = re.compile(r"(?<![\w./~:-])(?:benchmarks|docs|radixlm|tests)/[\w./*{}<>-]*")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
# a glob, or a segment in capitals with no extension (`benchmarks/NAME`, `DIR/`)
_PLACEHOLDER = re.compile(r"[*{}<>]|/[A-Z_]{3,}(?:/|$)")


def named_paths(text: str) -> set[str]:
    """The repository-root paths named in the code spans and fenced blocks of `text`."""
    found = set()
    for span in _CODE.findall(text):
        for path in _REPO_PATH.findall(span):
            path = path.rstrip(".")
            if not _PLACEHOLDER.search(path):
                found.add(path)
    return found


def linked_paths(text: str, doc: Path) -> set[Path]:
    """The local files the Markdown links of `doc` point at (anchors dropped)."""
    found = set()
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        found.add((doc.parent / target.split("#", 1)[0]).resolve())
    return found


def missing_paths(doc: Path) -> list[str]:
    """What `doc` names or links that is not in the tree."""
    text = doc.read_text(encoding="utf-8")
    missing = [p for p in named_paths(text) if not (ROOT / p).exists()]
    missing += [os.path.relpath(p, ROOT) for p in linked_paths(text, doc) if not p.exists()]
    return sorted(missing)


@pytest.mark.parametrize("doc", CHECKED_DOCS)
def test_every_named_path_exists(doc: str) -> None:
    assert missing_paths(ROOT / doc) == [], f"{doc} names paths that do not exist"


def test_the_scanner_finds_paths_and_skips_what_is_not_one(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "Run `python benchmarks/gone.py --x` and `radixlm/runtime/`.\n"
        "```\nradixlm serve --model-path ~/.cache/radixlm/small-llama-v1\n"
        "python tests/missing_test.py::test_a\n```\n"
        "Not a path: `tests/kernels/*`, `benchmarks/NAME`, https://x.org/docs/y.\n"
        "A path in capitals: `docs/NOTES.md`.\n"
        "[a link](missing.md#anchor), [web](https://example.com), [here](#top).\n",
        encoding="utf-8",
    )
    text = doc.read_text(encoding="utf-8")
    assert named_paths(text) == {
        "benchmarks/gone.py", "radixlm/runtime/", "tests/missing_test.py", "docs/NOTES.md",
    }
    assert linked_paths(text, doc) == {(tmp_path / "missing.md").resolve()}
