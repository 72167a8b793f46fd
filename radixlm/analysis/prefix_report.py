"""``radixlm prefix-report``: where and why the prompts of a request log stop sharing a prefix.

1. **Families.** Prompts are grouped by the first ``family_chars`` characters of a
   normalized text (volatile values replaced by placeholders, JSON objects with sorted
   keys, whitespace collapsed), so one template is one family even when it starts with a
   timestamp.
2. **Divergence.** For each pair of consecutive prompts of a family (file order), the
   first differing character, the shared tokens (with a tokenizer) and the cause there
   (``volatile.classify``). The family's divergence points are grouped by where the
   volatile span starts and by cause.
3. **Hit rates.** The cache is simulated as the radix tree would share: each prompt's
   cached length is its longest common prefix with any earlier prompt of its namespace
   (at most its length - 1, rounded down to ``page_size``; the cache never evicts). Then
   every prompt is **rewritten** (each volatile span found against its predecessor moved
   to the end, JSON keys sorted, whitespace collapsed; repeated until the two differ in
   content) and the same simulation runs on the rewritten prompts: the hit rate the
   family would get with a stable prefix.

Units are tokens with ``--tokenizer``, else characters.
"""

from __future__ import annotations

import bisect
import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from radixlm.analysis.prompts import Prompt
from radixlm.analysis.volatile import (
    FIXES,
    PATTERNS,
    Cause,
    apply_fix,
    classify,
    common_prefix,
    context,
)

MAX_FIXES = 16  # volatile spans fixed per pair before giving up
TOP_POSITIONS = 3


@dataclass
class Divergence:
    """Where prompt ``index`` first differs from the previous prompt of its family."""

    index: int
    char: int  # first differing character
    start: int  # start of the volatile span (== char for content)
    tokens: int | None  # leading tokens the two share (with a tokenizer)
    kind: str
    context_prev: str
    context_this: str


@dataclass
class Family:
    key: str
    members: list[Prompt]
    divergences: list[Divergence] = field(default_factory=list)
    rewritten: dict[int, str] = field(default_factory=dict)  # index -> rewritten text


def normalize(text: str) -> str:
    """``text`` with JSON keys sorted, volatile values as placeholders, whitespace collapsed."""
    text = _sorted_json_objects(text)
    for kind, pattern in PATTERNS:
        text = pattern.sub(f"<{kind}>", text)
    return re.sub(r"\s+", " ", text).strip()


def _sorted_json_objects(text: str, limit: int = 4096) -> str:
    decoder = json.JSONDecoder()
    out, i = [], 0
    while (j := text.find("{", i, limit)) >= 0:
        try:
            obj, end = decoder.raw_decode(text, j)
        except ValueError:
            out.append(text[i:j + 1])
            i = j + 1
            continue
        out.append(text[i:j] + json.dumps(obj, sort_keys=True, ensure_ascii=False))
        i = end
    return "".join(out) + text[i:]


def families_of(prompts: list[Prompt], family_chars: int) -> list[Family]:
    groups: dict[str, list[Prompt]] = defaultdict(list)
    for p in prompts:
        head = normalize(p.text[:max(family_chars * 8, 2048)])[:family_chars]
        groups[f"{p.namespace}\x1f{head}"].append(p)
    return [Family(k.split("\x1f", 1)[1], v) for k, v in groups.items()]


def diverge(prev: Prompt, this: Prompt, encode: Any) -> Divergence | None:
    """The divergence of ``this`` from ``prev``; None if one is a prefix of the other."""
    a, b = prev.text, this.text
    p = common_prefix(a, b)
    if p >= min(len(a), len(b)):
        return None
    cause = classify(a, b, p)
    tokens = None if encode is None else common_prefix(encode(a), encode(b))
    sa, sb = cause.span_a, cause.span_b
    return Divergence(this.index, p, cause.start, tokens, cause.kind,
                      context(a, sa[0], max(sa[1], p + 1)), context(b, sb[0], max(sb[1], p + 1)))


