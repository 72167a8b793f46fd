"""radixlm prefix-report on a generated log with planted volatile values: each template
family is found, with the exact position where consecutive prompts diverge and the right
cause, and cache hit rates equal brute-force oracles before and after the rewrite."""

from __future__ import annotations

import json
import random
import uuid
from datetime import datetime, timedelta, timezone
from itertools import takewhile

import pytest

from radixlm.analysis.plot import plot_divergence
from radixlm.analysis.prefix_report import prefix_report, render_text, rewrite
from radixlm.analysis.prompts import load_prompts
from radixlm.analysis.volatile import classify
from radixlm.cli import main
from radixlm.runtime.tokenizer import load_tokenizer, resolve_model_path

N = 12  # requests per family
# questions that pairwise differ at their first character: after the volatile part is
# fixed, two prompts of a family share exactly prefix + shared part
QUESTIONS = [f"{w} is what I want to know about today, please explain." for w in (
    "Apples", "Bread", "Cheese", "Dates", "Eggs", "Figs", "Grapes", "Honey", "Icecream",
    "Jam", "Kale", "Lemons")]
CHAT_HEAD = "<|system|>\n"  # render_chat without a tokenizer


def _stable(seed: int) -> str:
    rng = random.Random(seed)
    words = ["cache", "prefix", "token", "radix", "model", "serve", "batch", "page"]
    return " " + " ".join(rng.choice(words) for _ in range(60)) + ".\n"


def _family_values(kind: str) -> list[str]:
    rng = random.Random(kind)
    if kind == "timestamp":
        t0 = datetime(2024, 5, 1, 9, 0, 0, tzinfo=timezone.utc)
        return [(t0 + timedelta(seconds=3671 * i)).strftime("%Y-%m-%dT%H:%M:%SZ")
                for i in range(N)]
    if kind == "uuid":
        return [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(N)]
    if kind == "number":
        return [str(10007 + 7919 * i) for i in range(N)]
    if kind == "json_key_order":
        keys = ["customer", "plan", "region", "tier"]
        vals = {"customer": "Zed", "plan": "pro", "region": "eu-west", "tier": 3}
        return [json.dumps({k: vals[k] for k in keys[i % 4:] + keys[:i % 4]}) for i in range(N)]
    assert kind == "whitespace"
    return ["\n" if i % 2 else " \n" for i in range(N)]


# kind -> (the template's start, chat or not); every start begins with its own letter
FAMILIES = {
    "timestamp": ("System prompt of the ACME support agent. Current time: ", True),
    "uuid": ("Reviewer bot for pull requests, session ", False),
    "number": ("Translation desk, ticket number ", False),
    "json_key_order": ("Extract the fields of this record: ", False),
    "whitespace": ("Weather assistant rules:", False),
}


def _log_lines() -> tuple[list[str], dict[str, dict]]:
    """Interleaved JSONL lines (request log, plain prompt and chat forms), and per family
    its planted position, prefix and shared part."""
    lines: list[str] = []
    planted = {}
    values = {k: _family_values(k) for k in FAMILIES}
    for i in range(N):
        for j, (kind, (head, chat)) in enumerate(FAMILIES.items()):
            shared = _stable(j)
            body = head + values[kind][i] + shared
            if chat:
                record = {"messages": [{"role": "system", "content": body},
                                       {"role": "user", "content": QUESTIONS[i]}]}
                text = CHAT_HEAD + body + "\n<|user|>\n" + QUESTIONS[i] + "\n"
            elif j % 2:
                record = {"rid": f"{kind}-{i}", "route": "/generate", "text": body + QUESTIONS[i],
                          "namespace": "default", "prompt_tokens": 100, "cached_tokens": 10}
                text = record["text"]
            else:
                record = {"prompt": body + QUESTIONS[i]}
                text = record["prompt"]
            lines.append(json.dumps(record))
            start = (len(CHAT_HEAD) if chat else 0) + len(head)
            planted.setdefault(kind, {"start": start, "texts": [], "value": values[kind]})
            planted[kind]["texts"].append(text)
    return lines, planted


def _lcp(a, b) -> int:
    return sum(1 for _ in takewhile(lambda xy: xy[0] == xy[1], zip(a, b)))


def _brute_cached(seqs: list) -> list[int]:
    """Each sequence's longest common prefix with any earlier one (capped at len - 1)."""
    return [min(max((_lcp(s, t) for t in seqs[:i]), default=0), len(s) - 1)
            for i, s in enumerate(seqs)]


@pytest.fixture(scope="module")
def log(tmp_path_factory):
    lines, planted = _log_lines()
    path = tmp_path_factory.mktemp("prefix") / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, planted


@pytest.fixture(scope="module")
def report(log):
    prompts, skipped = load_prompts(log[0])
    assert skipped == 0 and len(prompts) == N * len(FAMILIES)
    return prefix_report(prompts)


def _family(report: dict, kind: str) -> dict:
    found = [f for f in report["family_reports"]
             if f["divergence"] and f["divergence"][0]["kind"] == kind]
    assert len(found) == 1, [(f["family"], f["kinds"]) for f in report["family_reports"]]
    return found[0]


