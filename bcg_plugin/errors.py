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


def config_errors(error: BaseException) -> list[BcgConfigError]:
    """The :class:`BcgConfigError` that ``error`` is, or those a validation error wraps where it wraps
    nothing else (vLLM builds its config as a pydantic dataclass, whose validation error carries the
    ``ValueError`` its ``__post_init__`` raised); else none."""
    if isinstance(error, BcgConfigError):
        return [error]
    errors = getattr(error, "errors", None)
    if not callable(errors):
        return []
    try:
        causes = [item.get("ctx", {}).get("error") for item in errors()]
    except Exception:  # not pydantic's, or not shaped like it: not one of ours
        return []
    return causes if causes and all(isinstance(c, BcgConfigError) for c in causes) else []


def one_line_if_uncaught() -> None:
    """Where a :class:`BcgConfigError` ends the program uncaught (an engine's command line started with
    a bad value), print it as the one line it is instead of a traceback; the exit status stays 1.
    The hook acts on nothing else: a program that catches the error sees it as before, and every
    other exception ends the program as it would have. Installed once."""
    import sys

    previous = sys.excepthook
    if getattr(previous, "bcg_one_line", False):
        return

    def hook(kind, value, tb):
        ours = config_errors(value)
        if ours:
            for error in ours:
                print(f"bcg: configuration error: {error}", file=sys.stderr)
        else:
            previous(kind, value, tb)

    hook.bcg_one_line = True
    sys.excepthook = hook
