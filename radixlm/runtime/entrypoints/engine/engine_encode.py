"""``Engine.encode`` / ``async_encode`` (SGLang's): embeddings from an
``Engine(is_embedding=True)``, in the shape of the server's ``/encode``."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from radixlm.runtime.entrypoints.openai.embedding_protocol import (
    DIMENSIONS_REFUSED,
    REFUSED_EMBEDDING_FIELDS,
    encode_result,
)
from radixlm.runtime.entrypoints.refused_fields import refuse_options
from radixlm.runtime.executor.sampling_params import SamplingParams
from radixlm.runtime.managers.messages import GenerateReqInput
from radixlm.runtime.managers.tokenizer_manager.request_log import RequestOrigin, Timings
from radixlm.runtime.managers.validation import cache_namespace, validate_request


class EngineEncode:
    """Mixed into ``Engine`` (its server_args, tokenizer, limits, loop and request_log)."""

    def encode(self, prompt: str | list[str] | None = None,
               input_ids: list[int] | list[list[int]] | None = None,
               rid: str | list[str] | None = None, dimensions: int | None = None,
               extra_key: str | None = None, cache_salt: str | None = None,
               embed_override_token_id: int | None = None, embed_overrides: Any = None,
               **sglang_options: Any) -> dict[str, Any] | list[dict[str, Any]]:
        """SGLang's ``Engine.encode``: ``{"embedding": [...], "meta_info": {...}}`` for one
        prompt, a list of them for a batch (submitted together, prefilled in one batch
        where they fit). Text is tokenized with the tokenizer's special tokens, as
        sentence-transformers does."""
        if not self.server_args.is_embedding:
            raise ValueError("Engine.encode needs an embedding engine: "
                             "Engine(model_path, is_embedding=True)")
        refuse_options(sglang_options)
        if dimensions is not None:
            raise ValueError(DIMENSIONS_REFUSED)
        for name, value in (("embed_override_token_id", embed_override_token_id),
                            ("embed_overrides", embed_overrides)):
            if value is not None:
                raise ValueError(f"{name} is not supported: "
                                 f"{REFUSED_EMBEDDING_FIELDS[name]}")
        batch, ids_list, texts = self._encode_inputs(prompt, input_ids)
        rids = rid if isinstance(rid, list) else [rid] * len(ids_list)
        if len(rids) != len(ids_list) or (isinstance(rid, str) and batch):
            raise ValueError(f"rid must be a list of {len(ids_list)} ids for a batch, or a "
                             "string for one prompt")
        namespace = cache_namespace(extra_key, cache_salt)
        params = SamplingParams.from_dict({"max_new_tokens": 0})
        msgs = []
        for ids, r in zip(ids_list, rids):
            validate_request(ids, params, self.limits)
            msgs.append(GenerateReqInput(r or uuid.uuid4().hex, ids, params.to_dict(),
                                         namespace=namespace))
        t0 = time.monotonic()
        queues = [self.loop.submit(m) for m in msgs]
        results = []
        for m, q, text in zip(msgs, queues, texts):
            last, version = None, ""
            for out in self.loop.outputs(m.rid, q):
                last, version = out, self.loop.versions.get(m.rid) or ""
            now = time.monotonic()
            results.append(encode_result(m.rid, last, now - t0, version))
            if self.request_log is not None:  # --log-requests, as Engine.generate's
                self.request_log.add(m, RequestOrigin("Engine.encode", text), last,
                                     Timings(t0, None, now, 0))
        return results if batch else results[0]

    async def async_encode(self, *args: Any, **kwargs: Any) -> Any:
        """``encode`` for an asyncio caller (same arguments and results)."""
        return await asyncio.to_thread(self.encode, *args, **kwargs)

    def _encode_inputs(self, prompt: Any, input_ids: Any
                       ) -> tuple[bool, list[list[int]], list[str | None]]:
        """(batch, token ids per input, text per input or None)."""
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt or input_ids")
        if input_ids is not None:
            batch = bool(input_ids) and isinstance(input_ids[0], list)
            ids = [list(v) for v in input_ids] if batch else [list(input_ids)]
            return batch, ids, [None] * len(ids)
        texts = prompt if isinstance(prompt, list) else [prompt]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise ValueError("prompt must be a string or a non-empty list of strings")
        return isinstance(prompt, list), [self.tokenizer.encode(t) for t in texts], texts
