"""Exit codes and the errors that map onto them (documented in the README)."""

EXIT_OK = 0
EXIT_FIX_FAILED = 1  # a fix refused or failed to apply; the tree is unchanged
EXIT_BASE_MISMATCH = 2  # a target's commit is not the profile's pin (or cannot be identified)
EXIT_USAGE = 3  # bad arguments, unknown fix, malformed profile or fix metadata


class CookbookError(Exception):
    """Base class: every error carries the exit code it maps to."""

    exit_code = EXIT_FIX_FAILED


class UsageError(CookbookError):
    exit_code = EXIT_USAGE


class ProfileError(CookbookError):
    exit_code = EXIT_USAGE


class BaseMismatch(CookbookError):
    exit_code = EXIT_BASE_MISMATCH


class FixRefused(CookbookError):
    exit_code = EXIT_FIX_FAILED
