"""Errors raised by the collective engine."""


class HFReduceError(RuntimeError):
    """A collective failed; the communicator cannot be used afterwards (like an aborted NCCL comm)."""


class HFReduceTimeoutError(HFReduceError, TimeoutError):
    """Peers did not arrive at a collective within the communicator's timeout.

    Attributes:
        missing_ranks: group ranks that had not arrived.
    """

    def __init__(self, message: str, missing_ranks: list[int]) -> None:
        super().__init__(message)
        self.missing_ranks = missing_ranks


class HFReducePeerError(HFReduceError):
    """A peer process on this host died during a collective.

    Attributes:
        dead_ranks: group ranks whose process is gone.
    """

    def __init__(self, message: str, dead_ranks: list[int]) -> None:
        super().__init__(message)
        self.dead_ranks = dead_ranks


class HFReduceAbortedError(HFReducePeerError):
    """A rank of the job failed (raised an exception) and aborted every collective waiting on it.

    The message names the rank, its pid, its exception type and the exception's first line. The cause is that
    rank's own error, in its log; this one is the consequence.

    Attributes:
        dead_ranks: the global rank that failed (the name is :class:`HFReducePeerError`'s).
    """


class HFReduceMismatchError(HFReduceError):
    """Ranks called different collectives (kind, element count, dtype, op or root) at the same point.

    Every rank raises it at the same call, before any rank reads another's data; the message names each
    rank's call. The cause is in the program: a rank-dependent branch or shape before the call.

    Attributes:
        mismatched_ranks: group ranks whose call differs from this rank's.
    """

    def __init__(self, message: str, mismatched_ranks: list[int]) -> None:
        super().__init__(message)
        self.mismatched_ranks = mismatched_ranks


class SharedMemoryTooSmallError(HFReduceError):
    """/dev/shm has less free space than the communicator or a shared buffer needs."""
