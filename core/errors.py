"""Typed errors shared by every layer, so callers test a type, never message text."""

from __future__ import annotations


class StorageError(RuntimeError):
    """A storage operation failed; the message names the URI, never credentials."""


class NotFound(StorageError):
    """The key (or bucket) does not exist."""


class BucketMissing(StorageError):
    """The bucket itself does not exist: a wrong URI (bad input), not a passing outage."""


class IntegrityError(StorageError):
    """The object exists but is not what was written: a checksum or size mismatch."""


class ConfigError(ValueError):
    """A config that cannot be used; the message names every bad key."""


# The pydantic error type of a config value that holds a secret: its error message never
# shows the value (core.config.format_validation_error).
SECRET_IN_CONFIG = "secret_in_config"
