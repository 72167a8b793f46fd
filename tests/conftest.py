"""Shared pytest fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import radixlm
from radixlm.tiny_families import FAMILIES, make_family_model
from radixlm.tiny_model import default_tiny_model_path, train_tokenizer


def pytest_configure(config) -> None:
    """Without CUDA the Triton kernels' tests run in Triton's interpreter, which Triton
    reads when it is first imported; transformers' MoE modules import it too, so the
    variable is set here, before any test file, not only by the files that need it."""
    import torch  # loaded by radixlm already, which comes first: OpenMP's wait policy

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


# --- tiny models ---


@pytest.fixture(scope="session")
def tiny_llama_dir() -> Path:
    """The built-in tiny Llama checkpoint (built once per machine, then cached)."""
    return default_tiny_model_path("llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir() -> Path:
    """The built-in tiny Qwen2 checkpoint (q/k/v bias, tied embeddings)."""
    return default_tiny_model_path("qwen2")


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    """Every family of ``radixlm.tiny_families`` as a tiny checkpoint written by
    transformers' own classes, built once per session (one tokenizer for all)."""
    root = tmp_path_factory.mktemp("families")
    tok = train_tokenizer()
    return {arch: make_family_model(root / arch, arch, tokenizer=tok) for arch in FAMILIES}


# --- engines ---
# Every Engine a test builds through these fixtures is checked after each test: at idle,
# free + evictable + protected + request-owned == pool size, and the tree is sound.

_LIVE_ENGINES: list = []


def _engine_factory():
    made = []

    def make(**kwargs):
        kwargs.setdefault("random_seed", 0)
        kwargs.setdefault("max_total_tokens", 16384)
        # one torch thread: tests also run server processes, and OpenMP threads that
        # compete for the 2 cores of CI slow everything down
        kwargs.setdefault("cpu_threads", 1)
        eng = radixlm.Engine(**kwargs)
        made.append(eng)
        _LIVE_ENGINES.append(eng)
        return eng

    return make, made


def _shutdown(made) -> None:
    for eng in made:
        eng.shutdown()
        _LIVE_ENGINES.remove(eng)


@pytest.fixture
def make_engine():
    """``make_engine(**server_args)`` -> a radixlm.Engine, shut down after the test."""
    make, made = _engine_factory()
    yield make
    _check_engines(made)
    _shutdown(made)


@pytest.fixture(scope="module")
def make_module_engine():
    """Like ``make_engine``, for engines shared by a module's tests."""
    make, made = _engine_factory()
    yield make
    _shutdown(made)


def _servers(tmp_path_factory):
    """``start(flags, name)`` -> a healthy ``radixlm serve`` on a free loopback port (its
    log under a temporary ``name`` directory); the generator stops them all after."""
    from radixlm.runtime.entrypoints.server_process import ServerProcess

    started = []

    def start(flags: list[str], name: str = "server") -> ServerProcess:
        srv = ServerProcess(flags, tmp_path_factory.mktemp(name) / "server.log")
        started.append(srv)
        srv.wait_healthy()
        return srv

    yield start
    for srv in started:
        srv.stop()


@pytest.fixture
def make_server(tmp_path_factory):
    """``make_server(flags, name)``: servers stopped after the test."""
    yield from _servers(tmp_path_factory)


@pytest.fixture(scope="module")
def module_server(tmp_path_factory):
    """``module_server(flags, name)``: servers shared by a module's tests."""
    yield from _servers(tmp_path_factory)


def _check_engines(engines) -> None:
    for eng in engines:
        if eng.is_alive:
            eng.wait_idle()
            eng.check_invariants()


@pytest.fixture(autouse=True)
def _check_kv_invariants_after_test():
    yield
    _check_engines(list(_LIVE_ENGINES))
