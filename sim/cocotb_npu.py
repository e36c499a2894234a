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
3. write the job's descriptor (every job register, ``CQ_DESC``) into the
   next entry of the command ring (``hdl/cmdq.py``) and ring the doorbell;
   a job with ``submit: "csr"`` or the S-tile check instead writes the job
   registers and ``ctrl.start``;
4. wait for the rising edge of ``irq`` (done or an error; one trigger, no
   per-cycle Python; with the S-tile check, poll ``status`` every 32 cycles
   instead), read the entry's completion record (status and counters; a
   direct job: ``status`` and the counter registers); read O back from the
   DRAM model;
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
A ``group`` spec queues all its members in the ring behind one doorbell
(``run_group``: a layer sweep, the recycled-slot case R2).
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
from flashnpu.hdl.npu_map import CQ_CPL, CQ_DESC, CQ_ENTRIES, CQ_ENTRY_WORDS, CQ_FLAGS
from flashnpu.hdl.tsv import LinkStatus
from flashnpu.sim.case import AttentionCase
from flashnpu.sim.dram_model import DRAMModel, simulator_dram
from flashnpu.sim.rtl_backend import O_SENTINEL, job_registers, plan_job
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
        await self._write_word(RMAP[name].address, value)

    async def read(self, name: str) -> int:
        return await self._read_word(RMAP[name].address, repr(name))

    async def _write_word(self, address: int, value: int):
        d = self.dut
        await self._idle()
        await FallingEdge(d.clk)
        d.csr_addr.value = address
        d.csr_w_data.value = int(value) & 0xFFFFFFFF
        d.csr_w_en.value = 1
        await FallingEdge(d.clk)
        d.csr_w_en.value = 0

    async def _read_word(self, address: int, what: str) -> int:
        d = self.dut
        await self._idle()
        await FallingEdge(d.clk)
        d.csr_addr.value = address
        d.csr_r_en.value = 1
        await FallingEdge(d.clk)
        d.csr_r_en.value = 0
        v = d.csr_r_data.value
        if not v.is_resolvable:
            raise XValueError(f"register {what} reads {v} (X or Z bits)")
        return int(v)

    async def write_window(self, win: str, index: int, value: int):
        await self._write_word(RMAP.window(win).address + index, value)

    async def read_window(self, win: str, index: int) -> int:
        return await self._read_word(RMAP.window(win).address + index, f"{win}[{index}]")

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


def _load_case(path) -> AttentionCase:
    with np.load(path, allow_pickle=False) as z:
        return AttentionCase(q=z["q"], k=z["k"], v=z["v"], causal=bool(z["causal"]),
                             mask=z["mask"] if "mask" in z.files else None,
                             kv_valid_len=int(z["kv_valid_len"]) if "kv_valid_len" in z.files else None,
                             scale=float(z["scale"]) if "scale" in z.files else None)


async def submit(host: Host, jobs: list) -> list:
    """Queue ``jobs`` (job-register dicts) in the command ring behind the
    entries already submitted, ``irq`` on the last only, and ring the
    doorbell once.  Returns their queue indices."""
    tail = RMAP["cq_ptr"].unpack(await host.read("cq_ptr"))["tail"]
    idx = [(tail + k) & 0xFFFF for k in range(len(jobs))]
    for k, (e, regs) in enumerate(zip(idx, jobs)):
        words = dict(regs, cq_flags=CQ_FLAGS.pack(irq=int(k == len(jobs) - 1), tag=k))
        for w, name in enumerate(CQ_DESC):
            await host.write_window("cq_ring", (e % CQ_ENTRIES) * CQ_ENTRY_WORDS + w, words[name])
    await host.write("cq_doorbell", RMAP["cq_doorbell"].pack(tail=(tail + len(jobs)) & 0xFFFF, ring=1))
    return idx


async def read_record(host: Host, index: int) -> dict:
    """The completion record of queue index ``index`` (``CQ_CPL`` names -> word)."""
    base = (index % CQ_ENTRIES) * CQ_ENTRY_WORDS
    return {name: await host.read_window("cq_cpl", base + w) for w, name in enumerate(CQ_CPL)}


def record_counters(rec: dict) -> dict:
    return {n: rec[f"{n}_lo"] | (rec[f"{n}_hi"] << 32) for n in COUNTERS}


