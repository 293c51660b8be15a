"""pdkv prefill_node."""