def rewrite(prev: str, this: str) -> str:
    """``this`` with every volatile span that separates it from ``prev`` fixed (moved to
    the end, JSON keys sorted, whitespace collapsed), until the two differ in content."""
    moved: list[str] = []
    for _ in range(MAX_FIXES):
        p = common_prefix(prev, this)
        if p >= min(len(prev), len(this)):
            break
        cause: Cause = classify(prev, this, p)
        if cause.kind == "content":
            break
        prev, this, tail = apply_fix(cause, prev, this)
        if tail is not None:
            moved.append(tail)
    return this + ("\n" + "\n".join(moved) if moved else "")


def analyse_family(fam: Family, encode: Any) -> None:
    members = fam.members
    for k, this in enumerate(members):
        if k > 0:
            d = diverge(members[k - 1], this, encode)
            if d is not None:
                fam.divergences.append(d)
        ref = members[k - 1] if k > 0 else (members[1] if len(members) > 1 else None)
        fam.rewritten[this.index] = this.text if ref is None else rewrite(ref.text, this.text)


def simulate_cache(seqs: list[tuple[str, Any]], page_size: int) -> list[int]:
    """Cached length of each (namespace, sequence) in order: its longest common prefix with
    any earlier sequence of the namespace (found among its sorted neighbours), at most its
    length - 1, in whole pages."""
    seen: dict[str, list[Any]] = defaultdict(list)
    out = []
    for ns, seq in seqs:
        pool = seen[ns]
        i = bisect.bisect_left(pool, seq)
        best = max((common_prefix(pool[j], seq) for j in (i - 1, i) if 0 <= j < len(pool)),
                   default=0)
        best = min(best, max(len(seq) - 1, 0))
        out.append(best - best % page_size)
        pool.insert(i, seq)
    return out


def _rate(cached: int, total: int) -> float:
    return cached / total if total else 0.0


def family_summary(fam: Family, units: dict[int, int], now: dict[int, int],
                   fixed: dict[int, int], fixed_units: dict[int, int], unit: str
                   ) -> dict[str, Any]:
    idx = [p.index for p in fam.members]
    total, total_fixed = sum(units[i] for i in idx), sum(fixed_units[i] for i in idx)
    cached, cached_fixed = sum(now[i] for i in idx), sum(fixed[i] for i in idx)
    groups: dict[tuple[int, str], list[Divergence]] = defaultdict(list)
    for d in fam.divergences:
        groups[(d.start, d.kind)].append(d)
    ranked = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0][0]))[:TOP_POSITIONS]
    points = []
    for (start, kind), ds in ranked:
        tokens = Counter(d.tokens for d in ds).most_common(1)[0][0]
        points.append({"char": start, "tokens": tokens, "kind": kind, "pairs": len(ds),
                       "first_diff_char": Counter(d.char for d in ds).most_common(1)[0][0],
                       "context_prev": ds[0].context_prev, "context_this": ds[0].context_this,
                       "fix": FIXES[kind]})
    return {
        "family": fam.key, "requests": len(idx), "pairs": max(len(idx) - 1, 0),
        "diverging_pairs": len(fam.divergences), "unit": unit,
        "prompt_" + unit: total, "cached_" + unit: cached, "hit_rate": _rate(cached, total),
        "hit_rate_if_fixed": _rate(cached_fixed, total_fixed),
        "lost_" + unit: cached_fixed - cached, "divergence": points,
        "kinds": dict(Counter(d.kind for d in fam.divergences).most_common()),
    }


