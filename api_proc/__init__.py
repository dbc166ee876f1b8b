"""The API process: HTTP routes, per-request state and timing, batch joining, streaming."""
