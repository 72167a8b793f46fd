"""Which waiting requests run next: ordering policies and the prefill admission budget."""

from __future__ import annotations

import itertools
from collections import defaultdict

from radixlm.radix_cache.radix_tree import RadixCache, TreeNode
from radixlm.runtime.managers.scheduler.cache_manager import CacheManager
from radixlm.runtime.managers.scheduler.schedule_batch import Req

# Past this many waiting requests, prefix-aware orders cost more than they win (SGLang).
PREFIX_POLICY_QUEUE_LIMIT = 128
# Waiting requests whose next this-many uncached tokens equal those of a request ahead of
# them wait one step, so that the shared part is computed once and then matched.
IN_BATCH_PREFIX_TOKENS = 32
# Decode tokens a running request is assumed to still need, at most (times new_token_ratio).
CLIP_MAX_NEW_TOKENS = 4096


class SchedulePolicy:
    """Orders the waiting queue: ``lpm`` (longest cached prefix first), ``dfs-weight``
    (depth-first over the tree, heaviest subtrees first, so requests sharing a prefix run
    together), ``fcfs`` (arrival order) or ``lof`` (longest output first).

    With priority scheduling (``priority_sign`` not None) requests are ordered by priority
    first and by the policy among equals: ``priority_sign`` is -1 when higher values are
    more urgent (SGLang's default), 1 with ``--schedule-low-priority-values-first``."""

    def __init__(self, policy: str, cache: CacheManager, priority_sign: int | None = None
                 ) -> None:
        assert priority_sign in (None, 1, -1), f"priority_sign {priority_sign}"
        self.policy = policy
        self.cache = cache
        self.priority_sign = priority_sign

    def urgency(self, req: Req) -> int:
        """Sort key of ``req``'s priority: smaller runs first (0 without priorities)."""
        return 0 if self.priority_sign is None else req.priority * self.priority_sign

    def preemption_victims(self, req: Req, running: list[Req], threshold: int) -> list[Req]:
        """The running requests ``req`` may preempt, least urgent (then newest) first: those
        less urgent than it by more than ``threshold`` (SGLang's rule)."""
        mine = self.urgency(req)
        ranked = sorted(running, key=lambda r: (-self.urgency(r), -r.arrival_time))
        return list(itertools.takewhile(lambda r: self.urgency(r) - mine > threshold, ranked))

    def queue_victim(self, req: Req, queued: list[Req]) -> Req | None:
        """With priorities, the queued request a full queue drops for ``req``: the least
        urgent (the newest among equals), if ``req`` is strictly more urgent; None: ``req``
        itself is refused (SGLang's rule for ``--max-queued-requests``)."""
        if self.priority_sign is None or not queued:
            return None
        victim = max(queued, key=lambda r: (self.urgency(r), r.arrival_time))
        return victim if self.urgency(req) < self.urgency(victim) else None

    def order(self, waiting: list[Req], ahead: list[Req] | None = None) -> list[Req]:
        """``waiting`` in the order to admit them. ``ahead``: requests already computing
        this step (a chunked prompt's next chunk); a waiting request about to compute the
        same uncached tokens as one of them waits a step too."""
        ordered, prefix = self._order_by_policy(waiting)
        if self.priority_sign is not None:
            ordered.sort(key=self.urgency)  # stable: the policy's order among equals
        if prefix is None:
            return ordered
        ahead = ahead or []
        prefix.update({r.rid: self.cache.match(r) for r in ahead})
        return self._defer_in_batch_duplicates(ordered, prefix, ahead)

    def _order_by_policy(self, waiting: list[Req]) -> tuple[list[Req], dict[str, int] | None]:
        """The policy's order, and the cached prefix lengths when it looked them up."""
        policy = self.policy
        if policy in ("lpm", "dfs-weight") and (
            len(waiting) > PREFIX_POLICY_QUEUE_LIMIT or self.cache.tree.disable
        ):
            policy = "fcfs"
        if policy == "fcfs":
            return list(waiting), None
        if policy == "lof":
            return sorted(waiting, key=lambda r: -r.sampling_params.max_new_tokens), None
        prefix = {r.rid: self.cache.match(r) for r in waiting}
        if policy == "lpm":
            return sorted(waiting, key=lambda r: -prefix[r.rid]), prefix
        return self._dfs_weight(waiting), prefix

    @staticmethod
    def _defer_in_batch_duplicates(ordered: list[Req], prefix: dict[str, int],
                                   ahead: list[Req]) -> list[Req]:
        """Drop, for this step, requests that would compute the same uncached tokens as a
        request ahead of them (in ``ordered``, or computing already: ``ahead``); next step
        they find those tokens in the tree."""
        def key(r: Req) -> tuple:
            m = prefix[r.rid]
            return r.namespace, m, tuple(r.fill_ids[m: m + IN_BATCH_PREFIX_TOKENS])

        seen: set[tuple] = {key(r) for r in ahead}
        keep = []
        for r in ordered:
            k = key(r)
            if len(k[2]) == IN_BATCH_PREFIX_TOKENS and k in seen:
                continue
            seen.add(k)
            keep.append(r)
        return keep

    def _dfs_weight(self, waiting: list[Req]) -> list[Req]:
        tree: RadixCache = self.cache.tree
        by_node: dict[int, list[Req]] = defaultdict(list)
        nodes: dict[int, TreeNode] = {}
        for r in waiting:
            node = tree.match_prefix(r.fill_ids[: r.max_cached_prefix()], r.namespace).last_node
            by_node[id(node)].append(r)
            nodes[id(node)] = node
        weight: dict[int, int] = defaultdict(int)
        for nid, reqs in by_node.items():
            node: TreeNode | None = nodes[nid]
            while node is not None:
                weight[id(node)] += len(reqs)
                node = node.parent
        out: list[Req] = []
        stack = [tree.root]
        while stack:
            node = stack.pop()
            out.extend(by_node.get(id(node), ()))
            kids = [c for c in node.children.values() if weight[id(c)] > 0]
            kids.sort(key=lambda c: weight[id(c)])  # heaviest popped first
            stack.extend(kids)
        return out


