"""Fixtures of the executor tests."""

from __future__ import annotations

import pytest

from radixlm.kernels import masked_attention


@pytest.fixture
def no_masked_path(monkeypatch):
    """Fail the test if attention takes the masked torch path (the Triton path must carry
    windows and caps itself)."""

    def refuse(*args, **kwargs):
        raise AssertionError("the Triton path took the masked torch path")

    monkeypatch.setattr(masked_attention, "decode_attention", refuse)
    monkeypatch.setattr(masked_attention, "extend_attention", refuse)
