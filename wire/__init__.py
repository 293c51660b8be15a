"""The wire layer: framing, limits, CURVE sockets, header-checked block frames and every message that
crosses a ZeroMQ socket (store protocol, p2p protocol, KV events).  A leaf: it imports nothing of ours."""
