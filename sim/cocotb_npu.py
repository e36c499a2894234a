"""cocotb host-driver testbench of the whole NPU.

Two modes share one job runner (``run_job``):

* batch (test ``npu_jobs``): the jobs arrive as a JSON list in the file
  named by ``FLASHNPU_NPU_JOBS`` (written by
  ``flashnpu.sim.rtl_backend.run_jobs``);
* server (test ``npu_server``): ``FLASHNPU_NPU_SERVER`` names a folder with
  two FIFOs (made by ``flashnpu.sim.rtl_backend.NPUSession``).  The test
  writes the simulator's process id to ``sim.pid``, then reads one JSON job
  spec per line from ``req.fifo`` -- the simulator is blocked, no time
  passes, while it waits -- runs it, and answers one JSON line on
  ``rsp.fifo``: ``{"ok": true, "name", "out"}`` or ``{"ok": false, "name",
  "error"}`` (then the test fails and the simulator exits).  ``{"quit":
  true}`` or end-of-file (the client is gone) ends the test.

A job spec names an input
``.npz`` (the ``flashnpu sim`` file contract), an output ``.npz``, register
overrides (rejection tests), a debug-register value (fault injection),
optional ``tsv_fault`` register values (stuck-at TSV lanes, written before
the self-test), an optional watchdog limit and optional ``stress``, random
idle and backpressure on every interface the testbench reaches, all drawn
from the job's seed and logged:

* ``dram_delay``: each DRAM response comes up to that many cycles later
  (random; within the modelled latency, so the RTL's timing and every
  counter stay the same);
* ``host_idle``: up to that many idle cycles before each host bus access;
* ``sram_stall``: the NPU's SRAM ports are refused their grant with
  probability ``sram_stall`` / 16 per cycle (``stall`` register,
  ``hdl/stall.py``): the job takes longer and must still be bit-exact.

``s_check`` (``{"threshold": n}``, optionally ``"flip_mask": [head, row,
key]`` to corrupt one mask bit in DRAM) runs the S-tile check: the NPU
queues its count of non-zero P per kv tile (``hdl/s_check.py``), the host
drains the queue while it polls and compares each count with the golden
model's (``sim/tile_checks.py``); past the threshold it stops the job and
names head, q tile and kv tile (result field ``s_check``).

For every job the testbench acts as the host:

1. reset, run both TSV self-tests through ``tsv_ctl`` and check the links;
2. write Q, K, V (and the mask) into the DRAM storage model, and a sentinel
   over the O region;
3. program the descriptor registers, write ``ctrl.start``;
4. wait for the rising edge of ``irq`` (done or an error; one trigger, no
   per-cycle Python; with the S-tile check, poll ``status`` every 32 cycles
   instead), read ``status`` and the counters; read O back from the DRAM
   model;
5. write ``o``, the error code, the counters and whether the O region still
   holds the sentinel into the output ``.npz``.

The DRAM storage: under Verilator the simulator serves the backend bus
itself (``sim/dram_hook.cpp``, mapped here with ctypes: ``HOOK``), so no
Python runs per cycle; a job with ``dram_delay`` uses the Python server of
``DRAMModel`` on the same bytes.  Under Icarus the Python server serves
every job.

Both modes run every job from reset with its own TSV self-test, so a job's
output and counters do not depend on the mode or on the jobs before it --
except a ``resident`` job (the driver's KV cache kept in NPU DRAM,
``rtl_backend.NPUSession``): it skips step 1 unless the NPU has not been
powered up yet or the last job failed, takes its K/V where earlier jobs
left them (``plan_job``'s ``kv_region``) and first stores the spec's DRAM
writes (the new K/V slots).
The comparisons (bit-exact vs the golden model, nothing written on a
rejected job) are made by the caller, which owns the expectations.
"""

from __future__ import annotations

import json
import os
import random
import time

import cocotb
import numpy as np
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, FallingEdge, First, RisingEdge, Timer

