"""radixlm's frontend has SGLang 0.5's public names and calling forms.

The oracle is SGLang's own source in the wheel (``sglang/lang/api.py``, ``ir.py``,
``interpreter.py``, ``backend/runtime_endpoint.py`` and ``sglang/__init__.py``), read with
``ast``: every public name must exist in ``radixlm``, and every parameter SGLang's function
takes must be taken by radixlm's, in the same position where it can be passed
positionally, with the same default. radixlm may add parameters after SGLang's.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import radixlm
from radixlm.frontend_dsl.state import ProgramState, ProgramStateGroup
from tests.compat.sglang_wheel import sglang_dir

# Names SGLang exports that radixlm deliberately lacks, and why.
EXCLUDED = {
    # hosted proprietary APIs: their own clients, nothing to do with serving a model here;
    # radixlm.OpenAI talks to any OpenAI-compatible server, radixlm's own included
    "Anthropic": "hosted API client (Anthropic)",
    "Crusoe": "hosted API client (Crusoe Cloud)",
    "LiteLLM": "hosted API proxy client (LiteLLM)",
    "VertexAI": "hosted API client (Google Vertex AI)",
}
# Public names radixlm defines only to refuse them with a clear error: they need images/video.
REFUSED = {"image", "video"}


def _tree(relpath: str) -> ast.Module:
    return ast.parse(Path(sglang_dir(), relpath).read_text())


def _functions(module: ast.Module) -> dict[str, ast.FunctionDef]:
    return {
        n.name: n
        for n in module.body
        if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")
    }


def _methods(module: ast.Module, cls: str) -> dict[str, ast.FunctionDef]:
    (node,) = [n for n in module.body if isinstance(n, ast.ClassDef) and n.name == cls]
    return {
        n.name: n
        for n in node.body
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (not n.name.startswith("_") or n.name in DUNDERS)
    }


DUNDERS = {"__iadd__", "__getitem__", "__setitem__", "__contains__", "__call__"}


def _sglang_params(fn: ast.FunctionDef) -> list[tuple[str, str, object]]:
    """(name, kind, default) of SGLang's parameters; defaults as Python values where
    they are literals, else their source text."""
    a = fn.args
    out: list[tuple[str, str, object]] = []
    positional = a.posonlyargs + a.args
    pos_defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for arg, default in zip(positional, pos_defaults):
        out.append((arg.arg, "positional", _value(default)))
    if a.vararg:
        out.append((a.vararg.arg, "*args", inspect.Parameter.empty))
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        out.append((arg.arg, "keyword", _value(default)))
    return [p for p in out if p[0] not in ("self", "s")]


def _value(node: ast.expr | None) -> object:
    if node is None:
        return inspect.Parameter.empty
    try:
        return ast.literal_eval(node)
    except ValueError:
        return _Name(ast.unparse(node))


class _Name(str):
    """A default that is a name (``token_length_normalized``), not a literal."""


def _check_signature(where: str, sglang_fn: ast.FunctionDef, ours: object) -> list[str]:
    """Problems with ``ours`` taking every call SGLang's function takes."""
    sig = inspect.signature(ours)
    params = [p for p in sig.parameters.values() if p.name not in ("self", "s")]
    by_name = {p.name: p for p in params}
    ours_positional = [
        p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    has_var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    problems = []
    sglang_positional = [n for n, kind, _ in _sglang_params(sglang_fn) if kind == "positional"]
    if ours_positional[: len(sglang_positional)] != sglang_positional:
        problems.append(
            f"{where}: positional parameters {ours_positional} do not start with "
            f"SGLang's {sglang_positional}"
        )
    for name, kind, default in _sglang_params(sglang_fn):
        if kind == "*args":
            if not any(p.kind is p.VAR_POSITIONAL for p in params):
                problems.append(f"{where}: takes no *{name}")
            continue
        p = by_name.get(name)
        if p is None:
            if not has_var_kw:
                problems.append(f"{where}: no parameter {name!r}")
            continue
        if isinstance(default, _Name):
            same = p.default is getattr(radixlm, default, inspect.Parameter.empty)
        else:
            same = default is inspect.Parameter.empty or p.default == default
        if not same:
            problems.append(f"{where}({name}=...): default {p.default!r}, SGLang's {default!r}")
    return problems


def test_every_public_name_of_sglang_exists():
    names = set(_functions(_tree("lang/api.py")))
    init = _tree("__init__.py")
    (all_node,) = [
        n for n in init.body if isinstance(n, ast.Assign) and n.targets[0].id == "__all__"
    ]
    names |= set(ast.literal_eval(all_node.value))
    assert {"gen", "select", "function", "user", "separate_reasoning"} <= names  # read right
    missing = sorted(n for n in names - set(EXCLUDED) if not hasattr(radixlm, n))
    assert missing == [], f"SGLang names radixlm lacks: {missing}"
    assert set(EXCLUDED) <= names, "an exclusion names something SGLang no longer has"


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_image_and_video_are_refused_by_name(name):
    with pytest.raises(NotImplementedError, match=f"sgl.{name}\\(\\).*text-only"):
        getattr(radixlm, name)("x.png", 4) if name == "video" else radixlm.image("x.png")


def test_api_functions_take_sglangs_calls():
    problems = []
    for name, fn in _functions(_tree("lang/api.py")).items():
        if name in REFUSED | {"Engine", "Runtime"}:  # Runtime/Engine: classes, below
            continue
        problems += _check_signature(name, fn, getattr(radixlm, name))
    assert problems == []


def test_program_and_state_methods_take_sglangs_calls():
    ir, interp = _tree("lang/ir.py"), _tree("lang/interpreter.py")
    pairs = [
        ("SglFunction", ir, radixlm.SglFunction),
        ("ProgramState", interp, ProgramState),
        ("ProgramStateGroup", interp, ProgramStateGroup),
    ]
    seen = {f"{cls}.{name}" for cls, tree, _ in pairs for name in _methods(tree, cls)}
    assert {
        "SglFunction.run_batch",
        "ProgramState.user",
        "ProgramState.text_async_iter",
        "ProgramState.copy",
        "ProgramStateGroup.__setitem__",
    } <= seen
    problems = []
    for cls, tree, ours in pairs:
        for name, fn in _methods(tree, cls).items():
            if not hasattr(ours, name):
                problems.append(f"{cls}.{name} is missing")
                continue
            problems += _check_signature(f"{cls}.{name}", fn, getattr(ours, name))
    assert problems == []


def test_runtime_endpoint_takes_sglangs_arguments():
    tree = _tree("lang/backend/runtime_endpoint.py")
    init = _methods(tree, "RuntimeEndpoint")
    problems = _check_signature(
        "RuntimeEndpoint", _init_of(tree, "RuntimeEndpoint"), radixlm.RuntimeEndpoint.__init__
    )
    for name in ("get_model_name", "flush_cache", "get_server_info", "cache_prefix"):
        assert name in init and hasattr(radixlm.RuntimeEndpoint, name), name
    assert problems == []


def _init_of(tree: ast.Module, cls: str) -> ast.FunctionDef:
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    (fn,) = [n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
    return fn


def test_the_signature_check_can_fail():
    """The checker on a function that drops, reorders and re-defaults SGLang's params."""
    fn = _functions(_tree("lang/api.py"))["select"]

    def wrong(choices=None, name=None, temperature=1.0):
        return None

    problems = _check_signature("select", fn, wrong)
    assert any("positional" in p for p in problems)
    assert any("temperature" in p for p in problems)
    assert any("choices_method" in p for p in problems)
