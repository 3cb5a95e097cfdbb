"""The builder's errors: cookbook errors (one hierarchy, one exit-code table), with the extra
codes only the builder has. Each may carry details for the JSON report."""
from __future__ import annotations

from cookbook.errors import EXIT_BASE_MISMATCH, EXIT_FIX_FAILED, CookbookError

# Exit codes (docs/images.md and `python3 -m builder --help`); 0, 2 (base mismatch) and 3 (usage or
# profile error) mean what they mean for apply_all.py.
EXIT_ERROR = EXIT_FIX_FAILED  # 1: anything unexpected
EXIT_DAEMON = 4  # the Docker daemon cannot be reached
EXIT_BASE_MISSING = 5  # the base image is not in the local engine
EXIT_BUILD_FAILED = 6  # the Dockerfile build failed
EXIT_PREFLIGHT = 7  # the new image was built but its preflight failed

EXIT_CODES_HELP = ("Exit codes: 0 success; 1 unexpected error; 2 base image mismatch (its vLLM / "
                   "vllm-gaudi commits or installed files are not the profile's); 3 usage or profile "
                   "error; 4 Docker daemon unreachable; 5 base image not found; 6 build failed; "
                   "7 preflight failed in the new image.")


class BuilderError(CookbookError):
    exit_code = EXIT_ERROR

    def __init__(self, message: str, **details):
        super().__init__(message)
        self.details = details


class DaemonDown(BuilderError):
    exit_code = EXIT_DAEMON


class BaseMissing(BuilderError):
    exit_code = EXIT_BASE_MISSING


class BaseRefused(BuilderError):
    exit_code = EXIT_BASE_MISMATCH


class BuildFailed(BuilderError):
    exit_code = EXIT_BUILD_FAILED


class PreflightFailed(BuilderError):
    exit_code = EXIT_PREFLIGHT
