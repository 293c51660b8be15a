"""The client-facing gateway: tokenize, pick nodes, run prefill then decode, relay the stream."""
