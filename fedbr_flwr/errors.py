"""The error a user can fix from its message alone (exit code 2 in the commands)."""


class ConfigError(ValueError):
    """A configuration problem the user can fix; the message says how."""
