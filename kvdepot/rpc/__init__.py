"""The control plane's gRPC plumbing, shared by every process that serves or calls it.

- :mod:`~kvdepot.rpc.security_config`: TLS and token settings, loaded from
  flags, ``KVDEPOT_*`` or a file, and the arguments a child process gets
  (imports no gRPC: a command builds its parser without it);
- :mod:`~kvdepot.rpc.security`: channel and server factories from those
  settings, the client and server interceptors, and what a refused TLS
  connection says;
- :mod:`~kvdepot.rpc.auth`: bearer tokens and tenants;
- :mod:`~kvdepot.rpc.request_guard`: bounds on what one request may ask;
- :mod:`~kvdepot.rpc.health`: the standard gRPC health service;
- :mod:`~kvdepot.rpc.errors`: kvdepot's errors to and from gRPC status codes.
"""
