"""Request state and the loops around the model: the tokenizer manager (server process),
the scheduler and its helpers (scheduler process), the detokenizer (its own process), and
the typed messages that pass between them."""
