"""Prefill/decode disaggregation: moving a prompt's KV pages from a prefill server to a
decode server (SGLang's ``srt/disaggregation``).

``base`` holds the transfer state machine (``KVPoll``) and the manager / sender / receiver
interface; ``zmq_backend`` moves pages over zmq, ``fake_backend`` in memory (unit tests);
``bootstrap`` is the prefill server's bootstrap service; ``rooms`` gives each request (and
each of its ``n`` samples) its room. Nothing here knows a request or the scheduler: the
scheduler's side is ``managers/pd_queues.py``.
"""
