"""`radixlm serve --help` explains itself: flags in groups by topic, --help=GROUP for one
group, a misspelt flag answered with serve's own usage and the flag it meant."""

from __future__ import annotations

import dataclasses

import pytest

from radixlm import cli
from radixlm.runtime.config import ServerArgs
from radixlm.server_args_cli import FLAG_GROUPS, flag_name, ungrouped_fields


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(list(argv))
    out, err = capsys.readouterr()
    return exit_info.value.code or 0, out, err


def test_every_setting_is_in_exactly_one_group() -> None:
    assert ungrouped_fields() == []


def test_help_lists_every_flag_under_its_group(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "serve", "--help")
    assert code == 0
    usage = out.split("\n\n", 1)[0]
    assert len(usage.splitlines()) <= 2, usage  # not every flag in the usage block
    positions = [out.index(f"\n{name}: {title}:") for name, (title, _) in FLAG_GROUPS.items()]
    assert positions == sorted(positions)
    for name, (_, members) in FLAG_GROUPS.items():
        start = out.index(f"\n{name}: ")
        end = out.find("\n\n", start + 1)
        section = out[start:end if end > 0 else len(out)]
        for member in members:
            assert f"  {flag_name(member)}" in section, (member, name)
    assert "(default: None)" not in out and "(default: False)" not in out


def test_each_flag_has_help_and_its_default_once(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = _run(capsys, "serve", "--help")
    for f in dataclasses.fields(ServerArgs):
        assert f.metadata.get("help"), f"{flag_name(f.name)} has no help"
    assert out.count("(default: 30000)") == 1


def test_help_for_one_group_and_for_a_word(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "serve", "--help=server")
    assert code == 0 and "--port" in out and "--model-path" not in out.split("\n\n", 1)[1]
    code, out, _ = _run(capsys, "serve", "--help=hicache")
    flags = out.split("\n\n", 1)[1]
    assert code == 0 and "--hicache-storage-dir" in flags and "--port" not in flags
    code, _, err = _run(capsys, "serve", "--help=nosuchthing")
    assert code == 2 and "groups: model, server" in err


def test_a_misspelt_flag_names_the_nearest(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "serve", "--model-pth", "/m")
    assert code == 2
    assert err.startswith("usage: radixlm serve"), err  # serve's usage, not the top level's
    assert "--model-pth (did you mean --model-path?)" in err
    code, _, err = _run(capsys, "serve", "--max-runing-requests", "4")
    assert "did you mean --max-running-requests?" in err


def test_the_parsed_flags_make_server_args(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}
    monkeypatch.setattr(cli, "_serve", lambda args: seen.setdefault("args", args) and 0)
    cli.main(["serve", "--port", "31000", "--kv-cache-dtype", "bf16", "--disable-radix-cache",
              "--disaggregation-trusted-hosts", "a", "b"])
    from radixlm.server_args_cli import server_args_from_cli

    args = server_args_from_cli(seen["args"])
    assert (args.port, args.kv_cache_dtype, args.disable_radix_cache) == (31000, "bf16", True)
    assert args.disaggregation_trusted_hosts == ("a", "b")
