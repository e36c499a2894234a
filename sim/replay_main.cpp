// C++-only replay harness of the NPU: the simulator's own speed, no Python.
//
// Built by flashnpu.sim.replay (Verilator --exe with this file as main) and
// run on a job folder that flashnpu.sim.replay.record_job wrote from the same
// job plan the cocotb testbench uses:
//
//   dram.bin   the DRAM image from address 0 (Q, K, V, mask, O sentinel)
//   host.txt   the host program, one operation per line:
//                W addr value            CSR write (two falling edges, as cocotb's Host.write)
//                P addr mask value step  read addr every `step` cycles until (v & mask) == value
//                R name addr             CSR read, reported as `name value`
//                T                       start timing (the job's first cycle)
//                O base bytes            dump DRAM[base, base+bytes) to o.bin
//
// The DRAM is sim/dram_hook.cpp, the same code that serves the cocotb runs.
// Host inputs change in the falling-edge half of a cycle, like cocotb's Host.  Output on stdout: `cycles N`, `wall_s X`, `cycles_per_s Y`
// and every `R` line's value.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "Vtop.h"
#include "verilated.h"

#include "dram_hook.cpp"

namespace {

struct Harness {
    std::unique_ptr<VerilatedContext> ctx;
    std::unique_ptr<Vtop> top;
    uint64_t cycle = 0;

    void fall() {
        top->clk = 0;
        top->eval();
        flashnpu_dram_step(top.get());
        ++cycle;
    }

    void rise() {
        top->clk = 1;
        top->eval();
        flashnpu_dram_step(top.get());
    }

    void cycles(uint64_t n) {
        for (uint64_t i = 0; i < n; ++i) {
            fall();
            rise();
        }
    }

    // Host.write: inputs set at a falling edge, w_en dropped at the next one.
    void write(uint32_t addr, uint32_t value) {
        fall();
        top->csr_addr = addr;
        top->csr_w_data = value;
        top->csr_w_en = 1;
        rise();
        fall();
        top->csr_w_en = 0;
        rise();
    }

    uint32_t read(uint32_t addr) {
        fall();
        top->csr_addr = addr;
        top->csr_r_en = 1;
        rise();
        fall();
        top->csr_r_en = 0;
        const uint32_t v = top->csr_r_data;
        rise();
        return v;
    }
};

}  // namespace

int main(int argc, char **argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: %s JOB_FOLDER\n", argv[0]);
        return 2;
    }
    const std::string dir = argv[1];
    Harness h;
    h.ctx = std::make_unique<VerilatedContext>();
    h.ctx->commandArgs(argc, argv);
    h.top = std::make_unique<Vtop>(h.ctx.get());
    {
        std::ifstream f(dir + "/dram.bin", std::ios::binary);
        if (!f) { std::fprintf(stderr, "replay: no %s/dram.bin\n", dir.c_str()); return 2; }
        std::vector<char> image((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
        uint8_t *mem = flashnpu_dram_attach(image.size());
        if (mem == nullptr) { std::fprintf(stderr, "replay: cannot allocate the DRAM\n"); return 1; }
        std::memcpy(mem, image.data(), image.size());
    }
    std::ifstream prog(dir + "/host.txt");
    if (!prog) { std::fprintf(stderr, "replay: no %s/host.txt\n", dir.c_str()); return 2; }

    // reset as sim/cocotb_npu.py does: 3 cycles with rst, then 1 without
    h.top->rst = 1;
    h.top->csr_w_en = h.top->csr_r_en = 0;
    h.top->csr_addr = h.top->csr_w_data = 0;
#define FLASHNPU_RESP_OFF(c) h.top->FLASHNPU_BK(c, resp_valid) = 0;
    FLASHNPU_EACH(FLASHNPU_RESP_OFF)
    h.cycles(3);
    h.top->rst = 0;
    h.cycles(1);
    flashnpu_dram_serve(1);

    auto t0 = std::chrono::steady_clock::now();
    uint64_t c0 = h.cycle;
    std::string line;
    while (std::getline(prog, line)) {
        std::istringstream in(line);
        std::string op;
        in >> op;
        if (op == "W") {
            uint64_t a, v;
            in >> a >> v;
            h.write(uint32_t(a), uint32_t(v));
        } else if (op == "P") {
            uint64_t a, mask, want, step, limit;
            in >> a >> mask >> want >> step >> limit;
            for (uint64_t waited = 0;; waited += step) {
                if (waited >= limit) {
                    std::fprintf(stderr, "replay: register %llu never matched after %llu cycles\n",
                                 (unsigned long long)a, (unsigned long long)limit);
                    return 1;
                }
                h.cycles(step);
                if ((h.read(uint32_t(a)) & mask) == want) break;
            }
        } else if (op == "R") {
            std::string name;
            uint64_t a;
            in >> name >> a;
            std::printf("%s %u\n", name.c_str(), h.read(uint32_t(a)));
        } else if (op == "T") {
            t0 = std::chrono::steady_clock::now();
            c0 = h.cycle;
        } else if (op == "O") {
            uint64_t base, n;
            in >> base >> n;
            std::ofstream o(dir + "/o.bin", std::ios::binary);
            o.write(reinterpret_cast<const char *>(flashnpu_dram::buffer + base), std::streamsize(n));
        } else if (!op.empty()) {
            std::fprintf(stderr, "replay: unknown host operation %s\n", op.c_str());
            return 2;
        }
        if (op == "P" && line.find(" job") != std::string::npos) {
            const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            const uint64_t n = h.cycle - c0;
            std::printf("cycles %llu\nwall_s %.6f\ncycles_per_s %.1f\n", (unsigned long long)n, wall,
                        n / wall);
        }
    }
    h.top->final();
    if (flashnpu_dram_errors()) {
        std::fprintf(stderr, "replay: the NPU accessed DRAM outside the image\n");
        return 1;
    }
    return 0;
}
