"""The torch side of an ``AttentionPlan`` (``shared_prefix``): padded passes, built once
per forward and run by every layer.

A pass pads a set of sequences to a common number of query rows and keys: ``q_rows`` and
``slots`` name each padded position's query row and KV slot, ``mask`` which keys each
query sees (the cached keys, then in extend the new tokens causally). A layer gathers K/V
by ``slots`` and runs torch's fused attention (``padded_sdpa``), or, where the rows are
merged with a shared prefix's pass afterwards, the flash kernel that also returns each
row's log-sum-exp (``padded_pass``); ``merge`` combines two such partials exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Padded:
    q_rows: torch.Tensor  # [g, lq] query row per (sequence, position); 0 where padding
    slots: torch.Tensor  # [g, lp] KV slot per (sequence, position); 0 where padding
    mask: torch.Tensor  # [g, lq, lp (+ lq in extend)] which keys each query sees
    out_rows: torch.Tensor  # [n_valid] rows written, in flattened (g, lq) order
    valid: torch.Tensor  # [n_valid] positions of the real rows in flattened (g, lq) order
    needs_lse: bool = True  # rows merged with a shared-prefix pass afterwards
    _bias: dict[int, torch.Tensor] = field(default_factory=dict)  # additive masks by group

    def bias(self, grp: int, dtype: torch.dtype) -> torch.Tensor:
        """The mask as an additive bias [g, 1, lq * grp, L] (rows: position, head of the
        KV head's group); built once per forward, used by every layer."""
        if grp not in self._bias:
            mask = self.mask.repeat_interleave(grp, dim=1)[:, None]
            self._bias[grp] = torch.zeros(mask.shape, dtype=dtype, device=mask.device
                                          ).masked_fill_(~mask, float("-inf"))
        return self._bias[grp]


def plan_groups(rows: list[torch.Tensor], slots: list[torch.Tensor]) -> Padded:
    """All groups as one padded pass: group i's query rows over its shared slots."""
    dev = slots[0].device
    r_lens = torch.tensor([len(r) for r in rows], device=dev)
    l_lens = torch.tensor([len(s) for s in slots], device=dev)
    q_ok = torch.arange(int(r_lens.max()), device=dev) < r_lens[:, None]
    p_ok = torch.arange(int(l_lens.max()), device=dev) < l_lens[:, None]
    q_rows = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    slot_t = torch.nn.utils.rnn.pad_sequence(slots, batch_first=True)
    mask = p_ok[:, None, :].expand(len(rows), q_rows.shape[1], -1).contiguous()
    valid = q_ok.reshape(-1)
    return Padded(q_rows, slot_t, mask, q_rows.reshape(-1)[valid], valid.nonzero()[:, 0])


def plan_padded(q_starts, kv_starts, q_lens, kv_lens, kv_indices, extend) -> Padded:
    dev = kv_indices.device
    g, lq, lp = len(q_lens), max(q_lens), max(kv_lens)
    q_pos = torch.arange(lq, device=dev)
    q_ok = q_pos < torch.tensor(q_lens, device=dev)[:, None]  # [g, lq]
    q_rows = (torch.tensor(q_starts, device=dev)[:, None] + q_pos).masked_fill(~q_ok, 0)
    p_pos = torch.arange(lp, device=dev)
    p_ok = p_pos < torch.tensor(kv_lens, device=dev)[:, None]  # [g, lp]
    slots = kv_indices[(torch.tensor(kv_starts, device=dev)[:, None] + p_pos)
                       .masked_fill(~p_ok, 0)] if lp else kv_indices.new_zeros((g, 0))
    mask = p_ok[:, None, :].expand(g, lq, lp)  # cached keys: seen by every query
    if extend:  # the new tokens, causally
        causal = (q_pos[None, :, None] >= q_pos[None, None, :]) & q_ok[:, None, :]
        mask = torch.cat((mask, causal.expand(g, lq, lq)), dim=2)
    valid = q_ok.reshape(-1)
    return Padded(q_rows, slots, mask.contiguous(), q_rows.reshape(-1)[valid],
                   valid.nonzero()[:, 0])


def padded_sdpa(p: Padded, q, k, v, k_buf, v_buf, sm_scale, out) -> None:
    """A pass whose rows need no log-sum-exp: torch's fused attention."""
    g, lq = p.q_rows.shape
    hq, hkv = q.shape[1], k_buf.shape[1]
    kk, vv = _rows(k_buf, p.slots), _rows(v_buf, p.slots)  # [g, lp, Hkv, D]
    if k is not None:  # new tokens rounded to the pool's dtype, as the pool holds them
        kk = torch.cat((kk, _rows(k, p.q_rows).to(kk.dtype)), dim=1)
        vv = torch.cat((vv, _rows(v, p.q_rows).to(vv.dtype)), dim=1)
    causal_only = k is not None and p.slots.shape[1] == 0 and p.valid.numel() == g * lq
    o = torch.nn.functional.scaled_dot_product_attention(
        _rows(q, p.q_rows).transpose(1, 2), kk.transpose(1, 2).to(q.dtype),
        vv.transpose(1, 2).to(q.dtype),
        attn_mask=None if causal_only else p.mask[:, None], is_causal=causal_only and lq > 1,
        scale=sm_scale, enable_gqa=hq != hkv)  # [g, Hq, lq, D]
    out[p.out_rows] = o.transpose(1, 2).reshape(g * lq, hq, -1).index_select(0, p.valid).float()


def _rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x[idx]`` for a 2-D index into the first dim, through index_select (faster)."""
    return x.index_select(0, idx.reshape(-1)).view(*idx.shape, *x.shape[1:])


def merge(o1, lse1, o2, lse2):
    """Combine two softmax-normalised partials over disjoint key sets."""
    m = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    total = w1 + w2
    o = (o1 * w1[..., None] + o2 * w2[..., None]) / total[..., None]
    return o, m + torch.log(total)


# torch's fused CPU attention that also returns the log-sum-exp (private, so guarded)
_FLASH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def padded_pass(p: Padded, q, k, v, k_buf, v_buf, sm_scale, out, lse_out) -> None:
    """One padded pass that also writes each row's log-sum-exp (for merging)."""
    g, lq = p.q_rows.shape
    hq, d = q.shape[1], q.shape[2]
    hkv = k_buf.shape[1]
    grp = hq // hkv
    kk, vv = _rows(k_buf, p.slots), _rows(v_buf, p.slots)  # [g, lp, Hkv, D]
    if k is not None:
        kk = torch.cat((kk, _rows(k, p.q_rows).to(kk.dtype)), dim=1)
        vv = torch.cat((vv, _rows(v, p.q_rows).to(vv.dtype)), dim=1)
    # the query heads of one KV head become rows: [g, Hkv, lq * grp, D], rows (pos, head)
    qq = _rows(q, p.q_rows).view(g, lq, hkv, grp, d).permute(0, 2, 1, 3, 4).reshape(g, hkv, -1, d)
    kk, vv = kk.transpose(1, 2).to(q.dtype), vv.transpose(1, 2).to(q.dtype)
    if (_FLASH_LSE is not None and q.device.type == "cpu"
            and q.dtype in (torch.float32, torch.bfloat16)):
        o, lse = _FLASH_LSE(qq, kk, vv, 0.0, False, attn_mask=p.bias(grp, q.dtype),
                            scale=sm_scale)
    else:
        s = torch.matmul(qq.float(), kk.float().transpose(-1, -2)) * sm_scale
        s = s + p.bias(grp, torch.float32)
        lse = torch.logsumexp(s, dim=-1)
        o = torch.matmul(torch.exp(s - lse[..., None]).nan_to_num_(0.0), vv.float())
    o = o.view(g, hkv, lq, grp, d).permute(0, 2, 1, 3, 4).reshape(g * lq, hq, d)
    lse = lse.view(g, hkv, lq, grp).permute(0, 2, 1, 3).reshape(g * lq, hq)
    out[p.out_rows] = o.index_select(0, p.valid).float()
    lse_out[p.out_rows] = lse.index_select(0, p.valid).float()
