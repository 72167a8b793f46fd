"""Which room each sample of a request uses (both servers compute the same answer).

sglang-router puts ``bootstrap_host`` / ``bootstrap_port`` / ``bootstrap_room`` in a
request as one value, or as lists of one value per item of a batch (a list ``text`` or
``prompt``) or per choice (chat ``n``). radixlm splits a request into items and each item
into its ``n`` samples; sample ``j`` of an item whose room is ``r`` uses room
``(r + j) mod 2**63``, so a single room given for ``n > 1`` (a native ``/generate`` with
``sampling_params.n``, where the router sees no batch) still gives each sample its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixlm.runtime.disaggregation.base import ROOM_LIMIT


@dataclass(frozen=True)
class Bootstrap:
    """Where one sample's KV comes from (decode) or which room it goes to (prefill)."""

    host: str
    port: int
    room: int
    prefill_dp_rank: int | None = None  # None: room mod the prefill server's --dp-size


def _per_item(value: Any, name: str, items: int, samples: list[int]) -> list[Any]:
    """One value per item: a scalar for all, a list per item, or (one item) per sample."""
    if not isinstance(value, list):
        return [value] * items
    if len(value) == items:
        return value
    if items == 1 and len(value) == samples[0]:
        return [value]  # one list, a value per sample
    raise ValueError(f"{name} has {len(value)} values; the request has {items} item(s) "
                     f"and {sum(samples)} sample(s)")


def assign_rooms(host: Any, port: Any, room: Any, samples: list[int],
                 default_port: int) -> list[list[Bootstrap]]:
    """``samples[i]``: item i's ``n``. Returns each item's samples' Bootstrap; ValueError
    names the field. ``port`` None (the router's when started without one) means
    ``default_port``."""
    items = len(samples)
    hosts = _per_item(host, "bootstrap_host", items, samples)
    ports = _per_item(port, "bootstrap_port", items, samples)
    rooms = _per_item(room, "bootstrap_room", items, samples)
    out = []
    for i, n in enumerate(samples):
        out.append([Bootstrap(_host(_pick(hosts[i], j)), _port(_pick(ports[i], j), default_port),
                              _room(rooms[i], j)) for j in range(n)])
    return out


def _pick(value: Any, j: int) -> Any:
    return value[j] if isinstance(value, list) else value


def _host(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"bootstrap_host must be a host name, got {value!r}")
    return value


def _port(value: Any, default: int) -> int:
    if value is None:
        return default
    if type(value) is not int or not 0 < value < 65536:
        raise ValueError(f"bootstrap_port must be a TCP port (1..65535), got {value!r}")
    return value


def _room(value: Any, j: int) -> int:
    if isinstance(value, list):
        value, j = value[j], 0
    if type(value) is not int or not 0 <= value < ROOM_LIMIT:
        raise ValueError(f"bootstrap_room must be an integer in [0, 2**63), got {value!r}")
    return (value + j) % ROOM_LIMIT