def test_every_family_is_found_with_its_cause_and_position(report, log):
    _, planted = log
    assert report["families"] == len(FAMILIES)
    for kind, plant in planted.items():
        fam = _family(report, kind)
        assert fam["requests"] == N
        top = fam["divergence"][0]
        assert top["char"] == plant["start"], (kind, top)
        assert top["pairs"] == N - 1 and fam["diverging_pairs"] == N - 1
        assert len(fam["divergence"]) == 1, fam["divergence"]  # one cause, one position
        texts = plant["texts"]
        firsts = [_lcp(a, b) for a, b in zip(texts, texts[1:])]
        assert top["first_diff_char"] == max(sorted(set(firsts)), key=firsts.count)
        assert min(firsts) >= plant["start"]
        assert "[" in top["context_this"] and plant["value"][1].strip() in (
            top["context_this"] + top["context_prev"]) or kind == "whitespace"


def test_hit_rates_equal_brute_force_before_and_after_the_fix(report, log):
    _, planted = log
    for kind, plant in planted.items():
        fam = _family(report, kind)
        texts = plant["texts"]
        cached = sum(_brute_cached(texts))  # families never share (distinct first letters)
        assert fam["cached_chars"] == cached, kind
        assert fam["prompt_chars"] == sum(map(len, texts))
        fixed = [rewrite(texts[i - 1] if i else texts[1], t) for i, t in enumerate(texts)]
        fixed_cached = sum(_brute_cached(fixed))
        assert fam["cached_chars"] + fam["lost_chars"] == fixed_cached
        # the oracle's rewrite: every later prompt shares the whole template after the fix
        q = len(QUESTIONS[0]) + (len("\n<|user|>\n") + 1 if kind == "timestamp" else 0)
        stable = min(len(t) for t in fixed) - q - (len(plant["value"][0]) + 1
                                                   if kind in ("timestamp", "uuid", "number")
                                                   else 0)
        assert fixed_cached >= (N - 1) * (stable - 2), kind
        # alternating whitespace shares with the prompt two back, rotated keys four back
        gain = {"whitespace": 0.05, "json_key_order": 0.15}.get(kind, 0.3)
        assert fam["hit_rate_if_fixed"] > fam["hit_rate"] + gain, (kind, fam)
    assert report["hit_rate_if_fixed"] > report["hit_rate"] + 0.2


def test_rewrite_moves_each_kind_of_value(log):
    _, planted = log
    ts = planted["timestamp"]["texts"]
    out = rewrite(ts[0], ts[1])
    assert planted["timestamp"]["value"][1] not in out.splitlines()[1]
    assert out.endswith("\n" + planted["timestamp"]["value"][1])
    js = planted["json_key_order"]["texts"]
    assert rewrite(js[0], js[1])[:300] == rewrite(js[1], js[0])[:300]
    assert classify("total: 12 apples", "total: 19 apples", 8).kind == "number"
    assert classify("id 3f9a2b7c11 done", "id 3f9a88d2e0 done", 7).kind == "hex_id"
    assert classify("Hi Bob", "Hi Amy", 3).kind == "content"


def test_token_positions_with_a_tokenizer(log):
    path, planted = log
    tok = load_tokenizer(resolve_model_path(None))
    prompts, _ = load_prompts(path, tok)
    rep = prefix_report(prompts, tok)
    assert rep["unit"] == "tokens"
    for kind, plant in planted.items():
        if kind == "timestamp":
            continue  # a chat: rendered with the tokenizer's own template here
        fam = _family(rep, kind)
        top = fam["divergence"][0]
        assert top["char"] == plant["start"]
        texts = plant["texts"]
        shared = [_lcp(tok.encode(a, add_special_tokens=False),
                       tok.encode(b, add_special_tokens=False))
                  for a, b in zip(texts, texts[1:])]
        assert top["tokens"] == max(set(shared), key=shared.count), kind
        head = tok.encode(texts[0][:plant["start"]], add_special_tokens=False)
        assert len(head) - 3 <= top["tokens"] <= len(head), kind
        assert fam["hit_rate_if_fixed"] > fam["hit_rate"]


def test_text_output_and_plot(report, tmp_path):
    text = render_text(report)
    for kind in FAMILIES:
        assert f": {kind}" in text
    assert "observed by the server" in text  # the request-log records carry token counts
    png = plot_divergence(report, tmp_path / "div.png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (800, 450)
    import matplotlib.image

    assert matplotlib.image.imread(png).shape[:2] == (450, 800)


def test_cli_json_and_plot(log, tmp_path, capsys):
    path, planted = log
    png = tmp_path / "cli.png"
    assert main(["prefix-report", str(path), "--json", "--plot", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["families"] == len(FAMILIES) and out["plot"] == str(png)
    assert {f["divergence"][0]["kind"] for f in out["family_reports"]} == set(FAMILIES)
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(["prefix-report", str(path), "--family-chars", "0"]) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\nnot json\n')
    assert main(["prefix-report", str(bad)]) == 2
    assert "bad.jsonl:2: not JSON" in capsys.readouterr().err