from flashnpu.config import NPUConfig
from flashnpu.hdl.core import BufSel, Phase, register_name
from flashnpu.hdl.npu import COUNTERS, NPUError, register_map
from flashnpu.hdl.tsv import LinkStatus
from flashnpu.sim.case import AttentionCase
from flashnpu.sim.dram_model import DRAMModel, simulator_dram
from flashnpu.sim.rtl_backend import O_SENTINEL, plan_job
from flashnpu.sim.tile_checks import expected_p_counts, mask_bit_address

CFG = NPUConfig.from_json(os.environ["FLASHNPU_CONFIG"])
RMAP = register_map(CFG)
CLOCK_NS = 1                      # simulated clock period (the waves' cycle numbers assume it)


HOOK = simulator_dram(CFG.dram_bytes)
#: [True] once a resident job has reset the NPU and trained its links, until a job fails
POWERED = [False]
#: the DRAM model of resident jobs, kept across them (a new one zeroes the storage)
RESIDENT_MODEL: list = []


class XValueError(ValueError):
    """A register read returned unknown (X/Z) bits (4-state simulators)."""


class Host:
    """The host side: CSR bus master and DRAM backdoor."""

    def __init__(self, dut, model: DRAMModel, idle: int = 0, rng: random.Random | None = None):
        self.dut = dut
        self.model = model
        self.idle = int(idle)
        self.rng = rng or random.Random(0)

    async def _idle(self):
        if self.idle:
            n = self.rng.randint(0, self.idle)
            if n:
                await ClockCycles(self.dut.clk, n)

    async def write(self, name: str, value: int):
        d = self.dut
        await self._idle()
        await FallingEdge(d.clk)
        d.csr_addr.value = RMAP[name].address
        d.csr_w_data.value = int(value) & 0xFFFFFFFF
        d.csr_w_en.value = 1
        await FallingEdge(d.clk)
        d.csr_w_en.value = 0

    async def read(self, name: str) -> int:
        d = self.dut
        await self._idle()
        await FallingEdge(d.clk)
        d.csr_addr.value = RMAP[name].address
        d.csr_r_en.value = 1
        await FallingEdge(d.clk)
        d.csr_r_en.value = 0
        v = d.csr_r_data.value
        if not v.is_resolvable:
            raise XValueError(f"register {name!r} reads {v} (X or Z bits)")
        return int(v)

    async def read64(self, name: str) -> int:
        return await self.read(f"cnt_{name}_lo") | (await self.read(f"cnt_{name}_hi") << 32)


async def reset(dut):
    dut.rst.value = 1
    # bk__<c>__resp_valid: a DRAM server cancelled mid-stream (a job stopped
    # by a check) leaves it high, and the next job would take a stale word
    for n in ("csr_w_en", "csr_r_en", "csr_addr", "csr_w_data",
              *(f"bk__{c}__resp_valid" for c in range(CFG.dram_channels))):
        getattr(dut, n).value = 0
    await ClockCycles(dut.clk, 3)
    dut.rst.value = 0
    await ClockCycles(dut.clk, 1)


async def train_links(host: Host, require_ok: bool = True) -> dict:
    """Run both TSV self-tests; returns ``tsv_status`` unpacked.  ``require_ok``:
    fail unless both links are OK afterwards (off for jobs with injected TSV
    faults, which may expect a link down)."""
    await host.write("tsv_ctl", RMAP["tsv_ctl"].pack(bist_rd=1, bist_wr=1))
    for _ in range(200):
        await ClockCycles(host.dut.clk, 50)
        st = RMAP["tsv_status"].unpack(await host.read("tsv_status"))
        if st["rd_status"] != LinkStatus.BIST and st["wr_status"] != LinkStatus.BIST:
            assert not require_ok or (st["rd_ok"] and st["wr_ok"]), f"TSV self-test failed: {st}"
            return st
    raise AssertionError("TSV self-test did not finish")


