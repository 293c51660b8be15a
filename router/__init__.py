"""pdkv router."""