class _Job:
    """A job spec made ready on the NPU: its case and plan placed in DRAM,
    its registers computed (``_prepare``)."""

    def __init__(self, spec, case, plan, model, power_up, tsv, retain):
        self.spec, self.case, self.plan, self.model, self.retain = spec, case, plan, model, retain
        self.power_up, self.tsv = power_up, tsv
        self.regs = job_registers(plan, CFG, spec.get("debug", 0))
        self.expected = self.s_spec = None
        self.wall = 0.0


async def _prepare(dut, spec, seed, base=None, keep=False, group=False,
                   keep_state=False) -> "tuple[_Job, Host, object]":
    """Steps 1 and 2 for one job: power-up when needed, the DRAM model, the
    job's DRAM writes.  ``keep``: a later member of a queued group (the NPU,
    its DRAM and the DRAM server as the previous member left them);
    ``keep_state`` (or the spec's): no power-up, the DRAM kept, as for a
    resident job; ``group``: a member of a group (its DRAM model is kept
    for the next member).  Returns the job, the
    host and the Python DRAM server's task (or None)."""
    case = _load_case(spec["inputs"])
    resident = spec.get("resident")
    if resident:
        plan = plan_job(case, CFG, base=resident["base"], overrides=spec.get("overrides"),
                        kv_region=resident["kv"])
    else:
        plan = plan_job(case, CFG, overrides=spec.get("overrides"), **({} if base is None else dict(base=base)))
    stress = spec.get("stress") or {}
    delay = int(stress.get("dram_delay", 0))
    member = keep                       # a later member of a queued group
    keep = keep or keep_state or bool(spec.get("keep_state"))
    retain = bool(resident) or keep or group
    # The simulator serves the DRAM itself unless the job wants random response
    # delays (the Python server's); either way the bytes live in one store.
    # a new DRAMModel starts from zeroed storage: resident jobs keep one
    if (resident or keep) and RESIDENT_MODEL:
        model = RESIDENT_MODEL[0]
        model.rng, model.max_extra_delay = random.Random(seed), delay
    else:
        model = DRAMModel(CFG, seed=seed, max_extra_delay=delay, buffer=HOOK[1] if HOOK else None)
        RESIDENT_MODEL[:] = [model] if retain else []
    host = Host(dut, model, idle=int(stress.get("host_idle", 0)), rng=random.Random(seed))
    if stress:
        dut._log.info(f"job {spec['name']}: stress {stress}, seed {seed}")
    dut._log.info(f"job {spec['name']}: DRAM served by "
                  + ("the simulator (sim/dram_hook.cpp)" if HOOK and not delay else "the Python model"))
    # a resident job runs on the NPU as the last one left it: reset and TSV
    # self-test only at power-up (and after a job that failed)
    power_up = not member and not ((resident or keep) and POWERED[0])
    server = None
    if not member:                      # a later group member finds the DRAM served already
        if HOOK:
            HOOK[0].flashnpu_dram_serve(0)
        if power_up:
            await reset(dut)
        if HOOK and not delay:
            HOOK[0].flashnpu_dram_serve(1)
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
    job = _Job(spec, case, plan, model, power_up, tsv, retain)
    s_spec = spec.get("s_check")
    if s_spec:
        job.s_spec, job.expected = s_spec, expected_p_counts(case, CFG)
        if s_spec.get("flip_mask") is not None:         # fault: one mask bit corrupted in DRAM
            addr, bit = mask_bit_address(plan["regs"], CFG, *s_spec["flip_mask"])
            model.write(addr, bytes([model.read(addr, 1)[0] ^ (1 << bit)]))
            dut._log.info(f"job {spec['name']}: mask bit {s_spec['flip_mask']} flipped in DRAM")
        await host.write("s_check", 1)
    if spec.get("watchdog") is not None:
        await host.write("watchdog", int(spec["watchdog"]))
    if stress.get("sram_stall"):
        await host.write("stall", RMAP["stall"].pack(rate=int(stress["sram_stall"]), seed=seed & 0xFFFF))
    return job, host, server


async def _wait_irq(dut, timeout: int) -> None:
    """Until ``irq`` rises (one trigger, no per-cycle Python) or ``timeout`` cycles."""
    if not int(dut.irq.value):
        await First(RisingEdge(dut.irq), Timer(timeout * CLOCK_NS, unit="ns"))


