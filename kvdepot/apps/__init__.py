"""The applications built on the library: the ``kvdepot`` command and what it runs.

:mod:`.cli` is the command (``kvdepot = kvdepot.apps.cli:main``), with its
settings plumbing in :mod:`.cli_settings`; :mod:`.cluster` starts a local
cluster of daemons (``kvdepot up``, also the tests' fixtures); :mod:`.demo`,
:mod:`.certs` and :mod:`.stats` are ``kvdepot demo``, ``kvdepot certs`` and
``kvdepot stats``; :mod:`.vllm_cli` is the ``vllm`` command for vLLM's CPU
build. Nothing in the library (the shared ``kvdepot.*`` modules, store,
metadata, connector) imports these.
"""
