"""The scheduler process: the scheduling loop and what it owns (batches, policy, the KV
cache manager, outputs, the storage tier, KV events, tensor-parallel ranks)."""
