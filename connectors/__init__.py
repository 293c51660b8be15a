"""KV connectors: the plugin API (``connectors.base``), the registry, and the built-in connectors."""
