"""The data plane's wire, shared by both ends (the store daemon and the client).

- :mod:`~kvdepot.wire.protocol`: the framed messages and their limits;
- :mod:`~kvdepot.wire.sockets`: socket I/O with deadlines, hashing on the way;
- :mod:`~kvdepot.wire.handshake`: the authenticated opening of a connection;
- :mod:`~kvdepot.wire.xxh3`: the chunk checksum (xxh3-64);
- :mod:`~kvdepot.wire.host`: which host a process runs on (shared memory), and
  its RDMA devices.
"""
