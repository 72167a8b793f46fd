"""``--tool-call-parser`` names (SGLang's, with vLLM's ``hermes``) -> formats."""

from __future__ import annotations

from radixlm.runtime.config_checks import TOOL_CALL_PARSERS
from radixlm.runtime.entrypoints.openai.function_call.core import ToolCallFormat
from radixlm.runtime.entrypoints.openai.function_call.harmony import HarmonyFormat
from radixlm.runtime.entrypoints.openai.function_call.hermes import HermesFormat
from radixlm.runtime.entrypoints.openai.function_call.llama3 import Llama3Format
from radixlm.runtime.entrypoints.openai.function_call.mistral import MistralFormat
from radixlm.runtime.entrypoints.openai.function_call.pythonic import PythonicFormat

FORMATS: dict[str, type[ToolCallFormat]] = {
    "qwen25": HermesFormat,
    "qwen": HermesFormat,
    "hermes": HermesFormat,
    "llama3": Llama3Format,
    "mistral": MistralFormat,
    "pythonic": PythonicFormat,
    "gpt-oss": HarmonyFormat,
}
assert tuple(FORMATS) == TOOL_CALL_PARSERS, (tuple(FORMATS), TOOL_CALL_PARSERS)


def tool_call_format(name: str) -> ToolCallFormat:
    """The format of ``--tool-call-parser name``; ValueError for an unknown name."""
    if name not in FORMATS:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                         f"got {name!r}")
    return FORMATS[name]()
