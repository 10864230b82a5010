"""The benchmarks: entry scripts (``python benchmarks/NAME.py`` or
``python -m benchmarks.NAME``) and the modules they share.

Shared modules, imported as ``benchmarks.NAME`` and never importing an entry
script: ``procs`` (children that die with the benchmark), ``systems``,
``floors``, ``kvsystems`` (what the data-plane benchmarks time), ``measure``
(how), ``visible`` (the watcher processes), ``stages``, ``rss``,
``scale_nodes``, ``vllm_servers``.
"""