async def read_tsv(host: Host, status: dict) -> dict:
    """The links' status and repair maps: ``rd_status``/``wr_status`` (LinkStatus
    names) and ``rd_map``/``wr_map`` (per spare: data lane it replaces, or None)."""
    out = dict(rd_status=LinkStatus(status["rd_status"]).name, wr_status=LinkStatus(status["wr_status"]).name)
    for link in ("rd", "wr"):
        ents = []
        for i in range((CFG.tsv_spare_lanes + 1) // 2):
            w = RMAP[f"tsv_{link}_map{i}"].unpack(await host.read(f"tsv_{link}_map{i}"))
            ents += [w["e0_lane"] if w["e0_valid"] else None, w["e1_lane"] if w["e1_valid"] else None]
        out[f"{link}_map"] = ents[:CFG.tsv_spare_lanes]
    return out


async def drain_s_tiles(host: Host, expected: dict, threshold: int, seen: list) -> dict | None:
    """Pop every queued S-tile count; return the first tile whose count is
    more than ``threshold`` from the golden one (or that the golden model does
    not have), else None.  Raises AssertionError when the queue overflowed."""
    while True:
        head = RMAP["s_tile"].unpack(await host.read("s_tile"))
        if head["overflow"]:
            raise AssertionError("S-tile check: the queue overflowed (entries lost)")
        if not head["valid"]:
            return None
        count = await host.read("s_count")
        await host.write("s_tile_pop", 1)
        seen.append((head["q_tile"], head["kv_tile"], count))
        exp = expected.get((head["q_tile"], head["kv_tile"]))
        if exp is None or abs(count - exp.count) > threshold:
            return dict(head=exp.head if exp else None, q_tile=exp.q_tile if exp else None,
                        job_q_tile=head["q_tile"], kv_tile=head["kv_tile"], count=count,
                        expected=exp.count if exp else None)


async def run_job(dut, spec, seed):
    with np.load(spec["inputs"], allow_pickle=False) as z:
        case = AttentionCase(q=z["q"], k=z["k"], v=z["v"], causal=bool(z["causal"]),
                             mask=z["mask"] if "mask" in z.files else None,
                             kv_valid_len=int(z["kv_valid_len"]) if "kv_valid_len" in z.files else None,
                             scale=float(z["scale"]) if "scale" in z.files else None)
    resident = spec.get("resident")
    if resident:
        plan = plan_job(case, CFG, base=resident["base"], overrides=spec.get("overrides"),
                        kv_region=resident["kv"])
    else:
        plan = plan_job(case, CFG, overrides=spec.get("overrides"))
    stress = spec.get("stress") or {}
    delay = int(stress.get("dram_delay", 0))
    # The simulator serves the DRAM itself unless the job wants random response
    # delays (the Python server's); either way the bytes live in one store.
    # a new DRAMModel starts from zeroed storage: resident jobs keep one
    if resident and RESIDENT_MODEL:
        model = RESIDENT_MODEL[0]
        model.rng, model.max_extra_delay = random.Random(seed), delay
    else:
        model = DRAMModel(CFG, seed=seed, max_extra_delay=delay, buffer=HOOK[1] if HOOK else None)
        RESIDENT_MODEL[:] = [model] if resident else []
    host = Host(dut, model, idle=int(stress.get("host_idle", 0)), rng=random.Random(seed))
    if stress:
        dut._log.info(f"job {spec['name']}: stress {stress}, seed {seed}")
    dut._log.info(f"job {spec['name']}: DRAM served by "
                  + ("the simulator (sim/dram_hook.cpp)" if HOOK and not delay else "the Python model"))
    # a resident job runs on the NPU as the last one left it: reset and TSV
    # self-test only at power-up (and after a job that failed)
    power_up = not (resident and POWERED[0])
    if HOOK:
        HOOK[0].flashnpu_dram_serve(0)
    if power_up:
        await reset(dut)
    if HOOK and not delay:
        HOOK[0].flashnpu_dram_serve(1)
        server = None
    else:
        server = cocotb.start_soon(model.cocotb_server(dut, dut.clk))
    faults = spec.get("tsv_fault") or {}
    tsv = None
    if power_up:
        for name, val in faults.items():        # test-only stuck-at TSV lanes, before the self-test
            await host.write(name, val)
        tsv_st = await train_links(host, require_ok=not faults)
        tsv = await read_tsv(host, tsv_st) if faults else None
    if resident:
        with np.load(resident["writes"], allow_pickle=False) as z:
            for i, a in enumerate(z["addr"]):
                model.write(int(a), z[f"d{i}"].tobytes())
    for a, b in plan["writes"]:
        model.write(a, b)
    s_spec = spec.get("s_check")
    if s_spec:
        expected = expected_p_counts(case, CFG)
        if s_spec.get("flip_mask") is not None:         # fault: one mask bit corrupted in DRAM
            addr, bit = mask_bit_address(plan["regs"], CFG, *s_spec["flip_mask"])
            model.write(addr, bytes([model.read(addr, 1)[0] ^ (1 << bit)]))
            dut._log.info(f"job {spec['name']}: mask bit {s_spec['flip_mask']} flipped in DRAM")
        await host.write("s_check", 1)
    for name, val in plan["regs"].items():
        await host.write(name, val)
    if spec.get("watchdog") is not None:
        await host.write("watchdog", int(spec["watchdog"]))
    await host.write("debug", int(spec.get("debug", 0)))
    if stress.get("sram_stall"):
        await host.write("stall", RMAP["stall"].pack(rate=int(stress["sram_stall"]), seed=seed & 0xFFFF))
    await host.write("irq", 0b11)
    t0 = time.time()                        # wall_s: from the start command to done
    await host.write("ctrl", 1)
    timeout = int(spec.get("timeout") or 20_000_000)
    st = None
    s_seen, s_bad = [], None
    if not s_spec:
        # done (or an error) raises irq: wait for its edge, no polling
        if not int(dut.irq.value):
            await First(RisingEdge(dut.irq), Timer(timeout * CLOCK_NS, unit="ns"))
        st = RMAP["status"].unpack(await host.read("status"))
        if not st["done"]:
            raise AssertionError(f"job {spec['name']}: no done after {timeout} cycles; status {st}")
    else:
        # the S-tile check reads the NPU's per-tile counts while the job runs
        waited, step = 0, 32
        while waited < timeout:
            await ClockCycles(dut.clk, step)
            waited += step
            st = RMAP["status"].unpack(await host.read("status"))
            s_bad = await drain_s_tiles(host, expected, int(s_spec.get("threshold", 0)), s_seen)
            if s_bad:
                dut._log.error(f"job {spec['name']}: S-tile check: head {s_bad['head']} q tile "
                               f"{s_bad['q_tile']} kv tile {s_bad['kv_tile']}: {s_bad['count']} non-zero P, "
                               f"golden {s_bad['expected']} (threshold {s_spec.get('threshold', 0)}); "
                               "job stopped")
                break
            if st["done"]:
                break
        else:
            raise AssertionError(f"job {spec['name']}: no done after {timeout} cycles; status {st}")
    wall = time.time() - t0
    cnt = {}
    for n in COUNTERS:
        try:
            cnt[n] = await host.read64(n)
        except XValueError as e:          # reported, not fatal: O is still checked
            dut._log.error(f"job {spec['name']}: counter {n}: {e}")
            cnt[n] = -1
    irq = await host.read("irq")
    if server is not None:
        server.cancel()
    if HOOK:
        HOOK[0].flashnpu_dram_serve(0)
        if HOOK[0].flashnpu_dram_errors():
            raise AssertionError(f"job {spec['name']}: the NPU accessed DRAM outside its {CFG.dram_bytes} bytes")
    o = plan["o"]
    heads, seq_q, hd = o["heads"], o["seq_q"], o["head_dim"]
    raw = np.frombuffer(model.read(o["base"], heads * o["head_stride"]), np.uint8)
    rows = raw.reshape(heads, seq_q, o["row_stride"])[:, :, :4 * hd]
    out = np.ascontiguousarray(rows).view(np.float32).reshape(heads, seq_q, hd)
    lo, hi = plan["o_extent"]
    untouched = model.read(lo, hi - lo) == bytes([O_SENTINEL]) * (hi - lo)
    err = int(st["error"])
    POWERED[0] = bool(resident) and not err      # after any error: reset (FAIL holds until reset)
    msg = NPUError(err).name if err in NPUError._value2member_map_ else str(err)
    dut._log.info(f"job {spec['name']}: status {msg} dma_code {st['dma_code']} irq {irq:#x} "
                  f"cycles {cnt['total_cycles']} mac_busy {cnt['mac_busy_cycles']} wall {wall:.2f} s")
    if err:
        dut._log.info(f"job {spec['name']}: the NPU stopped with {msg}")
    reg_check = None
    if err == NPUError.REG_UNWRITTEN:
        rc = RMAP["reg_check"].unpack(await host.read("reg_check"))
        reg_check = dict(reg=rc["reg"], reg_name=register_name(CFG, rc["reg"]),
                         phase=Phase(rc["phase"]).name, tile=rc["tile"])
        dut._log.error(f"job {spec['name']}: PE register {rc['reg']} ({reg_check['reg_name']}) was read "
                       f"before it was written (core phase {reg_check['phase']}, kv tile {rc['tile']})")
    kv_check = None
    if err == NPUError.KV_STALE:
        kc = RMAP["kv_check"].unpack(await host.read("kv_check"))
        kv_check = dict(buf=BufSel(kc["buf"]).name, tile=kc["tile"], q_tile=kc["q_tile"])
        dut._log.error(f"job {spec['name']}: kv tile {kc['tile']} of q tile {kc['q_tile']} sat in core "
                       f"buffer {kv_check['buf']} unconsumed for kv_stale_limit cycles")
    s_check = None
    if s_spec:
        s_check = dict(stopped=s_bad is not None, tiles=len(s_seen), **(s_bad or {}))
    meta = dict(name=spec["name"], error=err, error_name=msg, dma_code=int(st["dma_code"]),
                irq=irq, o_untouched=bool(untouched), counters=cnt, wall_s=round(wall, 3),
                sram_bytes_sim=CFG.sram_bytes, tsv=tsv, reg_check=reg_check, kv_check=kv_check,
                s_check=s_check, powered_up=power_up)
    np.savez(spec["out"], o=out, meta_json=np.array(json.dumps(meta)))


@cocotb.test(skip="FLASHNPU_NPU_JOBS" not in os.environ)
async def npu_jobs(dut):
    """Every job of FLASHNPU_NPU_JOBS, one after another, each from reset."""
    seed = int(os.environ.get("FLASHNPU_SEED", "0") or 0)
    cocotb.start_soon(Clock(dut.clk, CLOCK_NS, unit="ns").start())
    with open(os.environ["FLASHNPU_NPU_JOBS"]) as f:
        specs = json.load(f)
    for i, spec in enumerate(specs):
        await run_job(dut, spec, int(spec.get("seed", seed + i)))


@cocotb.test(skip="FLASHNPU_NPU_SERVER" not in os.environ)
async def npu_server(dut):
    """Serve jobs from FLASHNPU_NPU_SERVER's request FIFO until quit or end-of-file."""
    folder = os.environ["FLASHNPU_NPU_SERVER"]
    seed = int(os.environ.get("FLASHNPU_SEED", "0") or 0)
    with open(os.path.join(folder, "sim.pid"), "w") as f:
        f.write(str(os.getpid()))
    cocotb.start_soon(Clock(dut.clk, CLOCK_NS, unit="ns").start())
    with open(os.path.join(folder, "req.fifo"), "rb") as req, \
            open(os.path.join(folder, "rsp.fifo"), "wb", buffering=0) as rsp:
        while True:
            line = req.readline()           # blocks the simulator until the next job
            if not line:
                dut._log.info("server: the client closed the request channel")
                break
            spec = json.loads(line)
            if spec.get("quit"):
                break
            try:
                await run_job(dut, spec, int(spec.get("seed", seed)))
            except Exception as e:
                rsp.write((json.dumps(dict(ok=False, name=spec.get("name"),
                                           error=f"{type(e).__name__}: {e}")) + "\n").encode())
                raise
            rsp.write((json.dumps(dict(ok=True, name=spec["name"], out=spec["out"])) + "\n").encode())
