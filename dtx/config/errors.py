"""The one error type of dtx's configs (its own module, so that every config module can raise it)."""


class ConfigError(ValueError):
    """A config file, key or value that cannot be used; the message says how to fix it."""
