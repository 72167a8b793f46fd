"""What SGLang 0.5 accepts and radixlm refuses, and why.

Field -> (values that mean "not used", why radixlm lacks it). A field holding one of its
neutral values (SGLang's default, or null) is dropped before parsing (``drop_neutral``), so
clients that send defaults explicitly (SGLang's own frontend does) work; any other value is
a 400 that names the field and gives the reason. ``tests/.../test_sglang_parity.py`` reads
SGLang's source and fails when one of its fields is in neither this table nor a model of
``protocol.py``.
"""

from __future__ import annotations

from typing import Any

_MEDIA = "radixlm serves text-only models: no image, video or audio input"
_EMBEDS = "radixlm takes text or token ids, not embeddings"
_DISAGG = ("radixlm's pages carry every KV head whatever either side's --tp-size, and each "
           "prefill server has one bootstrap service: there is no tensor-parallel size or "
           "pair key to give")
_SESSION = ("radixlm has no sessions; a repeated prefix is reused through the radix cache "
            "without one")
_REASONING = "radixlm has no reasoning-model controls"
_SGLANG_INTERNAL = "internal to SGLang's server, not a request field"
_OFF: tuple[Any, ...] = (None, False)

REFUSED_REQUEST_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "session_id": ((None,), _SESSION),
    "session_params": ((None,), _SESSION),
    "input_embeds": ((None,), _EMBEDS),
    "positional_embed_overrides": ((None,), _EMBEDS),
    **{name: ((None,), _MEDIA) for name in (
        "image_data", "video_data", "audio_data", "mm_hashes", "mm_content_hashes",
        "video_config", "modalities", "max_dynamic_patch", "min_dynamic_patch",
        "image_max_dynamic_patch", "video_max_dynamic_patch", "images_config",
        "mm_processor_kwargs", "need_wait_for_mm_inputs", "num_items_assigned",
        "encoder_urls")},
    "use_audio_in_video": (_OFF, _MEDIA),
    "return_bytes": (_OFF, "radixlm does not generate images"),
    "watermark": ((None,), "radixlm does not watermark its output"),
    "return_sampling_mask": (_OFF, "radixlm returns logprobs of the model's distribution, "
                                   "not of the sampling support"),
    "sampling_logprobs_mode": ((None,), "radixlm returns logprobs of the model's "
                                        "distribution, not of the sampling support"),
    **{name: (_OFF, "radixlm returns top logprobs nested, [logprob, token_id, text] "
                    "per entry, not as flat arrays") for name in (
        "return_flat_raw_top_logprobs", "return_flat_raw_output_top_logprobs",
        "return_flat_raw_top_logprobs_b64")},
    "return_hidden_states": (_OFF, "radixlm does not return hidden states"),
    "return_routed_experts": (_OFF, "radixlm's models are dense: there are no experts"),
    "routed_experts_start_len": ((None, 0), "radixlm's models are dense: there are no "
                                           "experts"),
    "return_indexer_topk": (_OFF, "radixlm has no sparse-attention indexer"),
    "return_entropy": (_OFF, "radixlm does not compute output entropies; use "
                             "top_logprobs_num"),
    "lora_path": ((None,), "radixlm does not serve LoRA adapters"),
    "lora_id": ((None,), "radixlm does not serve LoRA adapters"),
    "custom_logit_processor": ((None,), "radixlm does not run custom logit processors "
                                        "(serialized code from the client)"),
    **{name: ((None,), _DISAGG) for name in (
        "bootstrap_pair_key", "decode_tp_size")},
    "conversation_id": ((None,), "radixlm has no request tracing"),
    "external_trace_header": ((None,), "radixlm has no request tracing"),
    "background": (_OFF, "radixlm has no background responses (OpenAI Responses API)"),
    "require_reasoning": (_OFF, _REASONING),
    "max_thinking_tokens": ((None,), _REASONING),
    "multi_item_delimiter_indices": ((None,), "radixlm has no multi-item scoring"),
    "token_indices_to_pool": ((None,), "radixlm has no multi-item scoring"),
    "kv_hints": ((None,), "radixlm has no hierarchical KV cache (HiCache)"),
    "http_worker_ipc": ((None,), _SGLANG_INTERNAL),
    "received_time": ((None,), _SGLANG_INTERNAL),
}

_SAMPLING_INTERNAL = "internal to SGLang's SamplingParams, not a request field"
REFUSED_SAMPLING_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "beam_width": ((None, 1), "radixlm has no beam search; n gives independent samples"),
    "stream_interval": ((None, 1), "radixlm streams every scheduler step"),
    "custom_params": ((None,), "custom_params feed custom logit processors, which radixlm "
                               "does not run"),
    "watermark": ((None,), "radixlm does not watermark its output"),
    "stop_strs": ((None,), _SAMPLING_INTERNAL),
    "stop_regex_strs": ((None,), _SAMPLING_INTERNAL),
    "stop_str_max_len": ((None, 0), _SAMPLING_INTERNAL),
    "stop_regex_max_len": ((None, 0), _SAMPLING_INTERNAL),
    "is_normalized": (_OFF, _SAMPLING_INTERNAL),
    "ebnf_full_assistant": (_OFF, _SAMPLING_INTERNAL),
}


def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    """``value`` is one of ``neutral`` with the same JSON type (``0`` is not ``false``)."""
    return any(value is n or (type(value) is type(n) and value == n) for n in neutral)


def drop_neutral(data: Any, table: dict[str, tuple[tuple[Any, ...], str]]) -> Any:
    """``data`` without the refused fields that hold a neutral value."""
    if not isinstance(data, dict):
        return data
    return {k: v for k, v in data.items() if k not in table or not _neutral(v, table[k][0])}


def refusal(name: str) -> str | None:
    """Why radixlm refuses SGLang's field ``name`` (None: not a refused field)."""
    found = REFUSED_REQUEST_FIELDS.get(name) or REFUSED_SAMPLING_FIELDS.get(name)
    return None if found is None else found[1]


def refuse_options(options: dict[str, Any]) -> None:
    """``Engine.generate``'s keyword arguments beyond radixlm's: SGLang's refused fields
    at a neutral value pass; other values are a ValueError saying why; unknown names are
    a TypeError, as for any Python function."""
    for name, value in options.items():
        if name in ("bootstrap_host", "bootstrap_port", "bootstrap_room",
                    "disagg_prefill_dp_rank"):
            if value is not None:  # SGLang's Engine takes them; null is its default
                raise ValueError(f"{name} is not supported: the offline Engine has no "
                                 "prefill/decode disaggregation (radixlm serve "
                                 "--disaggregation-mode prefill|decode has)")
            continue
        if name not in REFUSED_REQUEST_FIELDS:
            raise TypeError(f"generate() got an unexpected keyword argument {name!r}")
        neutral, why = REFUSED_REQUEST_FIELDS[name]
        if not _neutral(value, neutral):
            raise ValueError(f"{name} is not supported: {why}")
