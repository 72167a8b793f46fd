"""Canonical jump-forward: append the text a grammar forces, as the tokenizer would encode it.

Tokenizing the forced text on its own gives token sequences the model never sees in
training (``' '`` + ``'"'`` where the tokenizer's own encoding is one ``' "'`` token), so
the tokens of this step (the one just sampled, not yet sent to the client nor computed
into the KV cache) are encoded again together with the forced text; the matcher rolls
back to where the two encodings diverge and accepts the canonical tokens from there.
Tokens of earlier steps stay: their text was streamed and their KV computed.

At most ``MAX_JUMP_FORWARD_CHARS`` of forced text are taken in one step (the rest is forced
again at the next): a grammar such as ``(a{2600}){2600}`` forces 6.76M characters, whose
encoding and acceptance took the scheduler 14 s and 250 MB in one step.

    jump = canonical_jump(matcher, tokenizer, step_ids=[sampled], forced=forced)
    if jump: drop jump.rollback ids from the output, append jump.ids
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixlm.runtime.constrained.base import Matcher

# forced characters appended in one step: about as many tokens, computed next step as one
# extend row, so a jump costs no more than a short prefill chunk
MAX_JUMP_FORWARD_CHARS = 256


@dataclass(frozen=True)
class Jump:
    rollback: int  # ids of this step to drop from the end of the output
    ids: list[int]  # canonical ids to append after dropping them (already accepted)


def canonical_jump(matcher: Matcher, tokenizer: Any, step_ids: list[int], forced: str
                   ) -> Jump | None:
    """Advance ``matcher`` over the canonical encoding of ``decode(step_ids) + forced``;
    None (and the matcher unchanged) when there is nothing to jump or the encoding is not
    one the grammar accepts. Only the first ``MAX_JUMP_FORWARD_CHARS`` of ``forced``
    are taken."""
    forced = forced[:MAX_JUMP_FORWARD_CHARS]
    if not forced:
        return None
    prefix = tokenizer.decode(step_ids) if step_ids else ""
    if prefix and tokenizer.encode(prefix, add_special_tokens=False) != step_ids:
        # no round trip (half a character; a tokenizer that drops a leading space when it
        # decodes one token): re-encoding could change the text, so leave the step alone
        prefix, step_ids = "", []
    ids = tokenizer.encode(prefix + forced, add_special_tokens=False)
    keep = 0
    while keep < min(len(step_ids), len(ids)) and step_ids[keep] == ids[keep]:
        keep += 1
    rollback, new = len(step_ids) - keep, ids[keep:]
    if not new:
        return None
    matcher.rollback(rollback)
    for n, token_id in enumerate(new):
        if not matcher.accept_token(token_id):
            matcher.rollback(n)
            for old in step_ids[keep:]:  # restore what was rolled back
                accepted = matcher.accept_token(old)
                assert accepted, f"token {old} was accepted before the rollback"
            return None
    return Jump(rollback, new)
