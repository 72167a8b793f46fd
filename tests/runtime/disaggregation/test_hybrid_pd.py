"""Hybrid models (linear-attention / Mamba2 layers beside attention) through prefill/decode
disaggregation: the request's recurrent state (every linear layer's conv and SSM state, its
state slot whole) travels with its KV pages.

The transfer in memory (fake transport): the slot arrives bit for bit; a decode server
whose state layout differs refuses the route by name; a missing or malformed state fails
the room. Then a prefill and a decode scheduler over zmq on loopback (``pd_sides``) for the
tiny Qwen3.5 and Nemotron-H checkpoints: greedy float32 tokens equal transformers' and a
plain scheduler's for a prompt longer than a chunk, for a second prompt the prefill server
starts from a snapshot in its radix cache, and for a third the decode server starts from a
snapshot in its own (the received state must replace it); with the received state zeroed
the tokens differ (the state, not a recomputation, carries them)."""

from __future__ import annotations

import pytest
import torch

from radixlm.radix_cache.state_pool import StatePool, StateSpec
from radixlm.runtime.config import ServerArgs
from radixlm.runtime.disaggregation.base import KVPoll
from radixlm.runtime.disaggregation.fake_backend import FakeNetwork, FakeTransport
from radixlm.runtime.disaggregation.kv_buffers import KVBuffers
from radixlm.runtime.disaggregation.manager import KVManager
from radixlm.runtime.disaggregation.wire import KVChunk, StateChunk
from radixlm.runtime.executor.hybrid import refuse_hybrid_features
from radixlm.runtime.managers.messages import GenerateReqInput
from radixlm.runtime.managers.scheduler.scheduler import Scheduler
from radixlm.runtime.model_config import ModelConfig
from radixlm.runtime.tokenizer import load_tokenizer
from radixlm.tiny_hybrids import make_hybrid_model
from radixlm.tiny_model import train_tokenizer
from tests.runtime.disaggregation.pd_client import secret_flags
from tests.runtime.disaggregation.pd_sides import Side, assert_clean, drive, pd_generate, pd_pair
from tests.runtime.greedy_oracle import hf_greedy

# --- the transfer, in memory ----------------------------------------------------------------
PAGE, POOL, ADDR = 4, 32, ("prefill-host", 8998)
SPECS = {0: StateSpec(12, 3, (2, 4, 4)), 2: StateSpec(12, 3, (2, 4, 4))}


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])


def buffers(seed: int, specs: dict[int, StateSpec] = SPECS, device: str = "cpu") -> KVBuffers:
    """A one-layer KV pool and a 4-slot state pool (conv bfloat16, ssm float32) of random
    numbers on ``device``."""
    g = torch.Generator().manual_seed(seed)
    k, v = ([torch.randn(POOL, 2, 8, generator=g).to(device)] for _ in range(2))
    states = StatePool(4, specs, torch.bfloat16, device)
    for i in specs:
        states.conv[i].copy_(torch.randn(states.conv[i].shape, generator=g))
        states.ssm[i].copy_(torch.randn(states.ssm[i].shape, generator=g))
    return KVBuffers(k, v, PAGE, model="tiny-hybrid", states=states)


def claimed(pbuf: KVBuffers, dbuf: KVBuffers, state_slot: int):
    """A prefill and a decode manager (fake transport) with room 7 claimed: 2 pages into
    decode slots 8..15, the state into ``state_slot``. (prefill, decode, sender, receiver)"""
    net = FakeNetwork()
    prefill = KVManager("prefill", pbuf, FakeTransport(net, pbuf.layout, ADDR), 10, 20)
    dec = KVManager("decode", dbuf, FakeTransport(net), 10, 20)
    sender, receiver = prefill.create_sender(7), dec.create_receiver(*ADDR, 7)
    turn(prefill, dec)
    if receiver.poll() == KVPoll.WaitingForInput:
        receiver.send_metadata(torch.arange(8, 16), 0, 7, state_slot)
        turn(prefill, dec)
    return prefill, dec, sender, receiver