def decode_reserve(req: Req, new_token_ratio: float) -> int:
    """KV tokens to keep free for the decode tokens ``req`` is expected to still produce."""
    return int(min(req.remaining_new_tokens(), CLIP_MAX_NEW_TOKENS) * new_token_ratio)


class PrefillAdder:
    """Admits requests into one prefill batch under three budgets: KV memory (keeping room
    for the decode tokens of running requests), tokens in this forward
    (``chunked_prefill_size``), and new prompt tokens per batch (``max_prefill_tokens``)."""

    def __init__(self, cache: CacheManager, running: list[Req], new_token_ratio: float,
                 chunk_budget: int | None, max_prefill_tokens: int) -> None:
        self.cache = cache
        self.new_token_ratio = new_token_ratio
        self.reserved = sum(decode_reserve(r, new_token_ratio) for r in running)
        self.rem_chunk = chunk_budget  # None: no chunking
        self.rem_input = max_prefill_tokens
        self.has_running = bool(running)
        self.reqs: list[Req] = []
        self.extend_lens: list[int] = []
        self.chunked_req: Req | None = None  # the one request whose prompt was cut

    def rem_total(self) -> int:
        return self.cache.available_size() - self.reserved

    def estimated_cost(self, req: Req) -> int:
        """KV tokens admitting ``req`` is expected to take: its uncached prompt, the decode
        tokens it may still produce, and a page of rounding."""
        est_extend = req.seq_len - self.cache.match(req)
        return est_extend + decode_reserve(req, self.new_token_ratio) + self.cache.page_size

    def unreserve(self, req: Req) -> None:
        """A running request left the batch (preempted): its decode reserve is free."""
        self.reserved -= decode_reserve(req, self.new_token_ratio)

    def add_chunked(self, req: Req) -> None:
        """Continue the prefill of an admitted request whose prompt was cut last step."""
        self._extend(req, req.seq_len - req.kv_len, admitted=True)

    def full(self) -> bool:
        """No more requests fit in this batch."""
        return (self.chunked_req is not None or self.rem_input <= 0
                or (self.rem_chunk is not None and self.rem_chunk <= 0))

    def add(self, req: Req) -> bool:
        """Try to admit ``req`` (maybe with only a first chunk of its prompt); False if it
        does not fit, and nothing changed."""
        if self.full():
            return False
        first = not self.has_running and not self.reqs
        if not first and self.estimated_cost(req) > self.rem_total():
            return False
        if not self.cache.admit(req):  # no free request row
            return False
        return self._extend(req, req.seq_len - req.kv_len, admitted=False)

    def _extend(self, req: Req, want: int, admitted: bool) -> bool:
        n = want
        if self.rem_chunk is not None:
            n = min(n, self.rem_chunk)
        if self.reqs or admitted:
            n = min(n, self.rem_input)
        if self.cache.max_extend is not None:  # the SWA pool: one forward's sliding slots
            n = min(n, self.cache.max_extend)
        stop = 0 if self.cache.snapshots is None else self.cache.snapshots.stop(req)
        if req.kv_len < stop < req.kv_len + n:  # a chunk ends there: its state is saved
            n = stop - req.kv_len
        if n <= 0 or not self.cache.alloc(req, n):
            if not admitted:
                self.cache.release(req, cache=False)
            return False
        self.reqs.append(req)
        self.extend_lens.append(n)
        if n < want:
            self.chunked_req = req
        if self.rem_chunk is not None:
            self.rem_chunk -= n
        self.rem_input -= n
        self.reserved += decode_reserve(req, self.new_token_ratio)
        return True
