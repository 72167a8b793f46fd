"""Choice rules on hand-made logprobs, and role markers derived from chat templates."""

from __future__ import annotations

import pytest

import radixlm as sgl
from radixlm.frontend_dsl.chat_template import from_jinja, resolve_chat_template
from radixlm.frontend_dsl.tracer import extract_prefix


def _decide(rule, rows, uncond=None):
    entries = [[[lp, i, None] for i, lp in enumerate(r)] for r in rows]
    u = None if uncond is None else [[[lp, i, None] for i, lp in enumerate(r)] for r in uncond]
    norm = [sum(r) / len(r) for r in rows]
    return rule(
        choices=["a", "b", "c"][: len(rows)],
        normalized_prompt_logprobs=norm,
        input_token_logprobs=entries,
        output_token_logprobs=[[] for _ in rows],
        unconditional_token_logprobs=u,
    ).decision


def test_token_length_normalized_and_ties_go_first():
    assert _decide(sgl.token_length_normalized, [[-2.0, -2.0], [-1.0, -2.0]]) == "b"
    assert _decide(sgl.token_length_normalized, [[-1.0], [-0.5, -1.5], [-1.0]]) == "a"


def test_greedy_token_selection():
    # first tokens tie between a and b; b wins on the second token; c loses at once
    assert _decide(sgl.greedy_token_selection, [[-1.0, -3.0], [-1.0, -2.0], [-2.0]]) == "b"
    assert _decide(sgl.greedy_token_selection, [[-1.0], [-1.0], [-5.0]]) == "a"


def test_unconditional_likelihood_normalized():
    rows = [[-1.0, -1.0], [-2.0, -2.0]]
    uncond = [[None, -0.5], [None, -4.0]]  # b is much likelier given the prefix than alone
    assert _decide(sgl.unconditional_likelihood_normalized, rows, uncond) == "b"
    with pytest.raises(ValueError, match="unconditional"):
        _decide(sgl.unconditional_likelihood_normalized, rows)


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
    "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% endif %}"
)
NO_SYSTEM = (
    "{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('no system role') }}{% endif %}[{{ m['role'] }}]"
    "{{ m['content'] }}[/{{ m['role'] }}]{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def test_roles_from_jinja_templates():
    t = from_jinja(CHATML)
    assert t.roles["user"] == ("<|im_start|>user\n", "<|im_end|>\n")
    assert t.roles["system"] == ("<|im_start|>system\n", "<|im_end|>\n")
    assert t.stop_str == ("<|im_end|>",) and t.preamble == ""
    t = from_jinja(LLAMA3, bos_token="<|begin_of_text|>")
    assert t.preamble == "<|begin_of_text|>"
    assert t.roles["assistant"] == (
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "<|eot_id|>",
    )
    assert t.stop_str == ("<|eot_id|>",)
    t = from_jinja(NO_SYSTEM)
    assert t.roles["system"] == t.roles["user"] == ("[user]", "[/user]")


def test_unusable_template_falls_back_to_a_named_one():
    assert resolve_chat_template("{{ messages | length }}").name == "chatml"
    assert resolve_chat_template(None, "/models/Meta-Llama-3-8B").name == "llama-3-instruct"
    assert resolve_chat_template(None, fallback="default").name == "default"
    with pytest.raises(ValueError, match="unknown chat template"):
        resolve_chat_template(None, fallback="nope")


def test_tracer_stops_at_the_first_non_constant():
    tpl = from_jinja(CHATML)

    def prog(s, question, n):
        s += sgl.system("Be brief.")
        s += sgl.user("Q: " + question)
        s += sgl.assistant(sgl.gen("a"))

    assert extract_prefix(prog, {}, tpl) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQ: "
    )
    assert extract_prefix(prog, {"question": "why?"}, tpl).endswith(
        "Q: why?<|im_end|>\n<|im_start|>assistant\n"
    )

    def branchy(s, flag):
        s += "Intro. "
        if flag:
            s += "yes"

    assert extract_prefix(branchy, {}, tpl) == "Intro. "
