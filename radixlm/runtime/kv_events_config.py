"""``--kv-events-config`` (vLLM's and SGLang's flag), parsed and checked."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import get_type_hints


@dataclass(frozen=True)
class KVEventsConfig:
    """``--kv-events-config`` parsed: vLLM's ``KVEventsConfig`` fields (SGLang's too, plus its
    ``bind``). Events are published when ``publisher`` is "zmq" (given, or implied by
    ``enable_kv_cache_events``) and ``enable_kv_cache_events`` is not false. ``endpoint``
    binds on loopback by default (vLLM's default ``tcp://*:5557`` listens on every
    interface); replica ``r`` of ``--dp-size`` uses port + r (vLLM's and SGLang's rule)."""

    enable_kv_cache_events: bool | None = None
    publisher: str | None = None
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    bind: bool | None = None

    @property
    def publishing(self) -> bool:
        kind = self.publisher or ("zmq" if self.enable_kv_cache_events else "null")
        return kind == "zmq" and self.enable_kv_cache_events is not False

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse and check the flag's JSON; ValueError names the key and the limit."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"kv_events_config is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("kv_events_config must be a JSON object")
        hints = get_type_hints(cls)
        unknown = sorted(set(raw) - set(hints))
        if unknown:
            raise ValueError(f"kv_events_config: unknown key(s) {unknown}; valid: {sorted(hints)}")
        for key, value in raw.items():
            kinds = getattr(hints[key], "__args__", (hints[key],))
            if not any(type(value) is k or (value is None and k is type(None)) for k in kinds):
                name = " | ".join(getattr(k, "__name__", str(k)) for k in kinds)
                raise ValueError(f"kv_events_config: {key} must be {name}, got {value!r}")
        cfg = cls(**raw)
        if cfg.publisher not in (None, "zmq", "null"):
            raise ValueError(f"kv_events_config: publisher must be zmq or null, "
                             f"got {cfg.publisher!r}")
        for key in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(cfg, key) < 1:
                raise ValueError(f"kv_events_config: {key} must be >= 1, got {getattr(cfg, key)}")
        for key in ("endpoint", "replay_endpoint"):
            value = getattr(cfg, key)
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"kv_events_config: {key} must be tcp://, ipc:// or inproc://, "
                                 f"got {value!r}")
        return cfg
