"""The contract's names, re-exported for callers that import them from this module; they live in
the package's modules (:mod:`storage_schemas`)."""

from storage_schemas import *  # noqa: F401,F403
from storage_schemas import SHARD_RE, iter_identity_differences  # noqa: F401
