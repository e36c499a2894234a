"""Storage model of the stacked DRAM, behind the RTL timing model's backend bus.

The RTL (``flashnpu.hdl.dram.StackedDRAM``) keeps channels, banks, rows,
refresh, latency and bandwidth; this module keeps the bytes.  ``DRAMModel`` is a sparse store of
4 KiB pages (untouched pages read as zero), so a 64 MiB address space costs
memory only where it is written.  It is the DRAM's backdoor too: tests and
the host driver call ``read``/``write`` directly, as cocotbext-axi's RAM
models separate storage from protocol.

Two adapters serve the channels' backend buses (``DRAMBackendSignature``):
one for amaranth.sim testbenches (:meth:`DRAMModel.amaranth_server`, one per
channel) and one for cocotb (:meth:`DRAMModel.cocotb_server`, every channel).  Both apply writes and answer reads
one cycle after the request is visible, in order; optionally with random
extra delay (``max_extra_delay``) to exercise the RTL's buffering — the total
must stay below the modelled latency or the RTL flags ``late``.  Verilator
builds of the NPU serve the bus without Python (``sim/dram_hook.cpp``, the
same timing without extra delay); the model then keeps its bytes in that
code's buffer (``buffer=``), so the backdoor sees what the simulation wrote.

``copy2d`` is the reference semantics of one DMA descriptor on two byte
stores, used by scoreboards.
"""

from __future__ import annotations

import random
from collections import deque

import numpy as np

__all__ = ["DRAMModel", "ByteStore", "copy2d", "word_to_bytes", "bytes_to_word", "simulator_dram"]

PAGE = 4096


def word_to_bytes(value: int, wbytes: int) -> bytes:
    """Little-endian bytes of a bus word (byte 0 = bits 7:0)."""
    return int(value).to_bytes(wbytes, "little")


def bytes_to_word(b) -> int:
    """Bus word from little-endian bytes."""
    return int.from_bytes(bytes(b), "little")


class ByteStore:
    """Byte-addressed store: sparse 4 KiB pages, or one flat buffer.

    Parameters
    ----------
    size : int
        Address space in bytes.
    buffer : numpy uint8 array of ``size`` bytes, optional
        Keep the bytes here instead of in pages (the simulator's own DRAM
        storage, ``sim/dram_hook.cpp``, shared through ctypes); it is
        cleared to zero, as a new sparse store reads.

    Raises
    ------
    IndexError
        On an access outside ``[0, size)``.
    ValueError
        A size that is not a positive int, or a buffer of another size.
    """

    def __init__(self, size: int, buffer: np.ndarray | None = None):
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"size must be a positive int, not {size!r}")
        self.size = size
        self.pages: dict[int, np.ndarray] = {}
        self.flat = buffer
        if buffer is not None:
            if buffer.dtype != np.uint8 or buffer.size != size:
                raise ValueError(f"buffer must be {size} uint8 bytes, not {buffer.size} {buffer.dtype}")
            buffer[:] = 0

    def _check(self, addr: int, n: int):
        if addr < 0 or n < 0 or addr + n > self.size:
            raise IndexError(f"access [{addr:#x}, {addr + n:#x}) outside [0, {self.size:#x})")

    def read(self, addr: int, n: int) -> bytes:
        """``n`` bytes from ``addr`` (zeros where never written)."""
        self._check(addr, n)
        if self.flat is not None:
            return self.flat[addr:addr + n].tobytes()
        out = bytearray(n)
        pos = 0
        while pos < n:
            a = addr + pos
            pg, off = divmod(a, PAGE)
            k = min(PAGE - off, n - pos)
            page = self.pages.get(pg)
            if page is not None:
                out[pos:pos + k] = page[off:off + k].tobytes()
            pos += k
        return bytes(out)

    def write(self, addr: int, data, mask=None) -> None:
        """Write bytes at ``addr``; ``mask`` (sequence of bools) selects bytes."""
        data = bytes(data)
        n = len(data)
        self._check(addr, n)
        if self.flat is not None:
            chunk = np.frombuffer(data, np.uint8)
            if mask is None:
                self.flat[addr:addr + n] = chunk
            else:
                msk = np.asarray(mask, bool)
                self.flat[addr:addr + n][msk] = chunk[msk]
            return
        pos = 0
        while pos < n:
            a = addr + pos
            pg, off = divmod(a, PAGE)
            k = min(PAGE - off, n - pos)
            page = self.pages.get(pg)
            if page is None:
                page = self.pages[pg] = np.zeros(PAGE, np.uint8)
            chunk = np.frombuffer(data[pos:pos + k], np.uint8)
            if mask is None:
                page[off:off + k] = chunk
            else:
                msk = np.asarray(mask[pos:pos + k], bool)
                page[off:off + k][msk] = chunk[msk]
            pos += k


