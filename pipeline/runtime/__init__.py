"""The runtime every part of the library stands on: typed configs built from plain mappings and
the user-facing error classes (:mod:`.config`), CPU thread counts (:mod:`.cpu_threads`) and the
quieting of third-party output (:mod:`.quiet`).

The ground floor: it imports nothing of the project but the contract (``storage_schemas``).
"""
