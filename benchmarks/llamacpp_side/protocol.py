"""The one line a worker prints: ``RESULT_PREFIX`` + JSON (no pickle crosses a process)."""

from __future__ import annotations

import json

RESULT_PREFIX = "LLAMACPP_SIDE_RESULT "


def result_line(result: dict) -> str:
    return RESULT_PREFIX + json.dumps(result)


def parse_result(stdout: str) -> dict:
    """The worker's result (the last line with ``RESULT_PREFIX``)."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    raise ValueError("no result line in the worker's output")