class DRAMModel(ByteStore):
    """Sparse DRAM contents plus backend-bus servers.

    Parameters
    ----------
    config : NPUConfig
        Uses ``dram_bytes`` and the bus word (``dram_channel_bytes``).
    seed : int or None
        Seed for the random extra response delay.
    max_extra_delay : int
        Extra cycles (uniform 0..max) added to read answers; keep
        ``2 + max_extra_delay < dram_latency_cycles``.
    buffer : numpy uint8 array, optional
        Flat storage (see ``ByteStore``).
    """

    def __init__(self, config, seed=None, max_extra_delay: int = 0, buffer: np.ndarray | None = None):
        super().__init__(config.dram_bytes, buffer)
        self.wbytes = config.dram_channel_bytes
        self.channels = config.dram_channels
        self.rng = random.Random(seed)
        self.max_extra_delay = max_extra_delay
        self.reads = 0
        self.writes = 0

    # --------------------------------------------------------- word access
    def read_word(self, word_addr: int) -> int:
        return bytes_to_word(self.read(word_addr * self.wbytes, self.wbytes))

    def write_word(self, word_addr: int, value: int, wmask: int) -> None:
        mask = [(wmask >> i) & 1 for i in range(self.wbytes)]
        self.write(word_addr * self.wbytes, word_to_bytes(value, self.wbytes), mask)

    def _access(self, write: int, addr: int, wmask: int, wdata: int):
        if write:
            self.writes += 1
            self.write_word(addr, wdata, wmask)
            return None
        self.reads += 1
        return self.read_word(addr)

    # --------------------------------------------------------- amaranth.sim
    def amaranth_server(self, bk):
        """An async testbench serving backend bus ``bk`` (a DRAMBackendSignature interface).

        Usage: ``sim.add_process(model.amaranth_server(dut.bk[0]))``.
        """
        async def server(ctx):
            queue = deque()      # (ready_cycle, data)
            cycle = 0
            async for _clk_edge, rst, v, w, a, mk, wd in ctx.tick().sample(
                    bk.req_valid, bk.req_write, bk.req_addr, bk.req_wmask, bk.req_wdata):
                if rst:
                    queue.clear()
                    continue
                cycle += 1
                if v:
                    r = self._access(w, a, mk, wd)
                    if r is not None:
                        extra = self.rng.randint(0, self.max_extra_delay) if self.max_extra_delay else 0
                        due = max(cycle + extra, queue[-1][0] + 1 if queue else 0)
                        queue.append((due, r))
                if queue and queue[0][0] <= cycle:
                    _, r = queue.popleft()
                    ctx.set(bk.resp_valid, 1)
                    ctx.set(bk.resp_data, r)
                else:
                    ctx.set(bk.resp_valid, 0)
        return server

    # --------------------------------------------------------- cocotb
    async def cocotb_server(self, dut, clk, prefix: str = "bk__"):
        """A cocotb coroutine serving every channel's backend bus: the ports
        of channel c start with ``f"{prefix}{c}__"``.

        Samples the (registered) requests in the falling-edge half of each
        cycle and drives the answers right after the next rising edge; each
        channel answers in its own request order.  Start it with
        ``cocotb.start_soon(model.cocotb_server(dut, dut.clk))``.
        """
        # deferred: cocotb is importable only inside the simulator process
        from cocotb.triggers import FallingEdge, RisingEdge

        buses = []
        for c in range(self.channels):
            g = lambda n, c=c: getattr(dut, f"{prefix}{c}__{n}")
            bus = [g(n) for n in ("req_valid", "req_write", "req_addr", "req_wmask", "req_wdata",
                                  "resp_valid", "resp_data")]
            bus[5].value = 0
            buses.append((bus, deque()))
        cycle = 0
        while True:
            await FallingEdge(clk)
            cycle += 1
            for (req_valid, req_write, req_addr, req_wmask, req_wdata, _, _), queue in buses:
                if int(req_valid.value):
                    r = self._access(int(req_write.value), int(req_addr.value), int(req_wmask.value),
                                     int(req_wdata.value))
                    if r is not None:
                        extra = self.rng.randint(0, self.max_extra_delay) if self.max_extra_delay else 0
                        due = max(cycle + 1 + extra, queue[-1][0] + 1 if queue else 0)
                        queue.append((due, r))
            await RisingEdge(clk)
            for (*_, resp_valid, resp_data), queue in buses:
                if queue and queue[0][0] <= cycle + 1:
                    _, r = queue.popleft()
                    resp_valid.value = 1
                    resp_data.value = r
                else:
                    resp_valid.value = 0


def copy2d(src: ByteStore, dst: ByteStore, src_addr: int, dst_addr: int, rows: int,
           bytes_per_row: int, src_stride: int, dst_stride: int) -> None:
    """Reference semantics of one 2-D DMA descriptor (byte exact)."""
    for r in range(rows):
        dst.write(dst_addr + r * dst_stride, src.read(src_addr + r * src_stride, bytes_per_row))


def simulator_dram(nbytes: int):
    """The simulator's own DRAM storage (``sim/dram_hook.cpp``, linked into
    the Verilator builds made with ``runner.build(dram_word=...)``): returns
    (ctypes library, numpy uint8 view of its ``nbytes`` bytes), or None when
    the running simulator has no such storage (Icarus, or a build without it).

    Raises ``MemoryError`` when the simulator cannot allocate ``nbytes``.
    """
    import ctypes
    lib = ctypes.CDLL(None)
    if not hasattr(lib, "flashnpu_dram_attach"):
        return None
    lib.flashnpu_dram_attach.restype = ctypes.POINTER(ctypes.c_uint8)
    lib.flashnpu_dram_attach.argtypes = [ctypes.c_uint64]
    lib.flashnpu_dram_serve.argtypes = [ctypes.c_int]
    lib.flashnpu_dram_errors.restype = ctypes.c_uint64
    ptr = lib.flashnpu_dram_attach(nbytes)
    if not ptr:
        raise MemoryError(f"the simulator could not allocate its {nbytes}-byte DRAM")
    return lib, np.ctypeslib.as_array(ptr, shape=(nbytes,))
