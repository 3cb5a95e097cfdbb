"""What a run reports: its mode, each fix's status, and the result records a person and a program
read (report.py renders them). Enum values are the words the reports print, so JSON carries them
as plain strings."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from .errors import EXIT_OK


class Mode(str, Enum):
    APPLY = "apply"  # write the series
    CHECK = "check"  # work it out, write nothing
    REVERT = "revert"  # write the series' reverse
    VERIFY = "verify"  # every fix onto a scratch copy; the pin is reported, not enforced

    def __str__(self) -> str:
        return self.value

    @property
    def writes(self) -> bool:
        return self in (Mode.APPLY, Mode.REVERT)


class Status(str, Enum):
    PENDING = ""  # not reached: a fix before it on the same target failed
    PATCHED = "patched"
    ALREADY_APPLIED = "already applied"
    REVERTED = "reverted"
    NOT_APPLIED = "not applied"
    FAILED = "failed"
    NOT_YET_AVAILABLE = "not yet available"
    OUT_OF_SCOPE = "out of scope"
    WOULD_PATCH = "would patch"  # in a dry or refused run: nothing was written
    WOULD_REVERT = "would revert"

    def __str__(self) -> str:
        return self.value

    def unwritten(self) -> Status:
        """What this status becomes in a run that wrote nothing (--check, or a refusal)."""
        return {Status.PATCHED: Status.WOULD_PATCH, Status.REVERTED: Status.WOULD_REVERT}.get(self, self)


@dataclass
class PatchResult:
    target: str
    patch: str  # path of the patch file, relative to the repository when inside it
    sha256: str
    files: list[str]
    status: Status = Status.PENDING
    exact: bool | None = None  # pre-image (or post-image) blobs identical to the patch's index lines
    reason: str = ""


@dataclass
class FixResult:
    name: str
    title: str
    targets: list[str]
    status: Status = Status.PENDING
    reason: str = ""
    patches: list[PatchResult] = field(default_factory=list)

    @property
    def exact(self) -> bool | None:
        flags = [p.exact for p in self.patches if p.exact is not None]
        return all(flags) if flags else None


@dataclass
class TargetResult:
    name: str
    root: str
    pin: str
    ref: str
    commit: str | None = None
    how: str = ""
    matches: bool = False
    evidence: dict = field(default_factory=dict)


@dataclass
class RunReport:
    profile: str
    mode: Mode
    scope: list[str]
    targets: dict[str, TargetResult] = field(default_factory=dict)
    fixes: list[FixResult] = field(default_factory=list)
    recovered: list[str] = field(default_factory=list)  # files an interrupted run's journal restored
    finished: list[str] = field(default_factory=list)  # trees of an interrupted run that had committed
    stamps: list[str] = field(default_factory=list)
    written: list[str] = field(default_factory=list)
    exit_code: int = EXIT_OK
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.exit_code == EXIT_OK

    def refuse(self, exit_code: int, error: str) -> None:
        self.exit_code, self.error = exit_code, error

    def add_pass(self, other: RunReport) -> None:
        """Fold in a later verify pass: the fixes it ran that this report has not, and its refusal
        when this report has none."""
        have = {f.name for f in self.fixes}
        self.fixes += [f for f in other.fixes if f.name not in have]
        if self.ok and not other.ok:
            self.refuse(other.exit_code, other.error)