async def _run_s_checked(dut, host: Host, job: _Job, timeout: int):
    """A direct job under the S-tile check: poll status every 32 cycles and
    compare each queued tile count.  Returns (status, seen, first bad tile)."""
    spec, s_spec = job.spec, job.s_spec
    waited, step, seen, bad, st = 0, 32, [], None, None
    while waited < timeout:
        await ClockCycles(dut.clk, step)
        waited += step
        st = RMAP["status"].unpack(await host.read("status"))
        bad = await drain_s_tiles(host, job.expected, int(s_spec.get("threshold", 0)), seen)
        if bad:
            dut._log.error(f"job {spec['name']}: S-tile check: head {bad['head']} q tile "
                           f"{bad['q_tile']} kv tile {bad['kv_tile']}: {bad['count']} non-zero P, "
                           f"golden {bad['expected']} (threshold {s_spec.get('threshold', 0)}); job stopped")
            return st, seen, bad
        if st["done"]:
            return st, seen, None
    raise AssertionError(f"job {spec['name']}: no done after {timeout} cycles; status {st}")


async def _collect(dut, host: Host, job: _Job, st: dict, cnt: dict, extra: dict) -> None:
    """Steps 4 and 5: O from DRAM, the checks' registers, the output .npz."""
    spec, plan, model = job.spec, job.plan, job.model
    irq = await host.read("irq")
    o = plan["o"]
    heads, seq_q, hd = o["heads"], o["seq_q"], o["head_dim"]
    raw = np.frombuffer(model.read(o["base"], heads * o["head_stride"]), np.uint8)
    rows = raw.reshape(heads, seq_q, o["row_stride"])[:, :, :4 * hd]
    out = np.ascontiguousarray(rows).view(np.float32).reshape(heads, seq_q, hd)
    lo, hi = plan["o_extent"]
    untouched = model.read(lo, hi - lo) == bytes([O_SENTINEL]) * (hi - lo)
    err = int(st["error"])
    POWERED[0] = job.retain and not err         # after any error: reset (FAIL holds until reset)
    msg = NPUError(err).name if err in NPUError._value2member_map_ else str(err)
    dut._log.info(f"job {spec['name']}: status {msg} dma_code {st['dma_code']} irq {irq:#x} "
                  f"cycles {cnt['total_cycles']} mac_busy {cnt['mac_busy_cycles']} wall {job.wall:.2f} s")
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
    meta = dict(name=spec["name"], error=err, error_name=msg, dma_code=int(st["dma_code"]),
                irq=irq, o_untouched=bool(untouched), counters=cnt, wall_s=round(job.wall, 3),
                sram_bytes_sim=CFG.sram_bytes, tsv=job.tsv, reg_check=reg_check, kv_check=kv_check,
                powered_up=job.power_up, **extra)
    np.savez(spec["out"], o=out, meta_json=np.array(json.dumps(meta)))


async def _end_dram(spec_name: str, server) -> None:
    if server is not None:
        server.cancel()
    if HOOK:
        HOOK[0].flashnpu_dram_serve(0)
        if HOOK[0].flashnpu_dram_errors():
            raise AssertionError(f"job {spec_name}: the NPU accessed DRAM outside its {CFG.dram_bytes} bytes")


