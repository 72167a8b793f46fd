"""``radixlm bench serve``: a load generator against any serving API (radixlm, SGLang, vLLM,
OpenAI-compatible) that reports throughput, TTFT / TPOT / ITL / E2E percentiles, goodput
under SLOs and the server-reported cache hit rate.

Rooms: ``datasets`` (what is sent), ``backends`` (how one streamed request is sent and
timed), ``metrics`` (what the timings add up to), ``serve`` (CLI, arrivals, the run loop),
``plots`` (PNG figures). Nothing else in radixlm imports this package but the CLI.
"""
