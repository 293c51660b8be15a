"""pdkv decode_node."""
