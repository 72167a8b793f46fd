"""What users start: ``radixlm serve`` (HTTP app, native and OpenAI routes, the child
processes) and the offline ``Engine``. Runs in the server process or the caller's."""
