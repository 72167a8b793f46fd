"""The scheduler's weight updates from disk (SGLang's ``/update_weights_from_disk``): checked
at once, applied between steps once no request holds KV."""

from __future__ import annotations

import logging

import torch

from radixlm.runtime.executor.model_runner import ModelRunner
from radixlm.runtime.managers.messages import (
    GenerateReqInput,
    UpdateWeightFromDiskOutput,
    UpdateWeightFromDiskReq,
)
from radixlm.runtime.managers.scheduler.cache_manager import CacheManager
from radixlm.runtime.model_config import ModelConfig

logger = logging.getLogger(__name__)


class SchedulerWeightUpdates:
    """Mixed into ``Scheduler``, which sets the state below in its ``__init__`` (and
    ``add_request`` / ``abort_all``, from ``SchedulerIntake``)."""

    model_runner: ModelRunner
    model_config: ModelConfig
    cache: CacheManager
    weight_version: str
    weight_update: UpdateWeightFromDiskReq | None  # the one waiting to be applied
    held: list[GenerateReqInput]  # requests that arrived meanwhile: they run on the new weights

    def request_weight_update(self, msg: UpdateWeightFromDiskReq
                              ) -> UpdateWeightFromDiskOutput | None:
        """Check the checkpoint now (headers only; a bad one is refused before anything
        waits), then apply it in ``run_once`` once the requests ahead of it are done, or
        at once after aborting them (``abort_all_requests``). None: the reply comes then."""
        if self.weight_update is not None:
            return self._update_reply(False, "another weight update is in progress")
        try:
            self.model_runner.check_weights(msg.model_path)
        except ValueError as e:
            return self._update_reply(False, f"Failed to update weights: {e}")
        self.weight_update = msg
        if msg.abort_all_requests:
            self.abort_all()
        return None

    def _apply_weight_update(self) -> UpdateWeightFromDiskOutput:
        """Between steps, with no request holding KV: load, then drop every cached KV
        (it was computed by the old weights), then admit the requests held meanwhile."""
        msg, self.weight_update = self.weight_update, None
        assert msg is not None and not self.cache.running, "weight update with KV in use"
        try:
            self.model_runner.update_weights_from_disk(msg.model_path)
            ok, message = True, "Succeeded to update model weights."
            if msg.weight_version is not None:
                self.weight_version = msg.weight_version
                message += f" Weight version updated to {msg.weight_version}."
        except ValueError as e:
            ok, message = False, f"Failed to update weights: {e}"
        self.cache.flush()  # also after a failure: the weights may have been reloaded
        if self.cache.hicache is not None and ok:  # stored pages of the old weights: unread
            self.cache.hicache.set_model(msg.model_path, self.weight_version)
        if msg.torch_empty_cache and torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.model_config = self.model_runner.model_config
        held, self.held = self.held, []
        for m in held:
            self.add_request(m)
        logger.info("weight update from %s: %s", msg.model_path, message)
        return self._update_reply(ok, message)

    def _update_reply(self, ok: bool, message: str) -> UpdateWeightFromDiskOutput:
        return UpdateWeightFromDiskOutput(ok, message, 0, self.weight_version)