def prefix_report(prompts: list[Prompt], tokenizer: Any = None, family_chars: int = 48,
                  page_size: int = 1) -> dict[str, Any]:
    """The report as a JSON-ready dict (``render_text`` prints it)."""
    encode = None if tokenizer is None else (
        lambda t: tokenizer.encode(t, add_special_tokens=False))
    unit = "chars" if encode is None else "tokens"
    fams = families_of(prompts, family_chars)
    for fam in fams:
        analyse_family(fam, encode)
    rewritten = {i: t for fam in fams for i, t in fam.rewritten.items()}

    def seq(text: str) -> Any:
        return text if encode is None else tuple(encode(text))

    original = [seq(p.text) for p in prompts]
    fixed_seqs = [seq(rewritten[p.index]) for p in prompts]
    now = simulate_cache([(p.namespace, s) for p, s in zip(prompts, original)], page_size)
    fixed = simulate_cache([(p.namespace, s) for p, s in zip(prompts, fixed_seqs)], page_size)
    units = {p.index: len(s) for p, s in zip(prompts, original)}
    fixed_units = {p.index: len(s) for p, s in zip(prompts, fixed_seqs)}
    now_by, fixed_by = dict(zip(units, now)), dict(zip(units, fixed))
    summaries = [family_summary(f, units, now_by, fixed_by, fixed_units, unit) for f in fams]
    summaries.sort(key=lambda s: (-s["lost_" + unit], -s["requests"]))
    observed = [p for p in prompts if p.prompt_tokens and p.cached_tokens is not None]
    return {
        "requests": len(prompts), "families": len(fams), "unit": unit,
        "page_size": page_size, "family_chars": family_chars,
        "hit_rate": _rate(sum(now), sum(units.values())),
        "hit_rate_if_fixed": _rate(sum(fixed), sum(fixed_units.values())),
        "observed_hit_rate": _rate(sum(p.cached_tokens for p in observed),
                                   sum(p.prompt_tokens for p in observed)) if observed else None,
        "truncated_prompts": sum(p.truncated for p in prompts),
        "divergence_positions": [{"family": f.key, "char": d.start, "tokens": d.tokens,
                                  "kind": d.kind} for f in fams for d in f.divergences],
        "family_reports": summaries,
    }


def render_text(report: dict[str, Any], max_families: int = 10) -> str:
    unit = report["unit"]
    lines = [f"prefix-report: {report['requests']} requests in {report['families']} template "
             f"families (positions in {unit}; cache simulated with page size "
             f"{report['page_size']}, no eviction)",
             f"hit rate: {_pct(report['hit_rate'])} as sent; "
             f"{_pct(report['hit_rate_if_fixed'])} with the volatile parts moved to the end"]
    if report["observed_hit_rate"] is not None:
        lines.append(f"observed by the server (cached_tokens / prompt_tokens): "
                     f"{_pct(report['observed_hit_rate'])}")
    if report["truncated_prompts"]:
        lines.append(f"{report['truncated_prompts']} prompts were cut by the request log "
                     "(--log-requests-max-chars): only their kept part is analysed")
    for n, fam in enumerate(report["family_reports"][:max_families], 1):
        lines += _family_lines(n, fam, unit)
    hidden = len(report["family_reports"]) - max_families
    if hidden > 0:
        lines.append(f"\n... {hidden} more families (--json shows all)")
    return "\n".join(lines)


def _family_lines(n: int, fam: dict[str, Any], unit: str) -> list[str]:
    lines = [f"\nfamily {n}: {fam['requests']} requests, starting {fam['family']!r}",
             f"  hit rate {_pct(fam['hit_rate'])} -> {_pct(fam['hit_rate_if_fixed'])} if fixed "
             f"({fam['lost_' + unit]:+,} {unit} cached)"]
    if not fam["divergence"]:
        lines.append("  consecutive requests never diverge (identical or prefixes)")
    for pt in fam["divergence"]:
        where = f"char {pt['char']}" + ("" if pt["tokens"] is None
                                         else f" (after {pt['tokens']} shared tokens)")
        lines += [f"  diverges at {where} in {pt['pairs']} of {fam['pairs']} consecutive pairs:"
                  f" {pt['kind']}",
                  f"    before: {pt['context_prev']}", f"    after:  {pt['context_this']}",
                  f"    fix: {pt['fix']}"]
    return lines


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"

