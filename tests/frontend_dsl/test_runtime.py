"""``sgl.Runtime``: SGLang's launcher object. It starts ``radixlm serve``, programs run on
it (through its ``endpoint``, as SGLang unwraps it), and SGLang's direct calls work:
``generate`` returns the /generate JSON as a string, ``async_generate`` streams the same
text, ``get_tokenizer`` is the served model's; ``shutdown`` leaves no process behind."""

from __future__ import annotations

import asyncio
import json

import radixlm as sgl


def test_runtime_as_sglang_shapes_it(tiny_llama_dir):
    sp = {"max_new_tokens": 6, "temperature": 0}
    with sgl.Runtime(model_path=str(tiny_llama_dir), cpu_threads=1,
                     max_total_tokens=2048) as rt:
        out = json.loads(rt.generate("The capital of France is", sp))
        assert out["meta_info"]["completion_tokens"] == 6

        async def stream() -> list[str]:
            return [piece async for piece in rt.async_generate("The capital of France is", sp)]

        pieces = asyncio.run(stream())
        assert "".join(pieces) == out["text"] and len(pieces) >= 1

        tok = rt.get_tokenizer()
        assert tok.decode(tok.encode("hello world", add_special_tokens=False)) == "hello world"

        @sgl.function
        def complete(s, prompt):
            s += prompt + sgl.gen("answer", max_tokens=6, temperature=0)

        state = complete.run(prompt="The capital of France is", backend=rt)
        assert state["answer"] == out["text"]
        sgl.set_default_backend(rt)
        try:
            assert complete.run(prompt="The capital of France is")["answer"] == out["text"]
        finally:
            sgl.set_default_backend(None)
        info = asyncio.run(rt.get_server_info())
        assert "max_total_num_tokens" in info
        proc = rt.process
    assert proc.poll() is not None, "the server process outlived shutdown()"
