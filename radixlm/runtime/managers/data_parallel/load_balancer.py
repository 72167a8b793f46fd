"""Which of ``--dp-size`` replicas serves each request: ``LoadBalancer``, the policy and
its bookkeeping, with no I/O. ``DataParallelController`` (the server's tokenizer manager,
``Engine(dp_size > 1)``) asks it ``select`` and tells it what was ``sent``, what
``finished``, each replica's ``ReplicaLoad`` and KV events, and which replica died
(``retire``).

Load of a replica = what it last reported (KV tokens in use + tokens its waiting requests
still have to compute) + the prompt tokens of requests sent to it that the report did not
count yet (``ReplicaLoad.received`` says how many it had read), so a burst is balanced
before the replica answers. Both count only what is not cached there: a prompt whose
prefix the replica holds (or is computing) costs it its uncached rest, so a burst of one
tenant on the replica that caches it does not look like a hot spot (counted in whole
prompts, a burst of 5 prompts of 450 tokens crossed the default 2,048-token threshold and
sent tenants' prompts to be recomputed elsewhere).

Methods (``--load-balance-method``):

- ``round_robin``: the next live replica in turn.
- ``shortest_queue``: the fewest requests (running + waiting + sent).
- ``minimum_tokens``: the least load in tokens.
- ``cache_aware``: the replica with the longest cached prefix of the prompt, unless its
  load exceeds the least loaded one's by more than ``abs_threshold`` tokens and by more
  than ``rel_threshold`` times (sglang-router's ``balance_abs_threshold`` /
  ``balance_rel_threshold``, which count requests), or no replica holds more than
  ``cache_threshold`` of the prompt (sglang-router's ``cache_threshold``): then the least
  loaded. The cached prefix is exact: a per-replica token-level index fed by the
  replica's own KV events (``PrefixIndex``), plus the prompts it is computing now (sent,
  not finished), which it will hold once their prefill ran. Pages in the shared storage
  tier (``--enable-hierarchical-cache``: their KV events say ``medium: DISK``) do not pick
  a replica, since every replica reads them, but count as cached in the load a request
  adds wherever it goes: they are loaded, not computed.

A request with a ``routing_key`` goes where the first request with that key went, while
that replica lives. On a prefill server (``--disaggregation-mode prefill``) a request with
a ``bootstrap_room`` r goes to replica r mod dp_size, where the decode server's claim for
the room is sent (``zmq_backend``).
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from radixlm.radix_cache.prefix_index import PrefixIndex
from radixlm.runtime.config import LOAD_BALANCE_METHODS, ServerArgs
from radixlm.runtime.managers.messages import GenerateReqInput, ReplicaLoad

MAX_ROUTING_KEYS = 1 << 16  # sticky routing keys remembered (least recently used dropped)
LCP_CHUNK = 64  # tokens compared at once (list slices compare in C)


class NoReplica(RuntimeError):
    """Every replica is dead."""


class CachedPrefixIndex(Protocol):
    """What ``LoadBalancer`` needs of an index of the replicas' cached blocks."""

    def apply(self, replica: int, batch: Any) -> None: ...

    def match_tiers(self, token_ids: Sequence[int], namespace: str | None
                    ) -> tuple[list[int], int]:
        """(cached prefix tokens per replica, prefix tokens in the shared storage tier)."""

    def drop_replica(self, replica: int) -> None: ...


@dataclass
class _Replica:
    rank: int
    live: bool = True
    num_reqs: int = 0  # as last reported
    num_tokens: int = 0
    received: int = 0  # requests it had read when it reported
    n_sent: int = 0
    unreported: collections.deque = field(default_factory=collections.deque)  # (seq, tokens)
    inflight: dict[str, GenerateReqInput] = field(default_factory=dict)

    def load_tokens(self) -> int:
        return self.num_tokens + sum(t for _, t in self.unreported)

    def load_reqs(self) -> int:
        return self.num_reqs + len(self.unreported)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i : i + LCP_CHUNK] == b[i : i + LCP_CHUNK]:
        i += LCP_CHUNK
    while i < n and a[i] == b[i]:
        i += 1
    return min(i, n)