def turn(*managers: KVManager) -> None:
    for _ in range(3):
        for m in managers:
            m.poll()


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_state_slot_travels_bit_for_bit(device):
    pbuf, dbuf = buffers(0, device=device), buffers(1, device=device)
    before = dbuf.states.read_slot(0)
    prefill, dec, sender, receiver = claimed(pbuf, dbuf, state_slot=3)
    sender.send(torch.arange(20, 28), first_token=5, prompt_len=7, state_slot=1)
    turn(prefill, dec)
    assert receiver.poll() == KVPoll.Success and sender.poll() == KVPoll.Success
    got, sent = dbuf.states.read_slot(3), pbuf.states.read_slot(1)
    sent[1].fill_(7.0)  # copies, not views of the pool: a frame in flight cannot change
    sent = pbuf.states.read_slot(1)
    assert len(got) == 2 * len(SPECS) and got[0].dtype == torch.bfloat16
    assert all(torch.equal(a, b) for a, b in zip(got, sent))
    assert all(torch.equal(a, b) for a, b in zip(dbuf.states.read_slot(0), before))
    assert torch.equal(dbuf.k[0][8:16], pbuf.k[0][20:28])
    assert dbuf.states.conv[0].device.type == device


def test_another_state_layout_is_refused_by_name():
    """Same pages, same model name, another SSM shape: the decode refuses the route before
    claiming, naming the state layouts."""
    other = {**SPECS, 2: StateSpec(12, 3, (2, 4, 8))}
    _, _, _, receiver = claimed(buffers(0), buffers(1, other), state_slot=0)
    assert receiver.poll() == KVPoll.Failed
    reason = receiver.failure_reason()
    assert "the servers' recurrent state layouts differ" in reason, reason
    assert "ssm_shape=(2, 4, 8)" in reason and "ssm_shape=(2, 4, 4)" in reason, reason


def _send_raw(prefill: KVManager, sender, frames_of_state: list[torch.Tensor] | None) -> None:
    """The sender's messages by hand: the state (if any) with ``frames_of_state``, then
    every page in one last chunk."""
    buf = prefill.buffers
    if frames_of_state is not None:
        prefill.transport.send(sender.peer, StateChunk(7), frames_of_state)
    prefill.transport.send(sender.peer, KVChunk(7, 0, 8, True, 5),
                           buf.gather(torch.arange(8)))


@pytest.mark.parametrize(("frames", "why"), [
    (None, "sent no recurrent state"),
    ("short", "state frame sizes"),
    ("few", "state frames, expected 4"),
])
def test_missing_or_malformed_state_fails_the_room(frames, why):
    pbuf, dbuf = buffers(0), buffers(1)
    before = dbuf.states.read_slot(2)
    prefill, dec, sender, receiver = claimed(pbuf, dbuf, state_slot=2)
    state = pbuf.states.read_slot(0)
    if frames == "short":
        state[3] = state[3][:1]
    elif frames == "few":
        state = state[:2]
    _send_raw(prefill, sender, state if frames else None)
    turn(prefill, dec)
    assert receiver.poll() == KVPoll.Failed and why in receiver.failure_reason()
    assert sender.poll() == KVPoll.Failed  # the decode's abort reached it
    assert all(torch.equal(a, b) for a, b in zip(dbuf.states.read_slot(2), before))


# --- a prefill and a decode scheduler, tiny hybrid checkpoints --------------------------------
ARCHS = ("qwen3_5", "nemotron_h")
MAX_NEW = 8
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}
COMMON = dict(max_total_tokens=2048, cpu_threads=1, random_seed=0, page_size=4,
              chunked_prefill_size=48, dtype="float32")
FIRST = 149  # + MAX_NEW - 1 = 156 computed tokens at the end: a page end, so its snapshot


@pytest.fixture(scope="module")
def secret(tmp_path_factory) -> str:
    return secret_flags(tmp_path_factory.mktemp("pd-key"))[1]


