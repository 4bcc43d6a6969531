"""Type stub of the native engine (csrc/). Tensors cross as integer addresses: see [Note: addresses at the
border] in csrc/bindings.cpp."""

import enum

def simd_level() -> str: ...
def simd_levels() -> list[str]: ...
def set_simd_level(name: str) -> None: ...

KERNELS_ENV: str  # "HFREDUCE_KERNELS": generic, avx2, avx512 or best, read at import

WORKER_THREAD_NAME: str  # the OS name of every communicator's worker thread

class ShmFullError(MemoryError): ...

class DType(enum.Enum):  # named as torch names its dtypes (torch.float32 -> FLOAT32)
    FLOAT32 = 0
    FLOAT64 = 1
    FLOAT16 = 2
    BFLOAT16 = 3
    INT32 = 4
    INT64 = 5

class ErrorKind(enum.Enum):
    NONE = 0
    TIMEOUT = 1
    PEER_DIED = 2
    OTHER = 3
    MISMATCH = 4
    ABORTED = 5

class Collective(enum.Enum):
    ALL_REDUCE = 1
    ALL_REDUCE_BUFFER = 2
    REDUCE_SCATTER = 3
    ALL_GATHER = 4
    BROADCAST = 5
    BARRIER = 6
    DISAGREED_ELSEWHERE = 7

class Fingerprint:
    """What one rank calls; ranks compare them before reading each other's data."""

    collective: Collective
    dtype: DType
    count: int
    arg: int
    divisor: float
    def __init__(
        self, collective: Collective, dtype: DType, count: int, arg: int = 0, divisor: float = 1.0
    ) -> None: ...
    def describe(self) -> str: ...
# dst: one address, or a list of them (each gets the result, in one pass).
def reduce(dtype: DType, dst: int | list[int], srcs: list[int], count: int, divisor: float) -> None: ...

class Work:
    def wait(self, timeout_s: float = -1.0) -> bool: ...
    def is_completed(self) -> bool: ...
    def failed(self) -> bool: ...
    def error_kind(self) -> ErrorKind: ...
    def error_message(self) -> str: ...
    def error_ranks(self) -> list[int]: ...

class Region: ...

class SharedBuffer:
    def __init__(self, name: str, region_bytes: int, local_size: int, create: bool) -> None: ...
    @property
    def region_bytes(self) -> int: ...
    def unlink(self) -> None: ...
    def region(self, rank: int) -> Region: ...

class Communicator:
    def __init__(
        self,
        name: str,
        local_rank: int,
        local_size: int,
        create: bool,
        slot_bytes: int,
        timeout_s: float,
        spin_iters: int,
    ) -> None: ...
    @staticmethod
    def segment_bytes(local_size: int, slot_bytes: int) -> int: ...
    def wait_attached(self) -> None: ...
    def stop(self) -> None: ...
    def abort(self, rank: int, reason: str) -> bool: ...
    def aborted(self) -> tuple[int, str] | None: ...
    # blocking=True runs the collective on the calling thread (GIL released) once earlier work is done and
    # returns None if it succeeded, else its failed Work; blocking=False queues it and returns its Work.
    def all_reduce(
        self, src: int, dst: int, count: int, dtype: DType, divisor: float, blocking: bool = False
    ) -> Work | None: ...
    def all_reduce_buffer(
        self, buffer: SharedBuffer, offset: int, count: int, dtype: DType, divisor: float, blocking: bool = False
    ) -> Work | None: ...
    def reduce_scatter(
        self, src: int, dst: int, count_per_rank: int, dtype: DType, divisor: float, blocking: bool = False
    ) -> Work | None: ...
    def all_gather(
        self, src: int, dst: int, count_per_rank: int, dtype: DType, blocking: bool = False
    ) -> Work | None: ...
    def broadcast(self, buffer: int, count: int, dtype: DType, root: int, blocking: bool = False) -> Work | None: ...
    def barrier(self, blocking: bool = False) -> Work | None: ...
    def agree(self, call: Fingerprint, blocking: bool = False) -> Work | None: ...
