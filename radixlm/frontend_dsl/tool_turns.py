"""The executor's side of tools: a gen that offers tools, the assistant turn that carries
its calls, and ``tool`` messages.

Once a program offers tools (or holds a call or a tool result), its conversation is what the
model's chat template renders: role markers cannot write tools, calls or tool results.
So at such a gen a native backend renders the messages so far with the gen's tools and the
generation prompt, and that rendering becomes the program's text (``s.text()`` is then
exactly the prompt the model saw); at the end of each later turn the text is rendered
again from the messages. The OpenAI backend sends the messages themselves (``render_chat``
returns None) and the text keeps the role markers.
"""

from __future__ import annotations

from typing import Any

from radixlm.frontend_dsl.ir import Gen, ToolResult
from radixlm.frontend_dsl.tools import ToolCall


class ToolTurns:
    """Mixin of ``StreamExecutor`` (which owns the attributes used here)."""

    tools_: list[dict[str, Any]] | None  # the tools of the last gen that offered some
    chat_rendered: bool  # the text is the chat template's rendering of the messages
    tool_calls_: dict[str, list[ToolCall]]  # a gen's calls, by its variable
    role_calls: list[ToolCall]  # calls made inside the open assistant turn

    def init_tool_state(self) -> None:
        self.tools_ = None
        self.chat_rendered = False
        self.tool_calls_ = {}
        self.role_calls = []

    def copy_tool_state(self, other: ToolTurns) -> None:
        self.tools_, self.chat_rendered = other.tools_, other.chat_rendered
        self.tool_calls_, self.role_calls = dict(other.tool_calls_), list(other.role_calls)

    def is_tool_gen(self, expr: Gen) -> bool:
        return expr.tools is not None or self.chat_rendered

    def tool_gen(self, expr: Gen, params: dict[str, Any], logprob_args: dict[str, Any]
                 ) -> None:
        """Run a gen that offers tools, or any gen of a conversation holding calls."""
        if self.cur_role != "assistant" or self.text_[self.cur_role_begin_pos:].strip():
            what = "with tools" if expr.tools is not None else "after a tool call"
            raise ValueError(
                f"gen({expr.name!r}) {what} must come first inside assistant(...): the "
                "model's chat template renders the conversation, its tools and calls")
        tools = expr.tools.tool_list if expr.tools is not None else None
        if tools is not None:
            self.tools_ = tools
        self.chat_rendered = True
        rendered = self.backend.render_chat(self.messages_, tools, True)
        if rendered is not None:
            self._replace_text(rendered)
            self.cur_role_begin_pos = len(rendered)
        prompt = self.prompt()
        self.inflight_rid = prompt.rid
        try:
            content, calls, meta = self.backend.generate_tools(
                prompt, params, logprob_args, expr.tools)
        finally:
            self.inflight_rid = None
        if self.error is not None:  # cancelled while the request ran
            raise self.error
        self._append(content)
        self.role_calls.extend(calls)
        if expr.name is not None:
            with self.cond:
                self.tool_calls_[expr.name] = calls
            self.set_var(expr.name, content, {**meta, "tool_calls": calls})

    def end_message(self, message: dict[str, Any], suffix: str) -> None:
        """Add a finished message: its calls go with an assistant turn; the text is the
        template's rendering of the messages once the conversation is rendered."""
        if message["role"] == "assistant" and self.role_calls:
            message["tool_calls"] = [c.to_openai() for c in self.role_calls]
        self.role_calls = []
        self.messages_.append(message)
        if self.chat_rendered:
            rendered = self.backend.render_chat(self.messages_, self.tools_, False)
            if rendered is not None:
                self._replace_text(rendered)
                return
        self._append(suffix)

    def tool_result(self, expr: ToolResult) -> None:
        if self.cur_role is not None:
            raise ValueError(f"tool_result() goes between turns, not inside {self.cur_role}()")
        known = [c["id"] for m in self.messages_ for c in m.get("tool_calls", ())]
        if expr.call_id not in known:
            raise ValueError(f"tool_result(): no tool call with id {expr.call_id!r} in this "
                             f"conversation (calls: {known or 'none'})")
        self.chat_rendered = True
        tpl = self.chat_template
        role = "tool" if "tool" in tpl.roles else "user"  # the markers, where none render
        self._append(tpl.prefix(role) + expr.content)
        message = {"role": "tool", "tool_call_id": expr.call_id, "content": expr.content}
        self.end_message(message, tpl.suffix(role))

    def _replace_text(self, text: str) -> None:
        with self.cond:
            self.text_ = text
            self.version += 1
            self.cond.notify_all()
