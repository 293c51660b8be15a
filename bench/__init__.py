"""pdkv bench."""
