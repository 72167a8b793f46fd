"""Imports flow one way (docs/design.md, "Layout"): walk every module under radixlm/ and
fail on an import against the documented direction, on an import cycle, and on a module
left at an old path of the runtime."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "radixlm"

SHARED = ("radixlm.runtime.config", "radixlm.runtime.kv_events_config",
          "radixlm.runtime.model_config", "radixlm.runtime.model_dir", "radixlm.runtime.metrics",
          "radixlm.runtime.tokenizer", "radixlm.runtime.gguf_file",
          "radixlm.runtime.gguf_container", "radixlm.runtime.gguf_families",
          "radixlm.runtime.gguf_rope",
          "radixlm.runtime.parent_death", "radixlm.runtime.config_checks",
          "radixlm.runtime.sglang_metrics", "radixlm.runtime.cpu_threads",
          "radixlm.runtime.openmp_env")

# room -> the other rooms its modules may import (a module may always import its own room)
ALLOWED: dict[str, set[str]] = {
    "tiny_model": set(),
    # writers of tiny quantized checkpoints (GGUF, AWQ, GPTQ, FP8, W8A8) from a float one
    "tiny_quant": {"tiny_model", "shared"},
    "radix_cache": set(),
    "kernels": set(),
    "shared": {"tiny_model"},
    "constrained": {"shared"},
    "disaggregation": {"shared"},  # KV transfer between prefill and decode servers
    # process groups and parallel layers: torch.distributed, and the kernels a layer's
    # matmul calls (the int8 weight-only matmul)
    "distributed": {"shared", "kernels"},
    "executor": {"shared", "constrained", "distributed", "radix_cache", "kernels"},
    "managers": {"shared", "constrained", "disaggregation", "distributed", "executor",
                 "radix_cache"},
    "entrypoints": {"shared", "constrained", "executor", "managers", "tiny_model"},
    "frontend_dsl": set(),
    "bench": {"shared"},  # a client of any server: the tokenizer loader, nothing else
    "analysis": {"shared"},  # offline reports on request logs: the tokenizer loader only
    "top": {"tiny_model", "radix_cache", "kernels", "shared", "constrained", "disaggregation",
            "distributed",
            "executor", "managers", "entrypoints", "frontend_dsl", "bench", "analysis"},
}
# the DSL's in-process backend starts an Engine; its tools reuse the server's tool machinery
# (plans, grammars, parsers): the only imports from frontend_dsl into runtime
EXCEPTIONS = {("radixlm.frontend_dsl.backends.local", "radixlm.runtime.entrypoints.engine.engine"),
              ("radixlm.frontend_dsl.tools", "radixlm.runtime.entrypoints.openai.function_call"),
              ("radixlm.frontend_dsl.tools", "radixlm.runtime.managers.api_error")}


def room_of(module: str) -> str:
    parts = module.split(".")
    if module in SHARED or module == "radixlm.runtime":
        return "shared"
    if parts[:2] == ["radixlm", "runtime"]:
        assert len(parts) > 2, module
        if parts[2] not in ALLOWED:
            raise AssertionError(f"{module} is in no room of radixlm.runtime")
        return parts[2]
    if len(parts) > 1 and parts[1] in ALLOWED:
        return parts[1]
    return "top"  # radixlm, radixlm.cli, radixlm.launch_server


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE_DIR.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(module: str, source: str, is_package: bool = False) -> set[str]:
    """Every radixlm module ``source`` imports, anywhere in the file (functions and
    TYPE_CHECKING blocks included), relative imports resolved."""
    out: set[str] = set()
    base = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "radixlm")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = base[: len(base) - node.level + 1]
                target = ".".join(pkg + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "radixlm":
                continue
            # ``from radixlm.runtime import config`` imports the submodule, not the package's names
            subs = {f"{target}.{a.name}" for a in node.names if known(f"{target}.{a.name}")}
            out |= subs
            if len(subs) < len(node.names):
                out.add(target)
    out.discard(module)
    return out


def known(module: str) -> bool:
    rel = Path(*module.split(".")[1:])
    root = PACKAGE_DIR / rel
    return root.with_suffix(".py").is_file() or (root / "__init__.py").is_file()


def violations(module: str, targets: set[str]) -> list[str]:
    mine = room_of(module)
    bad = []
    for t in sorted(targets):
        theirs = room_of(t)
        if theirs == mine or theirs in ALLOWED[mine] or (module, t) in EXCEPTIONS:
            continue
        bad.append(f"{module} ({mine}) imports {t} ({theirs})")
    return bad


def all_modules() -> dict[str, set[str]]:
    graph = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        name = module_name(path)
        graph[name] = imports_of(name, path.read_text(), path.name == "__init__.py")
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle among modules (a package's own __init__ excluded: importing a submodule
    runs its parents first, which is not a dependency of the code)."""
    color: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        color[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if m.startswith(t + "."):
                continue
            if color.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t in graph and not color.get(t):
                found = visit(t)
                if found:
                    return found
        stack.pop()
        color[m] = 2
        return None

    for m in graph:
        if not color.get(m):
            found = visit(m)
            if found:
                return found
    return None


def test_every_import_follows_the_documented_direction():
    graph = all_modules()
    assert len(graph) > 60, sorted(graph)
    bad = [v for m, targets in graph.items() for v in violations(m, targets)]
    assert not bad, "\n".join(bad)


def test_every_import_names_a_module_that_exists():
    graph = all_modules()
    missing = {t for targets in graph.values() for t in targets if not known(t)}
    assert not missing, sorted(missing)


def test_no_import_cycles():
    assert find_cycle(all_modules()) is None


def test_runtime_top_level_holds_only_shared_modules():
    """No module (or re-export shim) left at an old flat path of radixlm/runtime/."""
    top = {module_name(p) for p in (PACKAGE_DIR / "runtime").glob("*.py")}
    assert top == set(SHARED) | {"radixlm.runtime"}
    rooms = {p.name for p in (PACKAGE_DIR / "runtime").iterdir()
             if p.is_dir() and (p / "__init__.py").is_file()}
    assert rooms == {"entrypoints", "managers", "executor", "constrained", "disaggregation",
                     "distributed"}


@pytest.mark.parametrize("module,source,expected", [
    ("radixlm.runtime.executor.model_runner",
     "from radixlm.runtime.managers.scheduler.schedule_batch import ScheduleBatch", 1),
    ("radixlm.runtime.executor.model_runner",
     "def f():\n    from radixlm.runtime.managers.scheduler import scheduler", 1),
    ("radixlm.runtime.executor.model_runner",
     "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
     "    from ..managers.schedule_batch import ScheduleBatch", 1),
    ("radixlm.radix_cache.radix_tree", "import radixlm.runtime.config", 1),
    ("radixlm.kernels.reference", "from radixlm.radix_cache.kv_pool import KVPool", 1),
    ("radixlm.runtime.managers.scheduler.scheduler",
     "from radixlm.runtime.entrypoints.engine import engine", 1),
    ("radixlm.frontend_dsl.api", "from radixlm.runtime.entrypoints.engine.engine import Engine", 1),
    ("radixlm.runtime.managers.scheduler.scheduler",
     "from ...executor.model_runner import ModelRunner", 0),
    ("radixlm.frontend_dsl.backends.local",
     "from radixlm.runtime.entrypoints.engine.engine import Engine", 0),
])
def test_checker_flags_imports_against_the_direction(module, source, expected):
    assert len(violations(module, imports_of(module, source))) == expected


def test_cycle_finder_finds_a_cycle():
    graph = {"radixlm.a": {"radixlm.b"}, "radixlm.b": {"radixlm.c"}, "radixlm.c": {"radixlm.a"}}
    assert find_cycle(graph) == ["radixlm.a", "radixlm.b", "radixlm.c", "radixlm.a"]
    assert find_cycle({"radixlm.a": {"radixlm.b"}, "radixlm.b": set()}) is None


def test_a_servers_start_imports_no_torch_before_its_children():
    # every server process imports torch (seconds of a core each): the command line and the
    # launch must not, or the children start that much later (docs/design.md)
    import subprocess
    import sys

    code = ("import sys, radixlm.cli, radixlm.launch_server, radixlm.runtime.entrypoints.launch\n"
            "print(sorted(m for m in ('torch', 'transformers', 'fastapi', 'xgrammar')"
            " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