class LoadBalancer:
    """The dispatch policy over ``dp_size`` replicas (see the module docstring)."""

    def __init__(self, dp_size: int, method: str = "cache_aware", abs_threshold: int = 2048,
                 rel_threshold: float = 1.5, index: CachedPrefixIndex | None = None,
                 cache_threshold: float = 0.3, by_room: bool = False) -> None:
        assert method in LOAD_BALANCE_METHODS, f"method={method!r}"
        self.by_room = by_room  # a prefill server: room r on replica r mod dp_size
        self.method = method
        self.cache_threshold = cache_threshold
        self.abs_threshold, self.rel_threshold = abs_threshold, rel_threshold
        self.index = index
        self.replicas = [_Replica(r) for r in range(dp_size)]
        self._turn = itertools.count()
        self._owner: dict[str, int] = {}  # rid -> rank, while in flight
        self._keys: collections.OrderedDict[str, int] = collections.OrderedDict()
        # (rid, cached tokens per replica) of the last cache_aware choice, for ``sent``
        self._last_match: tuple[str, list[int]] | None = None
        # cache_aware's choices: by cache, to the least loaded over imbalance, or on a miss
        self.decisions: collections.Counter[str] = collections.Counter()

    # --- choosing --------------------------------------------------------------------------
    def live(self) -> list[int]:
        return [r.rank for r in self.replicas if r.live]

    def select(self, msg: GenerateReqInput) -> int:
        """The replica for ``msg`` (raises NoReplica when none lives)."""
        live = self.live()
        if not live:
            raise NoReplica("every data-parallel replica is dead")
        if self.by_room and msg.bootstrap_room is not None:
            rank = room_replica(msg, len(self.replicas))  # where the decode side looks
            if rank not in live:
                raise NoReplica(f"bootstrap_room {msg.bootstrap_room} belongs to replica "
                                f"{rank}, which is not serving")
            return rank
        if msg.routed_dp_rank is not None:  # the client's choice, checked at the edge
            if msg.routed_dp_rank not in live:
                raise NoReplica(f"routed_dp_rank {msg.routed_dp_rank} is not serving")
            return msg.routed_dp_rank
        key = msg.routing_key
        if key is not None and self._keys.get(key) in live:
            self._keys.move_to_end(key)
            return self._keys[key]
        rank = self._choose(msg, live)
        if key is not None:
            self._keys[key] = rank
            self._keys.move_to_end(key)
            if len(self._keys) > MAX_ROUTING_KEYS:
                self._keys.popitem(last=False)
        return rank

    def _choose(self, msg: GenerateReqInput, live: list[int]) -> int:
        if len(live) == 1:
            return live[0]
        if self.method == "round_robin":
            start = next(self._turn)
            return min(live, key=lambda r: (r - start) % len(self.replicas))
        if self.method == "shortest_queue":
            return self._least(live, lambda r: self.replicas[r].load_reqs())
        if self.method == "minimum_tokens":
            return self._least(live, self.load)
        return self._cache_aware(msg, live)

    def _least(self, live: list[int], load: Any) -> int:
        """The least loaded replica; ties go round the replicas in turn."""
        start = next(self._turn)
        return min(live, key=lambda r: (load(r), (r - start) % len(self.replicas)))

    def _cache_aware(self, msg: GenerateReqInput, live: list[int]) -> int:
        # the shared storage tier serves every replica alike: it does not pick one, but
        # what it holds is loaded, not computed, wherever the request goes
        cached, stored = self._prefixes(msg.input_ids, msg.namespace)
        self._last_match = (msg.rid, [max(c, stored) for c in cached])
        least = self._least(live, self.load)
        best = max(live, key=lambda r: (cached[r], -self.load(r), r == least))
        if cached[best] <= self.cache_threshold * len(msg.input_ids):
            self.decisions["miss"] += 1
            return least
        if self.overloaded(best, least):
            self.decisions["balance"] += 1
            return least
        self.decisions["cache"] += 1
        return best

    def overloaded(self, rank: int, least: int) -> bool:
        """sglang-router's imbalance test, in tokens."""
        load, low = self.load(rank), self.load(least)
        return load - low > self.abs_threshold and load > low * self.rel_threshold

    def cached_tokens(self, token_ids: Sequence[int], namespace: str | None) -> list[int]:
        """Per replica: prompt tokens it holds (its index) or is computing (in flight)."""
        return self._prefixes(token_ids, namespace)[0]

    def _prefixes(self, token_ids: Sequence[int], namespace: str | None
                  ) -> tuple[list[int], int]:
        """(``cached_tokens``, the prompt's tokens in the shared storage tier)."""
        cached, stored = (self.index.match_tiers(token_ids, namespace)
                          if self.index is not None else ([0] * len(self.replicas), 0))
        cached = list(cached)
        for rep in self.replicas:
            for m in rep.inflight.values():
                if m.namespace == namespace and cached[rep.rank] < len(token_ids):
                    cached[rep.rank] = max(cached[rep.rank],
                                           common_prefix_len(m.input_ids, token_ids))
        return cached, stored

    def load(self, rank: int) -> int:
        return self.replicas[rank].load_tokens()

    # --- bookkeeping -------------------------------------------------------------------------
    def sent(self, rank: int, msg: GenerateReqInput) -> None:
        """``msg`` went to ``rank``: its uncached tokens there count as load until the
        replica reports it."""
        cached = 0
        if self._last_match is not None and self._last_match[0] == msg.rid:
            cached = min(self._last_match[1][rank], len(msg.input_ids))
        self._last_match = None
        rep = self.replicas[rank]
        rep.n_sent += 1
        rep.unreported.append((rep.n_sent, len(msg.input_ids) - cached))
        rep.inflight[msg.rid] = msg
        self._owner[msg.rid] = rank

    def owner(self, rid: str) -> int | None:
        return self._owner.get(rid)

    def finished(self, rid: str) -> None:
        rank = self._owner.pop(rid, None)
        if rank is not None:
            self.replicas[rank].inflight.pop(rid, None)

    def on_load(self, load: ReplicaLoad) -> None:
        rep = self.replicas[load.dp_rank]
        rep.num_reqs, rep.num_tokens, rep.received = load.num_reqs, load.num_tokens, load.received
        while rep.unreported and rep.unreported[0][0] <= load.received:
            rep.unreported.popleft()

    def on_kv_events(self, rank: int, batch: Any) -> None:
        if self.index is not None and self.replicas[rank].live:
            self.index.apply(rank, batch)

    def retire(self, rank: int) -> list[str]:
        """Take a dead replica out of rotation; returns the rids it was serving."""
        rep = self.replicas[rank]
        rep.live = False
        rids = list(rep.inflight)
        for rid in rids:
            self._owner.pop(rid, None)
        rep.inflight.clear()
        rep.unreported.clear()
        rep.num_reqs = rep.num_tokens = 0
        if self.index is not None:
            self.index.drop_replica(rank)
        return rids

    def loads(self) -> list[dict[str, Any]]:
        """Per replica, what the dispatcher counts (``/get_server_info`` shows it)."""
        return [{"dp_rank": r.rank, "live": r.live, "load_tokens": r.load_tokens(),
                 "load_reqs": r.load_reqs(), "inflight": len(r.inflight)}
                for r in self.replicas]


def room_replica(msg: GenerateReqInput, dp_size: int) -> int:
    """The replica of a prefill server that holds ``msg``'s room: ``routed_dp_rank``, else
    ``disagg_prefill_dp_rank``, else bootstrap_room mod dp_size (SGLang's placement; the
    front end refuses a routed_dp_rank the decode side would not look at)."""
    for rank in (msg.routed_dp_rank, msg.prefill_dp_rank):
        if rank is not None:
            return rank
    return msg.bootstrap_room % dp_size


def balancer_for(args: ServerArgs, dp_size: int) -> LoadBalancer:
    """The server's settings as a LoadBalancer (one replica: nothing to choose)."""
    method = args.balance_method if dp_size > 1 else "round_robin"
    index = PrefixIndex(dp_size, args.page_size) if method == "cache_aware" else None
    return LoadBalancer(dp_size, method, args.cache_aware_balance_abs_threshold,
                        args.cache_aware_balance_rel_threshold, index,
                        args.cache_aware_threshold, args.disaggregation_mode == "prefill"
                        or args.load_balance_method == "follow_bootstrap_room")
