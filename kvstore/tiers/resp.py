"""What the ``redis`` tier says on the wire itself, below redis-py: the lookup script, RESP command packing
for pipelined runs of keys, and a reader that takes bulk replies straight from the socket into caller
buffers (``kvstore/tiers/redis.py`` says when each is used)."""

from __future__ import annotations

import hashlib
import socket

from kvstore.tiers.base import TierError

# KEYS: block keys in chain order.  Returns how many leading keys exist; reads only.
LOOKUP_SCRIPT = """
local function all_present(i, j)
  local found = 0
  for a = i, j, 4000 do
    found = found + redis.call('EXISTS', unpack(KEYS, a, math.min(a + 3999, j)))
  end
  return found == j - i + 1
end
local n = #KEYS
if n == 0 or redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if n == 1 or all_present(2, n) then return n end
-- KEYS[1..lo] are all present, KEYS[1..hi] are not: halve the gap until it is one key wide.
local lo, hi = 1, n
while hi - lo > 1 do
  local mid = math.floor((lo + hi) / 2)
  if all_present(lo + 1, mid) then lo = mid else hi = mid end
end
return lo
"""
LOOKUP_SHA = hashlib.sha1(LOOKUP_SCRIPT.encode()).hexdigest().encode()

_CRLF = b"\r\n"

CRLF = b"\r\n"
_DISCARD_CHUNK = 1 << 20


def pack_command(head: list[bytes], keys: list[bytes]) -> list[bytes]:
    """RESP for ``head + keys``; keys of one length (the usual case) are joined in one pass."""
    parts = [b"*%d\r\n" % (len(head) + len(keys))]
    parts.extend(b"$%d\r\n%s\r\n" % (len(arg), arg) for arg in head)
    if keys and len(set(map(len, keys))) == 1:
        size = b"$%d\r\n" % len(keys[0])
        parts.append(size + (b"\r\n" + size).join(keys) + b"\r\n")
    else:
        parts.extend(b"$%d\r\n%s\r\n" % (len(k), k) for k in keys)
    return parts


class BulkReader:
    """Reads RESP replies to pipelined GETs straight from a socket into caller buffers.

    Only bulk strings (``$n``), nulls (``$-1``, RESP3 ``_``) and errors (``-ERR``) are expected.  Bytes
    that arrive with a reply line are buffered and drained first; everything else lands directly in the
    destination with ``recv_into``.  After the last reply of a batch nothing may be left over.
    """

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray()
        self._pos = 0

    def _fill(self) -> None:
        chunk = self._sock.recv(4096)
        if not chunk:
            raise TierError("redis closed the connection mid-reply")
        if self._pos:
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += chunk

    def _line(self) -> bytes:
        while True:
            end = self._buf.find(CRLF, self._pos)
            if end >= 0:
                line = bytes(self._buf[self._pos : end])
                self._pos = end + 2
                return line
            self._fill()

    def bulk_length(self) -> int:
        """The length of the next bulk reply, -1 for a null; raises on an error reply."""
        line = self._line()
        if line[:1] == b"$":
            return int(line[1:])
        if line[:1] == b"_":
            return -1
        if line[:1] == b"-":
            raise TierError(f"redis replied {line.decode(errors='replace')}")
        raise TierError(f"unexpected redis reply {line[:40]!r}")

    def read_into(self, dst: memoryview) -> None:
        """Exactly ``dst.nbytes`` bytes of the current bulk reply into ``dst``."""
        n = dst.nbytes
        have = min(len(self._buf) - self._pos, n)
        if have:
            dst[:have] = self._buf[self._pos : self._pos + have]
            self._pos += have
        while have < n:
            got = self._sock.recv_into(dst[have:])
            if got == 0:
                raise TierError("redis closed the connection mid-reply")
            have += got

    def end_of_bulk(self) -> None:
        """Consume the CRLF that ends a bulk reply."""
        while len(self._buf) - self._pos < 2:
            self._fill()
        if self._buf[self._pos : self._pos + 2] != CRLF:
            raise TierError("redis reply framing lost")
        self._pos += 2

    def skip(self, n: int) -> None:
        """Discard the rest of a bulk reply: ``n`` bytes and its CRLF."""
        scratch = memoryview(bytearray(min(n, _DISCARD_CHUNK)))
        while n > 0:
            take = min(n, scratch.nbytes)
            self.read_into(scratch[:take])
            n -= take
        self.end_of_bulk()

    def finish(self) -> None:
        if self._pos != len(self._buf):
            raise TierError("unexpected bytes after the last redis reply")
