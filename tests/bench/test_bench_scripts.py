"""``radixlm bench NAME``: each name runs its benchmarks/ script with the arguments as given."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixlm import cli
from radixlm.bench import scripts


def test_every_name_has_its_script() -> None:
    missing = [f for f, _ in scripts.SCRIPTS.values() if not (scripts.BENCH_DIR / f).is_file()]
    assert missing == [], f"radixlm bench names scripts not in benchmarks/: {missing}"


def test_the_arguments_reach_the_script_and_its_status_comes_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "argv.txt"
    (tmp_path / "hicache.py").write_text(
        f"import sys\nopen({str(out)!r}, 'w').write(' '.join(sys.argv[1:]))\nsys.exit(3)\n",
        encoding="utf-8")
    monkeypatch.setattr(scripts, "BENCH_DIR", tmp_path)
    # --help too is the script's: argparse in radixlm's CLI would answer it otherwise
    assert cli.main(["bench", "hicache", "--preset", "small", "--help"]) == 3
    assert out.read_text(encoding="utf-8") == "--preset small --help"


def test_without_a_checkout_it_says_where_the_scripts_are(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(scripts, "BENCH_DIR", tmp_path)
    assert cli.main(["bench", "vllm"]) == 2
    assert "vllm_side_by_side.py" in capsys.readouterr().err


def test_bench_help_lists_the_scripts(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    listing = capsys.readouterr().out
    assert all(name in listing for name in ("serve", *scripts.SCRIPTS)), listing
