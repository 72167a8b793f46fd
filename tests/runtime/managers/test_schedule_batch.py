"""ScheduleBatch.worker_batch: the executor's view of a step carries the right rows,
lengths and new tokens (prompt chunks, decode rows, tokens appended by jump-forward)."""

from radixlm.runtime.executor.sampling_params import SamplingParams
from radixlm.runtime.executor.worker_batch import ModelWorkerBatch
from radixlm.runtime.managers.scheduler.schedule_batch import Req, ScheduleBatch


def make_req(rid: str, prompt: list[int], out: list[int], kv_len: int, row: int) -> Req:
    req = Req(rid, prompt, SamplingParams())
    req.output_ids = list(out)
    req.kv_len = kv_len
    req.req_pool_idx = row
    return req


def test_decode_rows():
    a = make_req("a", [1, 2, 3], [7, 8], kv_len=4, row=5)
    b = make_req("b", [4, 5], [9], kv_len=2, row=0)
    wb = ScheduleBatch([a, b], [1, 1], [(0, 1), (0, 1)], prefix_groups=[(2, [0, 1])])
    assert wb.is_decode
    assert wb.worker_batch() == ModelWorkerBatch(
        is_decode=True, req_pool_indices=[5, 0], prefix_lens=[4, 2], extend_lens=[1, 1],
        input_ids=[8, 9], logit_ranges=[(0, 1), (0, 1)], prefix_groups=[(2, [0, 1])])


def test_mixed_prefill_chunk_and_jump_forward_rows():
    chunk = make_req("c", list(range(100, 110)), [], kv_len=4, row=1)  # second chunk: 4..8
    jumped = make_req("j", [1, 2], [3, 4, 5, 6], kv_len=3, row=2)  # 3 forced tokens + last
    decode = make_req("d", [1], [2], kv_len=1, row=3)
    batch = ScheduleBatch([chunk, jumped, decode], [4, 3, 1], [(3, 4), (2, 3), (0, 1)],
                          num_prefill=1)
    assert not batch.is_decode
    wb = batch.worker_batch()
    assert wb.input_ids == [104, 105, 106, 107, 4, 5, 6, 2]
    assert wb.prefix_lens == [4, 3, 1] and wb.extend_lens == [4, 3, 1]
    assert wb.req_pool_indices == [1, 2, 3] and len(wb) == 3 and wb.num_tokens == 8
