"""The messages the prefill and decode sides exchange (msgpack through msgspec; never
pickle), and their encoding. Their order in a transfer: ``base.py``."""

from __future__ import annotations

import msgspec


class StateLayer(msgspec.Struct, frozen=True):
    """One linear-attention layer's recurrent state of one sequence, as it travels: a
    ``conv`` frame ``conv_shape`` of ``conv_dtype``, then an ``ssm`` frame ``ssm_shape`` of
    ``ssm_dtype`` (``StatePool.slot_layout``)."""

    layer: int
    conv_shape: tuple[int, ...]
    conv_dtype: str
    ssm_shape: tuple[int, ...]
    ssm_dtype: str


class KVLayout(msgspec.Struct, frozen=True):
    """What both sides must agree on for pages to be copied slot for slot. ``model``
    (``ModelConfig.kv_identity``): pages of another model with the same geometry (a
    Mistral and a Llama of one size) are refused too, not decoded into wrong tokens.
    ``state``: a hybrid model's recurrent state, per linear layer (empty: no state pool)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_size: int
    model: str = ""  # empty: a pool without a model (unit tests)
    state: tuple[StateLayer, ...] = ()


class RouteQuery(msgspec.Struct, tag=True):
    """decode -> prefill's bootstrap service: where is your transfer endpoint?"""


class RouteInfo(msgspec.Struct, tag=True):
    """bootstrap service -> decode: the transfer port of each data-parallel replica of the
    prefill server (on the same host; room ``r``'s KV is on replica ``r mod len``, where
    the prefill server placed it) and the layout."""

    transfer_ports: list[int]
    layout: KVLayout


class Register(msgspec.Struct, tag=True):
    """prefill replica ``dp_rank`` > 0 -> the bootstrap service (replica 0's): my transfer
    port. The service answers RouteQuery once every replica registered."""

    dp_rank: int
    transfer_port: int


class Claim(msgspec.Struct, tag=True):
    """decode -> prefill: send room ``room``'s prompt KV from position ``prefix_len`` (the
    decode side's cached, page-aligned prefix): ``num_tokens`` slots are reserved."""

    room: int
    prompt_len: int
    prefix_len: int
    num_tokens: int


class KVChunk(msgspec.Struct, tag=True):
    """prefill -> decode: tokens ``offset .. offset + num_tokens`` of the claimed range, then
    2 * num_layers frames; the last chunk carries the first sampled token."""

    room: int
    offset: int
    num_tokens: int
    last: bool
    first_token: int | None = None
    # with return_logprob: the first token's logprob, its top logprobs (top_logprobs_num)
    # and the logprobs of token_ids_logprob's ids, as (logprob, id) pairs
    first_logprob: float | None = None
    first_top_logprobs: list[tuple[float, int]] | None = None
    first_ids_logprobs: list[tuple[float, int]] | None = None


class StateChunk(msgspec.Struct, tag=True):
    """prefill -> decode, a hybrid model's only, before the room's first KVChunk: the
    request's recurrent state at the end of its prompt, then 2 * len(KVLayout.state)
    frames (conv then ssm of each linear layer, in ``KVLayout.state``'s order)."""

    room: int


class Ack(msgspec.Struct, tag=True):
    """decode -> prefill: every chunk of ``room`` is in place."""

    room: int


class Abort(msgspec.Struct, tag=True):
    """either way: the room is dead, and why."""

    room: int
    reason: str


WireMsg = RouteQuery | RouteInfo | Register | Claim | StateChunk | KVChunk | Ack | Abort
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(WireMsg)


def encode(msg: WireMsg) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes | memoryview) -> WireMsg:
    return _decoder.decode(data)

