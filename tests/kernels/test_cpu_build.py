"""The CPU library's build (``cpu_paged._compile``): every source compiled to an object, up
to one compiler per core, then linked; a failing source is named with its errors."""

from __future__ import annotations

import shutil

import pytest

from radixlm.kernels import cpu_paged

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                    reason="no C++ compiler")


@needs_compiler
def test_a_source_that_does_not_compile_is_named_with_its_error(tmp_path, monkeypatch):
    good = tmp_path / "good.cpp"
    good.write_text("int good() { return 1; }\n")
    bad = tmp_path / "bad.cpp"
    bad.write_text("int bad( { return 1; }\n")
    monkeypatch.setattr(cpu_paged, "SOURCES", [good, bad])
    out = tmp_path / "lib" / "x.so"
    out.parent.mkdir()
    with pytest.raises(RuntimeError, match=r"bad\.cpp failed:\n.*error") as e:
        cpu_paged._compile(out)
    assert "good.cpp" not in str(e.value)
    assert not out.exists() and list(out.parent.iterdir()) == []  # the objects went too


@needs_compiler
def test_objects_compiled_apart_link_into_one_library(tmp_path, monkeypatch):
    # two sources, one calling the other's function: the link resolves it
    (tmp_path / "a.cpp").write_text('extern "C" int twice(int x) { return 2 * x; }\n')
    (tmp_path / "b.cpp").write_text('extern "C" int twice(int);\n'
                                    'extern "C" int four_times(int x) {\n'
                                    '  return twice(twice(x));\n}\n')
    monkeypatch.setattr(cpu_paged, "SOURCES", [tmp_path / "a.cpp", tmp_path / "b.cpp"])
    out = tmp_path / "lib" / "ab.so"
    out.parent.mkdir()
    cpu_paged._compile(out)
    import ctypes

    assert ctypes.CDLL(str(out)).four_times(3) == 12
    assert [p.name for p in out.parent.iterdir()] == ["ab.so"]



@needs_compiler
def test_after_a_failure_the_sources_not_started_are_not_compiled(tmp_path, monkeypatch):
    # one compiler at a time: the largest source (the broken one) first; the worker may
    # take the next before the failure is seen, not the rest
    bad = tmp_path / "bad.cpp"
    bad.write_text("int bad( { return 1; }\n" + "// padding\n" * 50)
    later = [tmp_path / f"later{i}.cpp" for i in range(6)]
    for f in later:
        f.write_text("int f() { return 1; }\n")
    monkeypatch.setattr(cpu_paged, "SOURCES", [*later, bad])
    monkeypatch.setattr(cpu_paged, "_jobs", lambda: 1)
    seen = []
    run = cpu_paged._run
    monkeypatch.setattr(cpu_paged, "_run", lambda cmd, what: (seen.append(what), run(cmd, what)))
    out = tmp_path / "lib" / "x.so"
    out.parent.mkdir()
    with pytest.raises(RuntimeError, match=r"bad\.cpp failed"):
        cpu_paged._compile(out)
    assert seen[0].endswith("bad.cpp") and len(seen) <= 3