@pytest.fixture(scope="module", params=ARCHS)
def case(request, tmp_path_factory, secret):
    """(arch, checkpoint, prefill Side, decode Side, bootstrap port, first prompt and
    transformers' output for it)."""
    path = str(make_hybrid_model(tmp_path_factory.mktemp(request.param), request.param,
                                 tokenizer=train_tokenizer()))
    gen = torch.Generator().manual_seed(3)
    first = torch.randint(1, 1000, (FIRST,), generator=gen).tolist()
    prefill, dec, port = pd_pair(path, {**COMMON, "disaggregation_secret_file": secret})
    yield request.param, path, prefill, dec, port, first, hf_greedy(path, [first], MAX_NEW)[0]
    prefill.close()
    dec.close()


def _mono(path: str, prompts: list[list[int]]) -> list[list[int]]:
    """A plain scheduler's greedy outputs."""
    mono = Side(Scheduler(ServerArgs(**COMMON), path, load_tokenizer(path)))
    try:
        for i, p in enumerate(prompts):
            mono.inbox.append(GenerateReqInput(f"m{i}", p, dict(GREEDY)))
        drive(mono, until=lambda: all(mono.finished(f"m{i}") for i in range(len(prompts))))
        return [mono.ids(f"m{i}") for i in range(len(prompts))]
    finally:
        mono.close()


def test_tokens_match_transformers_and_a_plain_engine(case):
    """Cold (149 tokens in chunks of 48); a prompt sharing 100 of them (the prefill server
    starts it from a snapshot); the first prompt's whole sequence and 20 more tokens (the
    decode server matches 156 of them with its own snapshot, which the received state must
    replace)."""
    arch, path, prefill, dec, port, first, want_first = case
    gen = torch.Generator().manual_seed(4)
    tail = [torch.randint(1, 1000, (n,), generator=gen).tolist() for n in (30, 20)]
    got = pd_generate(prefill, dec, port, f"{arch}-cold", first, 1, GREEDY)
    assert got == want_first, f"{arch} cold: {got} != {want_first}"
    prompts = [first[:100] + tail[0], first + want_first[:-1] + tail[1]]
    expected = hf_greedy(path, prompts, MAX_NEW)
    for i, (p, want) in enumerate(zip(prompts, expected)):
        got = pd_generate(prefill, dec, port, f"{arch}-{i}", p, 2 + i, GREEDY)
        assert got == want, f"{arch} prompt {i}: {got} != transformers {want}"
    assert prefill.finished(f"{arch}-0").cached_tokens > 0  # from a prefill-side snapshot
    assert dec.finished(f"{arch}-1").cached_tokens == FIRST + MAX_NEW - 1
    assert _mono(path, [first, *prompts]) == [want_first, *expected]
    assert_clean(prefill, dec)


def test_decode_reads_the_transferred_state(case, monkeypatch):
    """The control: the received state zeroed as it is written gives other tokens (the
    first token is still the prefill's)."""
    arch, _, prefill, dec, port, first, want_first = case
    scatter = KVBuffers.scatter_state
    monkeypatch.setattr(KVBuffers, "scatter_state", lambda self, slot, frames: scatter(
        self, slot, [bytearray(memoryview(f).nbytes) if not isinstance(f, torch.Tensor)
                     else torch.zeros_like(f) for f in frames]))
    got = pd_generate(prefill, dec, port, f"{arch}-zeroed", first, 9, GREEDY)
    assert got[0] == want_first[0]
    assert got != want_first, f"{arch}: a zeroed state gave transformers' tokens"
    assert_clean(prefill, dec)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_hybrid_serves_with_a_mode(case, secret, mode):
    """Either side of a pair serves a hybrid (at --tp-size 1: one state pool to read or
    write)."""
    path = case[1]
    refuse_hybrid_features(ServerArgs(model_path=path, disaggregation_mode=mode,
                                      disaggregation_secret_file=secret),
                           ModelConfig.from_hf(path))
