"""A checkpoint directory beside the tiny Qwen2 model whose chat template renders tools,
assistant tool calls and tool results the way Qwen 2.5's does, and opens ``<think>`` when
``enable_thinking`` is set (as Qwen3's thinking templates do)."""

from __future__ import annotations

import json
from pathlib import Path

TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{{ messages[0].content if messages[0].role == 'system' else 'You are helpful.' }}"
    "\n\n# Tools\n<tools>{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>"
    "\nFor each function call, return a json object within <tool_call></tool_call> tags."
    "<|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}"
    "<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{{ message.content or '' }}{%- for tc in message.tool_calls %}\n<tool_call>\n"
    "{\"name\": \"{{ tc.function.name }}\", \"arguments\": {{ tc.function.arguments | tojson }}}"
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking %}<think>\n{%- endif %}{%- endif %}"
)


def tools_model_dir(tiny_dir: Path, out: Path) -> Path:
    """``out`` holding links to ``tiny_dir``'s files and a tokenizer config with
    ``TOOLS_TEMPLATE``."""
    out.mkdir(parents=True, exist_ok=True)
    for f in tiny_dir.iterdir():
        if f.name != "tokenizer_config.json":
            (out / f.name).symlink_to(f)
    config = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOLS_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out
