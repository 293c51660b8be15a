"""The KV connector contract, owned by the engine: the base class both halves implement (``base``), the
no-op connector the engine runs when none is configured (``null``), the typed transfer parameters that
travel prefill -> router -> decode (``params``) and what an engine needs to build its halves
(``spec``).  Implementations and the registry live in ``connectors/``, which imports this package, never
the other way round."""
