"""The storage tier under the radix tree (``--enable-hierarchical-cache``): KV pages that
outlive the pool and the process, under content keys (``page_keys``), in a self-checking
file format (``page_format``), kept by a backend (``base.StorageBackend``; built in: the
file backend, ``file_backend.FileStorage``, which trusts no file), moved by
``tier.StorageTier``, and waited for per ``prefetch_policy``."""
