"""Every snippet the docs mark as runnable runs as pasted, against the tiny model.

A fenced block right after a line ``<!-- snippet: KIND -->`` in README.md or docs/*.md is
run: ``python`` in this venv, ``bash`` with this venv's ``radixlm`` first on PATH,
``agents`` in the agent frameworks' venv (``tests/compat/agent_frameworks.py``). A snippet
that talks to ``127.0.0.1:30000`` / ``localhost:30000`` reaches one shared server on a free
port instead: the tiny Qwen2 with a chat template that renders tools, SGLang's qwen25 tool
parser and the qwen3 reasoning parser, a short context so random weights end. A snippet
that stops working as written fails here, not in a newcomer's terminal.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.runtime.entrypoints.function_call.tools_model import tools_model_dir

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
KINDS = ("python", "bash", "agents")
_MARKED = re.compile(r"^<!-- snippet: (\w+) -->\n```[\w-]*\n(.*?)^```$", re.M | re.S)
_DEFAULT_URL = re.compile(r"(?:127\.0\.0\.1|localhost):30000")
SERVER_FLAGS = ["--tool-call-parser", "qwen25", "--reasoning-parser", "qwen3",
                "--context-length", "1024", "--max-total-tokens", "8192",
                "--log-level", "warning", "--random-seed", "0"]


@dataclass(frozen=True)
class Snippet:
    doc: str
    line: int
    kind: str
    code: str

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}"


def snippets(text: str, doc: str) -> list[Snippet]:
    """The marked blocks of ``text``."""
    return [Snippet(doc, text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2))
            for m in _MARKED.finditer(text)]


ALL = [s for p in DOCS for s in snippets(p.read_text(encoding="utf-8"),
                                         str(p.relative_to(ROOT)))]


def test_the_docs_mark_snippets_of_known_kinds() -> None:
    assert len(ALL) >= 6, [str(s) for s in ALL]
    assert {s.kind for s in ALL} <= set(KINDS), {s.kind for s in ALL}
    assert any(s.doc == "README.md" and s.kind == "agents" for s in ALL)


def test_the_scanner_finds_marked_blocks_only() -> None:
    text = ("```python\nnot marked\n```\n<!-- snippet: python -->\n```python\nprint(1)\n```\n"
            "<!-- snippet: bash -->\n```bash\necho 2\n```\n")
    found = snippets(text, "x.md")
    assert [(s.line, s.kind, s.code) for s in found] == [
        (4, "python", "print(1)\n"), (8, "bash", "echo 2\n")]


@pytest.fixture(scope="module")
def server_url(module_server, tiny_qwen2_dir, tmp_path_factory) -> str:
    model = tools_model_dir(tiny_qwen2_dir, tmp_path_factory.mktemp("snippet-model") / "m")
    srv = module_server(["--model-path", str(model), *SERVER_FLAGS], "snippets")
    return srv.url.removeprefix("http://")


def _command(snippet: Snippet, where: Path) -> list[str]:
    """How a user runs it: a shell line, or a Python file of the pasted text."""
    if snippet.kind == "bash":
        return ["bash", "-euo", "pipefail", "-c", snippet.code]
    script = where / "snippet.py"
    script.write_text(snippet.code, encoding="utf-8")
    if snippet.kind == "agents":
        from tests.compat.agent_frameworks import frameworks_python

        return [str(frameworks_python()), str(script)]
    return [sys.executable, str(script)]


@pytest.mark.parametrize("snippet", ALL, ids=str)
def test_snippet_runs_as_pasted(snippet: Snippet, request: pytest.FixtureRequest,
                                tmp_path: Path) -> None:
    code = snippet.code
    if _DEFAULT_URL.search(code):
        code = _DEFAULT_URL.sub(request.getfixturevalue("server_url"), code)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "OPENAI_AGENTS_DISABLE_TRACING": "1"}
    if snippet.kind == "agents":
        env["PYTHONPATH"] = ""
    pasted = Snippet(snippet.doc, snippet.line, snippet.kind, code)
    proc = subprocess.run(_command(pasted, tmp_path), cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (
        f"{snippet} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
