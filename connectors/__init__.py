"""pdkv connectors."""
