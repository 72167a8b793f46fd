"""Offline analysis of a server's request log: ``prefix_report`` (``radixlm prefix-report``)."""
