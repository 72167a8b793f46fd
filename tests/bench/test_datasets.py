"""The datasets of ``radixlm bench serve``: sizes, shared prefixes, seeds, JSONL forms."""

from __future__ import annotations

import json

import pytest

from radixlm.bench.datasets import render_chat, sample_conversations
from radixlm.bench.serve import bench_tokenizer, build_parser


@pytest.fixture(scope="module")
def tokenizer():
    return bench_tokenizer(build_parser().parse_args([]))


def _args(*flags: str):
    return build_parser().parse_args(list(flags))


def test_random_lengths_and_seed(tokenizer):
    args = _args("--num-prompts", "20", "--random-input-len", "64", "--random-output-len", "16",
                 "--random-range-ratio", "0.5")
    convs = sample_conversations(args, tokenizer)
    assert len(convs) == 20 and all(len(c.turns) == 1 and not c.chat for c in convs)
    assert all(8 <= c.turns[0].output_len <= 16 for c in convs)
    lens = [len(tokenizer.encode(c.turns[0].text, add_special_tokens=False)) for c in convs]
    # 32..64 random tokens; re-tokenising the decoded text merges or splits a few
    assert 16 <= min(lens) and max(lens) <= 128
    assert [c.turns[0].text for c in sample_conversations(args, tokenizer)] == \
        [c.turns[0].text for c in convs]
    other = sample_conversations(_args("--num-prompts", "20", "--seed", "9"), tokenizer)
    assert other[0].turns[0].text != convs[0].turns[0].text


def test_shared_prefix_groups(tokenizer):
    args = _args("--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "3",
                 "--gsp-prompts-per-group", "4", "--gsp-system-prompt-len", "50",
                 "--gsp-question-len", "10", "--gsp-output-len", "7")
    convs = sample_conversations(args, tokenizer)
    assert len(convs) == 12 and {c.turns[0].output_len for c in convs} == {7}
    groups: dict[str, list[str]] = {}
    for c in convs:
        groups.setdefault(c.turns[0].text[:40], []).append(c.turns[0].text)
    assert sorted(len(v) for v in groups.values()) == [4, 4, 4]
    for texts in groups.values():  # the whole 50-token system prompt is shared
        shared = _common(_common(texts[0], texts[1]), _common(texts[2], texts[3]))
        assert len(tokenizer.encode(shared, add_special_tokens=False)) >= 45


def _common(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def test_multi_turn_and_long_document(tokenizer):
    convs = sample_conversations(_args("--dataset-name", "multi-turn", "--num-prompts", "3",
                                       "--multi-turn-num-turns", "5"), tokenizer)
    assert len(convs) == 3 and all(c.chat and len(c.turns) == 5 for c in convs)
    assert len({c.history[0]["content"] for c in convs}) == 1  # one shared system prompt
    docs = sample_conversations(_args("--dataset-name", "long-document", "--num-prompts", "6",
                                      "--long-doc-num-docs", "2", "--long-doc-len", "300"),
                                tokenizer)
    heads = {c.turns[0].text.split("\n\nQuestion: ")[0] for c in docs}
    assert len(docs) == 6 and len(heads) == 2


def test_jsonl_forms(tokenizer, tmp_path):
    path = tmp_path / "data.jsonl"
    lines = [
        {"prompt": "Tell me a story", "output_len": 9},
        {"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello there friend"},
                      {"role": "user", "content": "How are you?"}]},
        {"conversations": [{"from": "human", "value": "Question one"},
                           {"from": "gpt", "value": "Answer one is long enough"},
                           {"from": "human", "value": "Question two"}], "max_tokens": 5},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    convs = sample_conversations(_args("--dataset-name", "custom", "--dataset-path", str(path),
                                       "--random-output-len", "11"), tokenizer)
    assert [len(c.turns) for c in convs] == [1, 1, 1]
    assert convs[0].turns[0].text == "Tell me a story" and convs[0].turns[0].output_len == 9
    assert not convs[0].chat and convs[1].chat
    assert [m["role"] for m in convs[1].history] == ["system", "user", "assistant"]
    assert convs[1].turns[0].text == "How are you?" and convs[1].turns[0].output_len == 11
    assert convs[2].turns[0].output_len == 5
    replay = sample_conversations(_args("--dataset-name", "multi-turn", "--dataset-path",
                                        str(path), "--num-prompts", "2"), tokenizer)
    assert len(replay) == 2  # --num-prompts lines
    turns = replay[1].turns
    assert [t.text for t in turns] == ["Hi", "How are you?"]
    reply_len = len(tokenizer.encode("Hello there friend", add_special_tokens=False))
    assert turns[0].output_len == reply_len
    assert [m["role"] for m in replay[1].history] == ["system"]


def test_dataset_errors(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="needs --dataset-path"):
        sample_conversations(_args("--dataset-name", "custom"), tokenizer)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        sample_conversations(_args("--dataset-name", "custom", "--dataset-path", str(bad)),
                             tokenizer)
    with pytest.raises(ValueError, match="--dataset-path is read by"):
        sample_conversations(_args("--dataset-path", str(bad)), tokenizer)
    with pytest.raises(ValueError, match="--gsp-num-groups"):
        sample_conversations(_args("--dataset-name", "generated-shared-prefix",
                                   "--gsp-num-groups", "0"), tokenizer)


def test_render_chat_uses_the_template(tokenizer):
    text = render_chat(tokenizer, [{"role": "user", "content": "Hi"}])
    assert "Hi" in text and "<|im_start|>" in text
