"""A node process in one place: its configuration (``config``: ``NodeConfig`` from the command line, the
connector stack from the registry) and its assembly (``process``: engine, driver, the servicers of its
role from ``prefill_node/`` and ``decode_node/``, health, reflection, the KV event publisher, /metrics)."""
