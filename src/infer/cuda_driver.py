"""The CUDA driver's entry points that the step loop calls every step, through ctypes.

On a busy host each torch operation costs the loop 10-40 µs (dispatch, the current
stream's lookup, a pinned allocation or an event object), several times the driver call
it ends in; the loop's per-step copies and events go to the driver directly instead.
Streams and events are raw handles (`torch.cuda.Stream.cuda_stream`,
`torch._C._cuda_getCurrentRawStream`). Stream memory operations (wait until a 64-bit
word is at least a value, write one) take addresses of registered host memory.
"""

from __future__ import annotations

import ctypes
import functools

_MEMORY_HOST, _MEMORY_DEVICE = 1, 2  # CUmemorytype


class _Memcpy2D(ctypes.Structure):
    """CUDA_MEMCPY2D."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_uint), ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_uint), ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t),
    ]


@functools.cache
def cuda_driver() -> CudaDriver:
    """The process's one binding of the driver (CUDA must be initialised: torch has)."""
    return CudaDriver()


class CudaDriver:
    WAIT_GEQ = 0x0
    WRITE_DEFAULT = 0x0  # ordered after the stream's earlier work, with a memory barrier
    EVENT_DISABLE_TIMING = 0x2
    NOT_READY = 600  # CUDA_ERROR_NOT_READY

    def __init__(self) -> None:
        # PyDLL: the calls keep the GIL (each returns in microseconds; releasing and
        # taking it back around every one would let another thread in between), except
        # a wait on the host, which may block and lets go of it (CDLL)
        self._driver = driver = ctypes.PyDLL("libcuda.so.1")
        self._wait = self._entry(driver, "cuStreamWaitValue64")
        self._write = self._entry(driver, "cuStreamWriteValue64")
        self._to_device = self._copy_entry(driver, "cuMemcpyHtoDAsync_v2")
        self._to_host = self._copy_entry(driver, "cuMemcpyDtoHAsync_v2")
        self._copy_2d = driver.cuMemcpy2DAsync_v2  # (parameters, stream)
        self._copy_2d.argtypes = [ctypes.POINTER(_Memcpy2D), ctypes.c_void_p]
        self._copy_2d.restype = ctypes.c_int
        self._record = driver.cuEventRecord  # (event, stream)
        self._record.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._record.restype = ctypes.c_int
        self._synchronize = ctypes.CDLL("libcuda.so.1").cuEventSynchronize  # (event)
        self._synchronize.argtypes = [ctypes.c_void_p]
        self._synchronize.restype = ctypes.c_int
        self._query = driver.cuEventQuery  # (event)
        self._query.argtypes = [ctypes.c_void_p]
        self._query.restype = ctypes.c_int
        self._wait_event = driver.cuStreamWaitEvent  # (stream, event, flags)
        self._wait_event.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        self._wait_event.restype = ctypes.c_int

    def device_pointer(self, host_address: int) -> int:
        """The device's address of registered host memory."""
        fn = self._driver.cuMemHostGetDevicePointer_v2
        fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
        fn.restype = ctypes.c_int
        pointer = ctypes.c_uint64()
        self._check(fn(ctypes.byref(pointer), host_address, 0), "address")
        return pointer.value

    @staticmethod
    def _entry(driver: ctypes.PyDLL, name: str) -> ctypes._CFuncPtr:
        fn = getattr(driver, name + "_v2", None) or getattr(driver, name)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
        fn.restype = ctypes.c_int
        return fn

    @staticmethod
    def _copy_entry(driver: ctypes.PyDLL, name: str) -> ctypes._CFuncPtr:
        fn = getattr(driver, name)  # (destination, source, bytes, stream)
        fn.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        return fn

    # -- copies (the host side pinned or registered, else the driver stages and waits) ---
    def copy_to_device(self, stream: int, device_address: int, host_address: int,
                       nbytes: int) -> None:
        self._check(self._to_device(device_address, host_address, nbytes, stream), "copy")

    def copy_to_host(self, stream: int, host_address: int, device_address: int,
                     nbytes: int) -> None:
        self._check(self._to_host(host_address, device_address, nbytes, stream), "copy")

    def copy_rows_to_device(self, stream: int, device_address: int, device_pitch: int,
                            host_address: int, host_pitch: int, row_bytes: int,
                            rows: int) -> None:
        """`rows` rows of `row_bytes` from host rows `host_pitch` bytes apart into device
        rows `device_pitch` bytes apart."""
        if not rows or not row_bytes:
            return
        copy = _Memcpy2D(srcMemoryType=_MEMORY_HOST, srcHost=host_address,
                         srcPitch=host_pitch, dstMemoryType=_MEMORY_DEVICE,
                         dstDevice=device_address, dstPitch=device_pitch,
                         WidthInBytes=row_bytes, Height=rows)
        self._check(self._copy_2d(ctypes.byref(copy), stream), "2D copy")

    # -- events --------------------------------------------------------------------------
    def event(self) -> int:
        """A new event without timing (its handle; it lives as long as the context)."""
        fn = self._driver.cuEventCreate
        fn.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        fn.restype = ctypes.c_int
        event = ctypes.c_void_p()
        self._check(fn(ctypes.byref(event), self.EVENT_DISABLE_TIMING), "event")
        return event.value

    def destroy(self, event: int) -> None:
        fn = self._driver.cuEventDestroy_v2
        fn.argtypes = [ctypes.c_void_p]
        fn.restype = ctypes.c_int
        self._check(fn(event), "event destroy")

    def record(self, event: int, stream: int) -> None:
        self._check(self._record(event, stream), "event record")

    def synchronize(self, event: int) -> None:
        """Wait on the host until the event's last record has run."""
        self._check(self._synchronize(event), "event synchronize")

    def done(self, event: int) -> bool:
        """Whether the event's last record has run (without waiting)."""
        code = self._query(event)
        if code == self.NOT_READY:
            return False
        self._check(code, "event query")
        return True

    def wait_event(self, stream: int, event: int) -> None:
        """The stream's later work waits for the event's last record (none: no wait)."""
        self._check(self._wait_event(stream, event, 0), "event wait")

    # -- stream memory operations ---------------------------------------------------------
    def wait_at_least(self, stream: int, address: int, value: int) -> None:
        self._check(self._wait(stream, address, value, self.WAIT_GEQ), "wait")

    def write(self, stream: int, address: int, value: int) -> None:
        self._check(self._write(stream, address, value, self.WRITE_DEFAULT), "write")

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"CUDA driver {what} failed (CUresult {code})")
