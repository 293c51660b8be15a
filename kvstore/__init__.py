"""pdkv kvstore."""
