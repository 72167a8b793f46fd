"""The serving runtime, in rooms by process and role (docs/design.md has the map).

- ``entrypoints/``: what a user starts: the HTTP server (native and OpenAI routes), the
  offline ``Engine``, and the parent's handle on the child processes.
- ``managers/``: request state and the loops around the model: tokenizer manager (server
  process), scheduler with its policy, cache manager and output processor (scheduler
  process), detokenizer (its own process), and the messages between them.
- ``executor/``: the model and one forward: model runner, forward batch, models,
  sampling. It sees a ``ModelWorkerBatch``, never a request.
- ``constrained/``: grammars compiled to token masks.
- ``config``, ``model_config``, ``metrics``, ``tokenizer``: shared by every room.

Imports flow one way: entrypoints -> managers -> executor -> constrained and the shared
modules; ``tests/test_layering.py`` enforces it.
"""
