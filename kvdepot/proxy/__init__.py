"""The KV-aware routing proxy (``kvdepot proxy``).

:mod:`.router` picks an engine for a prompt from where its chunks are stored;
:mod:`.server` is the HTTP proxy in front of the engines that uses it. An
application: nothing in the library imports it.
"""
