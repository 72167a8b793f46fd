"""Smoke-run every example in a subprocess on the tiny model (in-process Engine)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path):
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip()


def test_all_seven_examples_exist():
    names = {p.stem for p in EXAMPLES}
    assert {
        "quickstart",
        "multi_turn_chat",
        "fork_join_drafts",
        "select_classifier",
        "agent_loop",
        "rag_long_document",
        "json_extraction",
    } <= names
