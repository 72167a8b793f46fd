"""Prompt logprobs with many top entries: the detokenizer decodes each token's text once,
a stream sends them twice (the chunk that brings them, the final one) instead of with
every chunk, and nothing is kept after the request."""

from __future__ import annotations

import asyncio
import gc
import json

import msgspec
import pytest

from radixlm.runtime.entrypoints.http_utils import sse
from radixlm.runtime.executor.sampling_params import SamplingParams
from radixlm.runtime.managers.detokenizer import DetokenizerManager, make_register
from radixlm.runtime.managers.messages import (
    BatchOutput,
    GenerateReqInput,
    RegisterReqs,
    ReqOutput,
    TextBatch,
    TextOutput,
    decode,
    encode,
)
from radixlm.runtime.managers.tokenizer_manager.heap_trim import HeapTrimmer, logprob_entries
from radixlm.runtime.managers.tokenizer_manager.result import ResultBuilder
from radixlm.runtime.tokenizer import load_tokenizer

PROMPT, TOP, CHUNKS = 300, 16, 20


class CountingTokenizer:
    def __init__(self, real) -> None:
        self.real, self.decodes = real, 0

    def __getattr__(self, name):
        return getattr(self.real, name)

    def decode(self, ids, **kwargs):
        self.decodes += 1
        return self.real.decode(ids, **kwargs)


def _outputs(rid: str) -> list[ReqOutput]:
    """A request's outputs: the first brings the prompt's logprobs, then one token each."""
    top = [[(-0.5 - j, (i * 7 + j) % 50 + 3) for j in range(TOP)] for i in range(PROMPT)]
    outs = []
    for k in range(CHUNKS):
        out = ReqOutput(rid, [40 + k], PROMPT, 0, k + 1,
                        {"type": "length"} if k == CHUNKS - 1 else None)
        out.output_token_logprobs = [(-1.0, 40 + k)]
        out.output_top_logprobs = [[(-1.0, 40 + k)] * TOP]
        if k == 0:
            out.input_token_logprobs = [(None if i == 0 else -2.0, 5) for i in range(PROMPT)]
            out.input_top_logprobs = top
        outs.append(out)
    return outs


def _stream(tokenizer, rid: str) -> list[bytes]:
    """The request through the detokenizer, the wire and a ResultBuilder, as a server
    streams it: the SSE chunks' bytes."""
    manager = DetokenizerManager(tokenizer)
    manager.handle(RegisterReqs([make_register(rid, SamplingParams(), True)]))
    builder = ResultBuilder(rid, True, TOP)
    chunks = []
    for out in _outputs(rid):
        batch = decode(encode(manager.handle(BatchOutput([out]))))
        assert isinstance(batch, TextBatch)
        builder.add(batch.outputs[0])
        chunks.append(sse(builder.chunk(0.0, cumulative=True)))
    assert not manager.reqs
    return chunks


def test_each_token_text_is_decoded_once(tiny_llama_dir):
    tok = CountingTokenizer(load_tokenizer(str(tiny_llama_dir)))
    _stream(tok, "r")
    # 300 x 17 prompt entries and 20 x 17 output entries name 71 distinct tokens; the
    # text of the output is decoded a few times per chunk
    assert tok.decodes < 71 + 4 * CHUNKS


def test_stream_sends_prompt_logprobs_with_first_and_final_chunk(tiny_llama_dir):
    chunks = _stream(load_tokenizer(str(tiny_llama_dir)), "r")
    metas = [json.loads(c[6:])["meta_info"] for c in chunks]
    first, final = metas[0], metas[-1]
    assert len(first["input_top_logprobs"]) == PROMPT == len(final["input_token_logprobs"])
    assert first["input_top_logprobs"] == final["input_top_logprobs"]
    assert first["input_top_logprobs"][1][0][2] is not None  # text in logprobs
    assert all(m["input_top_logprobs"] is None for m in metas[1:-1])
    # bytes: linear in the prompt (twice), not chunks x prompt
    assert sum(map(len, chunks)) < 3 * len(chunks[0])


def test_builders_keep_nothing_after_the_request(tiny_llama_dir):
    """Live Python objects do not grow across rounds of requests."""
    tok = load_tokenizer(str(tiny_llama_dir))
    counts = []
    for r in range(4):
        _stream(tok, f"r{r}")
        gc.collect()
        counts.append(len(gc.get_objects()))
    # a leaked request would keep its 300 x 17 prompt entries (thousands of objects) per
    # round; a few objects of a thread left running by an earlier test of the suite may
    # come and go meanwhile
    assert counts[-1] - counts[1] < 100, counts


def test_heap_is_trimmed_once_after_large_logprob_answers():
    msg = GenerateReqInput("r", [5] * 4000, {}, return_logprob=True, logprob_start_len=0,
                           top_logprobs_num=64)
    big = TextOutput("r", "", [], 4000, 0, 1, {"type": "length"})
    assert logprob_entries(msg, big) == 4001 * 65
    small = msgspec.structs.replace(msg, return_logprob=False)

    async def main(trimmer: HeapTrimmer) -> None:
        trimmer.note_finished(small, big)
        assert trimmer._handle is None  # nothing worth a trim
        for _ in range(3):  # three finish together: one trim
            trimmer.note_finished(msg, big)
        while trimmer.trims == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)

    trimmer = HeapTrimmer(delay=0.0)
    if trimmer._trim is None:
        pytest.skip("not glibc: nothing to trim")
    asyncio.run(main(trimmer))
    assert trimmer.trims == 1
