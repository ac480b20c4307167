"""Exceptions the runtime raises on purpose; each message says what is wrong and what to do."""


class BcgError(RuntimeError):
    """Base class of every error bcg-plugin raises deliberately."""


class BcgConfigError(BcgError, ValueError):
    """A configuration value is invalid; the message names the key."""


class BcgCaptureOOM(BcgError):
    """Out of memory while capturing prefill graphs; the boot fails with advice, never silently."""


class BcgCaptureError(BcgError):
    """Capture failed for a reason other than OOM (and the config asked to raise)."""


class BcgStateError(BcgError):
    """The runtime was used outside the state it needs (e.g. no live batch bound at a break)."""


class BcgVersionError(BcgError):
    """An installed dependency is outside the versions the runtime was checked against; the message names the range."""
