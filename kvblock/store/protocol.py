"""The store server's wire protocol (kvblock/store/server.py and its clients).

Messages are JSON objects in frames of a 4-byte big-endian length and the
JSON bytes, over a Unix socket; keys travel as base64 of their 16 bytes
each; an error travels as its class name and message and is raised again
as kvblock's class of that name.  Client and server exchange their PROTOCOL
in hello; either refuses another version (ProtocolMismatchError).

A request is ``{"op": NAME, ...arguments}``; the answer is ``{"ok": true,
"result": ...}`` or ``{"ok": false, "error": CLASS, "message": TEXT}``.  One
request at a time per connection, answered in order.

- A put is three requests: ``admit`` (duplicate and admission checks),
  ``allocate`` (the server reserves space and holds a writer pin on its
  region), then, after the client has written and flushed the run's bytes,
  ``commit`` (the server journals the PUT record durably and publishes the
  run; it carries the run's checksums, one per range, then its block digest
  trailer's, kvblock/format/trailer.py).  ``put_runs`` allocates and
  writes each of its runs, then publishes them all with one
  ``commit_runs`` (``puts``: [wid, keys, checksums] each): one journal
  commit, so all or none of them are published; every allocation named is
  released, whatever the answer.  A put admitted that then stores nothing
  (no space, a write error, a clear), or a put_runs the rank refuses
  after its admits, sends ``give_back`` (``offers``: the ids of the offers
  admit counted, its answer's ``offer``; none where it answered null): the
  server's admission forgets those offers (no counter changes).  A put_runs run
  that the call's earlier runs hold whole is a duplicate no admit sees:
  ``count_duplicates`` (``runs``: how many) counts them in the server's
  stats.  put_runs' admits say ``count: false``: a run declined is
  counted by ``count_rejected`` (``runs``; ``offers``: their offer ids,
  the offers the server settles) once the call's plan stands
  (a call refused after its admits counts none), so that the stats'
  admission_rejected_runs, a Prometheus counter, never goes down.
- A read asks ``segments`` (the server pins the runs and answers their
  locations and checksums), reads and verifies locally, then ``unpin``.
- Pins belong to the connection: when it drops (the client exits or
  crashes), the server releases them.  They are leased: while it holds pins
  a client sends ``ping`` every quarter of the lease hello announced
  (``pin_lease``), and the server drops a connection that holds pins and
  stays quiet longer.
- Right after its answer to ``hello`` the server sends one byte carrying
  descriptors (SCM_RIGHTS): the two files of its write fence
  (kvblock/store/fence.py), which the client locks around every write (the
  first is the store's device 0), then the store's devices 1, 2, ... in
  store order: the client checks each is the medium it does its I/O on.
"""

from __future__ import annotations

import base64
import json
import socket
import struct
from typing import Sequence

import numpy as np

from kvblock import errors
from kvblock.errors import ConfigError, KVBlockError, ServerError
from kvblock.index.keys import normalize_key

PROTOCOL = 15  # 2: "clear"; admit answers the clear count, commit carries it
#                3: pins are leased ("ping", hello's "pin_lease")
#                4: the server sends its fence files after hello
#                5: runs carry their block digest trailer's checksum (format 2)
#                6: "removed" (the keys the store removed since a cursor)
#                7: "touch" (mark the runs holding keys as just used, for LRU)
#                8: the fence files are followed by the store's devices 1..
#                   (each checked to be the medium the rank does its I/O on)
#                9: "delete_prefix" (a worker's own keys), "clear_ticket";
#                   drop_runs says why (a checksum failure or a read error)
#               10: delete_prefix's "keep" (the caller's pinned keys stay)
#               11: "commit_runs" (put_runs: its runs in one journal commit);
#                   hello's "journal_bytes"
#               12: "give_back" (offers admit counted for puts that stored nothing);
#                   "count_duplicates" (put_runs' runs its earlier runs hold)
#               13: admit's "count" (false: a declined run is not counted
#                   yet), "count_rejected" (put_runs' declined runs, once
#                   its plan stands): admission_rejected_runs never falls
#               14: count_rejected's "keys" (the declined runs' first keys:
#                   the server settles those offers, not another thread's)
#               15: admit answers an "offer" id; give_back and count_rejected
#                   name offers by it ("offers"), not by first key (two
#                   threads' runs of one first key on one connection)
MAX_FRAME = 256 << 20
_LEN = struct.Struct(">I")


def encode_msg(obj) -> bytes:
    data = json.dumps(obj, separators=(",", ":"), default=_json_scalar).encode()
    if len(data) > MAX_FRAME:
        raise ConfigError(f"store server message of {len(data)} bytes exceeds {MAX_FRAME}; "
                          "use fewer keys per call")
    return _LEN.pack(len(data)) + data


def _json_scalar(value):
    """A numpy scalar as the number it holds (KVStore's calls take them);
    anything else JSON cannot carry is the caller's mistake, typed."""
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    raise ConfigError(f"a store server message cannot carry a {type(value).__name__} "
                      f"({str(value)[:80]}); pass numbers, strings, lists or None")


def recv_msg(sock: socket.socket):
    """The next message, or None at a clean end of stream."""
    head = _recv_exact(sock, _LEN.size, eof_ok=True)
    if head is None:
        return None
    (n,) = _LEN.unpack(head)
    if n > MAX_FRAME:
        raise ConnectionError(f"frame of {n} bytes exceeds {MAX_FRAME} (not a kvblock peer?)")
    data = _recv_exact(sock, n)
    # A whole frame that is no message: ConfigError (the stream is intact,
    # the peer can be answered), never None (the end of the stream).
    # RecursionError: JSON nested deeper than the parser goes, a whole frame too.
    try:
        msg = json.loads(data)
    except (ValueError, RecursionError):
        raise ConfigError(f"store server message of {n} bytes is not JSON (UTF-8) or nests "
                          "too deep: send a JSON object") from None
    if not isinstance(msg, dict):
        raise ConfigError(f"store server message must be a JSON object "
                          f"{{\"op\": NAME, ...}}, got a JSON {type(msg).__name__}")
    return msg


def _recv_exact(sock, n, eof_ok=False):
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            if eof_ok and got == 0:
                return None
            raise ConnectionError("connection closed in the middle of a message")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def encode_keys(keys: Sequence[bytes]) -> str:
    return base64.b64encode(b"".join(keys)).decode("ascii")


def decode_keys(text: str) -> list[bytes]:
    try:
        raw = base64.b64decode(text, validate=True)
    except (ValueError, TypeError):
        raise ConfigError("keys must be base64 of 16-byte keys") from None
    if len(raw) % 16:
        raise ConfigError("keys must be 16 bytes each")
    # as the clients store them: the zero key under its stand-in (a raw
    # client's went into the index as is, where zero marks superseded keys)
    keys = [raw[i:i + 16] for i in range(0, len(raw), 16)]
    return [normalize_key(k) for k in keys] if bytes(16) in keys else keys


def error_reply(exc: BaseException) -> dict:
    return {"ok": False, "error": type(exc).__name__, "message": str(exc)}


def raise_remote(name: str, message: str):
    """Raise the error a server answered with: kvblock's own class of that
    name, else ServerError."""
    # (a name that is no string: getattr's TypeError, not the server's error)
    cls = getattr(errors, name, None) if isinstance(name, str) else None
    if not (isinstance(cls, type) and issubclass(cls, KVBlockError)):
        raise ServerError(f"store server: {name}: {message}")
    try:
        exc = cls(message)
    except Exception:  # noqa: BLE001  (a class with another constructor)
        raise ServerError(f"store server: {name}: {message}") from None
    raise exc
