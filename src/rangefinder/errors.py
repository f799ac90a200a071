"""The errors a user can act on. Each message is one sentence naming the file, field or value, and the fix."""


class RangefinderError(Exception):
    """Bad input or an impossible setting; the CLI prints it on one line and exits non-zero."""


class ConfigError(RangefinderError, ValueError):
    """An invalid setting."""


class DataError(RangefinderError):
    """A dataset that cannot be used (too few usable images, unreadable folder, ...)."""


class TrackingError(RangefinderError):
    """The MLflow tracking server cannot be reached or refuses the credentials."""