async def run_job(dut, spec, seed):
    """One job: a ``group`` spec queues all its members (``run_group``); a
    job with ``submit: "csr"`` (or the S-tile check) is programmed register
    by register and started with ``ctrl.start``; every other job goes
    through the command ring (one descriptor, one doorbell, its completion
    record)."""
    if spec.get("group"):
        return await run_group(dut, spec, seed)
    job, host, server = await _prepare(dut, spec, seed)
    await host.write("irq", 0b11)
    timeout = int(spec.get("timeout") or 20_000_000)
    direct = spec.get("submit") == "csr" or job.s_spec
    t0 = time.time()                        # wall_s: from the start command (doorbell) to done
    extra = {}
    if direct:
        for name, val in job.regs.items():
            await host.write(name, val)
        await host.write("ctrl", 1)
        if job.s_spec:
            st, seen, bad = await _run_s_checked(dut, host, job, timeout)
            extra["s_check"] = dict(stopped=bad is not None, tiles=len(seen), **(bad or {}))
        else:
            await _wait_irq(dut, timeout)
            st = RMAP["status"].unpack(await host.read("status"))
            if not st["done"]:
                raise AssertionError(f"job {spec['name']}: no done after {timeout} cycles; status {st}")
        job.wall = time.time() - t0
        cnt = {}
        for n in COUNTERS:
            try:
                cnt[n] = await host.read64(n)
            except XValueError as e:          # reported, not fatal: O is still checked
                dut._log.error(f"job {spec['name']}: counter {n}: {e}")
                cnt[n] = -1
    else:
        (index,) = await submit(host, [job.regs])
        await _wait_irq(dut, timeout)
        job.wall = time.time() - t0
        ptr = RMAP["cq_ptr"].unpack(await host.read("cq_ptr"))
        if ptr["head"] != (index + 1) & 0xFFFF:
            cq = RMAP["cq_status"].unpack(await host.read("cq_status"))
            raise AssertionError(f"job {spec['name']}: no done after {timeout} cycles (queue entry {index}); "
                                 f"cq_ptr {ptr}, cq_status {cq}")
        rec = await read_record(host, index)
        st = RMAP["status"].unpack(rec["status"])
        cnt = record_counters(rec)
        extra["queue"] = dict(index=index, t_start=rec["t_start"], t_done=rec["t_done"])
    await _end_dram(spec["name"], server)
    await _collect(dut, host, job, st, cnt, extra)


async def run_group(dut, spec, seed):
    """A queued sweep: every member's descriptor in the command ring, one
    doorbell, ``irq`` on the last member only.  ``ring_reset``: reset the
    ring (``cq_ctl.reset``) first; ``keep_state``: no power-up (the NPU as
    the previous spec left it).  Every member's output gets ``queue`` (its
    index and completion stamps) and ``group``: ``irq_edges`` (rising edges
    of ``irq`` from the doorbell until all completed), ``cq_ptr`` and
    ``cq_status`` after, and with ``records`` the completion record of every
    ring entry (8 x 32 bus reads, so only when asked)."""
    jobs, base, server = [], None, None
    for k, mspec in enumerate(spec["group"]):
        job, host, srv = await _prepare(dut, mspec, int(mspec.get("seed", seed + k)), base=base,
                                        keep=k > 0, group=True, keep_state=bool(spec.get("keep_state")))
        server = server or srv
        base = job.plan["end"]
        jobs.append(job)
    if spec.get("ring_reset"):
        await host.write("cq_ctl", RMAP["cq_ctl"].pack(reset=1))
    await host.write("irq", 0b11)
    edges = [0]

    async def count_edges():
        while True:
            await RisingEdge(dut.irq)
            edges[0] += 1

    counter = cocotb.start_soon(count_edges())
    t0 = time.time()
    idx = await submit(host, [j.regs for j in jobs])
    timeout = sum(int(j.spec.get("timeout") or 20_000_000) for j in jobs)
    await _wait_irq(dut, timeout)
    await ClockCycles(dut.clk, 64)             # a stale entry that ran on would show up here
    counter.cancel()
    wall = time.time() - t0
    ptr = RMAP["cq_ptr"].unpack(await host.read("cq_ptr"))
    entries = range(CQ_ENTRIES) if spec.get("records") else sorted({e % CQ_ENTRIES for e in idx})
    records = {e: await read_record(host, e) for e in entries}
    group = dict(irq_edges=edges[0], cq_ptr=ptr, cq_status=RMAP["cq_status"].unpack(await host.read("cq_status")))
    if spec.get("records"):
        group["records"] = [records[e] for e in range(CQ_ENTRIES)]
    await _end_dram(spec["name"], server)
    for job, index in zip(jobs, idx):
        rec = records[index % CQ_ENTRIES]
        job.wall = wall / len(jobs)
        await _collect(dut, host, job, RMAP["status"].unpack(rec["status"]), record_counters(rec),
                       dict(queue=dict(index=index, t_start=rec["t_start"], t_done=rec["t_done"]), group=group))


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
            rsp.write((json.dumps(dict(ok=True, name=spec["name"], out=spec.get("out"))) + "\n").encode())
