"""The server process's side of requests: tokenizing, admission, the request log,
tenants' request ids, results, control calls."""
