"""The CSR block: access modes, read latency, map export."""

import pytest
from amaranth.sim import Simulator

from flashnpu.hdl.csr import CSRBank, Field, Register, RegisterMap


def make_map():
    rm = RegisterMap("test")
    rm.add(Register("ctrl", "w1p", [Field("start", 1), Field("abort", 1, 1)]))
    rm.add(Register("base", "rw", reset=0x100))
    rm.add(Register("status", "ro", [Field("busy", 1), Field("error", 8, 8)]))
    rm.add(Register("irq", "w1c", [Field("done", 1)]))
    rm.add(Register("len", "rw", [Field("n", 16, 0), Field("flag", 1, 20)], reset=0xFFFF))
    return rm


def test_bank_access_modes():
    rm = make_map()
    dut = CSRBank(rm)
    seen = {}

    async def bench(ctx):
        async def write(name, value):
            ctx.set(dut.addr, rm[name].address)
            ctx.set(dut.w_data, value)
            ctx.set(dut.w_en, 1)
            await ctx.tick()
            ctx.set(dut.w_en, 0)

        async def read(name):
            ctx.set(dut.addr, rm[name].address)
            ctx.set(dut.r_en, 1)
            await ctx.tick()
            ctx.set(dut.r_en, 0)
            return ctx.get(dut.r_data)

        assert await read("base") == 0x100
        await write("base", 0xDEADBEEF)
        assert ctx.get(dut.port("base", "value")) == 0xDEADBEEF
        assert await read("base") == 0xDEADBEEF
        assert await read("len") == 0xFFFF                  # reset of a register with fields
        assert ctx.get(dut.port("len", "value")) == {"n": 0xFFFF, "flag": 0}
        await write("len", (1 << 20) | 5)
        assert (ctx.get(dut.port("len", "value")).n, ctx.get(dut.port("len", "value")).flag) == (5, 1)
        ctx.set(dut.port("status", "status"), {"busy": 1, "error": 7})
        assert rm["status"].unpack(await read("status")) == dict(busy=1, error=7)
        await write("status", 0)                            # ignored
        await write("ctrl", 1)
        seen["pulse"] = ctx.get(dut.port("ctrl", "pulse")).start
        await ctx.tick()
        seen["after"] = ctx.get(dut.port("ctrl", "pulse")).start
        assert await read("ctrl") == 0
        ctx.set(dut.port("irq", "set"), {"done": 1})
        await ctx.tick()
        ctx.set(dut.port("irq", "set"), {"done": 0})
        assert await read("irq") == 1                       # sticky
        await write("irq", 1)
        assert await read("irq") == 0

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()
    assert seen == dict(pulse=1, after=0)


def test_map_export_and_errors():
    rm = make_map()
    d = rm.to_dict()
    assert [r["address"] for r in d["registers"]] == [0, 4, 8, 12, 16]
    assert d["registers"][2]["fields"][1] == dict(name="error", offset=8, width=8, doc="")
    with pytest.raises(ValueError, match="'base' is used twice"):
        rm.add(Register("base", "rw"))
    with pytest.raises(ValueError, match="access must be one of"):
        Register("x", "wo")
    with pytest.raises(ValueError, match="overlaps"):
        Register("x", "rw", [Field("a", 4), Field("b", 4, 2)])
    with pytest.raises(ValueError, match="status.busy=2 does not fit in 1 bits"):
        rm["status"].pack(busy=2)


def test_window_forwards_writes_and_reads():
    """A window's words go to the block's memory; a read answers one cycle
    after r_en like a register read; an ro window ignores writes."""
    from amaranth import Module
    from amaranth.lib.memory import Memory

    from flashnpu.hdl.csr import Window

    rm = make_map()
    ring = rm.add_window(Window("ring", 8, "rw"))
    cpl = rm.add_window(Window("cpl", 4, "ro"))
    assert ring.address == 8 and cpl.address == 16 and rm.addr_width == 5
    with pytest.raises(ValueError, match="before the windows"):
        rm.add(Register("late", "rw"))
    with pytest.raises(ValueError, match="not a power of two"):
        Window("odd", 6)
    assert rm.to_dict()["windows"][0] == dict(name="ring", address=32, words=8, access="rw", doc="")
    bank = CSRBank(rm)
    m = Module()
    m.submodules.bank = bank
    m.submodules.mem = mem = Memory(shape=32, depth=8, init=[])
    m.submodules.rom = rom = Memory(shape=32, depth=4, init=[0x10, 0x11, 0x12, 0x13])
    wp, rp, cp = mem.write_port(), mem.read_port(), rom.read_port()
    m.d.comb += [wp.addr.eq(bank.window_port("ring", "addr")), wp.en.eq(bank.window_port("ring", "w_en")),
                 wp.data.eq(bank.window_port("ring", "w_data")),
                 rp.addr.eq(bank.window_port("ring", "addr")), rp.en.eq(bank.window_port("ring", "r_en")),
                 bank.window_port("ring", "r_data").eq(rp.data),
                 cp.addr.eq(bank.window_port("cpl", "addr")), cp.en.eq(bank.window_port("cpl", "r_en")),
                 bank.window_port("cpl", "r_data").eq(cp.data)]
    seen = {}

    async def bench(ctx):
        async def access(addr, value=None):
            ctx.set(bank.addr, addr)
            ctx.set(bank.w_data, value or 0)
            ctx.set(bank.w_en if value is not None else bank.r_en, 1)
            await ctx.tick()
            ctx.set(bank.w_en, 0)
            ctx.set(bank.r_en, 0)
            return ctx.get(bank.r_data)

        for i in range(8):
            await access(ring.address + i, 0x100 + i)
        await access(cpl.address + 1, 0xBAD)                 # ignored
        seen["ring"] = [await access(ring.address + i) for i in range(8)]
        seen["cpl"] = [await access(cpl.address + i) for i in range(4)]
        seen["reg"] = await access(rm["base"].address)       # a register read after window reads

    sim = Simulator(m)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()
    assert seen == dict(ring=[0x100 + i for i in range(8)], cpl=[0x10, 0x11, 0x12, 0x13], reg=0x100)
