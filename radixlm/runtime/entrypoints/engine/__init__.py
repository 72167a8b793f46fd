"""The offline Engine: the scheduler driven from the caller's process (or replica processes)."""
