// The NPU's DRAM storage inside the Verilator main loop: no Python per cycle.
//
// Included by the cocotb Verilator main that sim/dram_hook.py patches for
// NPU builds.  The storage is one byte buffer that Python maps with ctypes
// (flashnpu_dram_attach), so the testbench's backdoor reads and writes the
// same bytes the simulation does.  While serving (flashnpu_dram_serve(1)),
// flashnpu_dram_step answers the backend bus exactly as
// DRAMModel.cocotb_server does without extra delay: a request seen at the
// falling edge of cycle c is applied at once (writes) and answered right
// after the rising edge of cycle c + 1 (reads), in order.  Jobs with a random
// response delay keep the Python server (flashnpu_dram_serve(0)).
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <vector>

#ifndef FLASHNPU_WORD_BYTES
#error "FLASHNPU_WORD_BYTES (the DRAM word in bytes) must be defined"
#endif

namespace flashnpu_dram {
constexpr int kWordBytes = FLASHNPU_WORD_BYTES;
uint8_t *buffer = nullptr;
uint64_t size = 0;
int serving = 0;
int prev_clk = -1;
uint64_t cycle = 0;
std::deque<std::vector<uint8_t>> answers;
std::deque<uint64_t> due;
uint64_t errors = 0;
}  // namespace flashnpu_dram

extern "C" {
// Allocate (once) and return the zeroed storage of `bytes` bytes.
__attribute__((visibility("default"))) uint8_t *flashnpu_dram_attach(uint64_t bytes) {
    using namespace flashnpu_dram;
    if (buffer == nullptr) {
        buffer = static_cast<uint8_t *>(std::calloc(bytes, 1));
        size = buffer ? bytes : 0;
    }
    return bytes == size ? buffer : nullptr;
}

// Start (1) or stop (0) serving the backend bus; either clears the queue.
__attribute__((visibility("default"))) void flashnpu_dram_serve(int on) {
    using namespace flashnpu_dram;
    serving = on;
    answers.clear();
    due.clear();
}

// Out-of-range accesses since the last call (the access is dropped).
__attribute__((visibility("default"))) uint64_t flashnpu_dram_errors(void) {
    uint64_t e = flashnpu_dram::errors;
    flashnpu_dram::errors = 0;
    return e;
}
}

// Verilator escapes the double underscore of the backend ports' names.
#define FLASHNPU_BK(name) bk___05F##name

template <class Top>
static inline void flashnpu_dram_step(Top *top) {
    using namespace flashnpu_dram;
    const int clk = top->clk;
    if (clk == prev_clk) return;
    prev_clk = clk;
    if (!serving) return;
    if (!clk) {                                        // falling edge: take the request
        ++cycle;
        if (top->FLASHNPU_BK(req_valid)) {
            const uint64_t addr = uint64_t(top->FLASHNPU_BK(req_addr)) * kWordBytes;
            if (addr + kWordBytes > size) {
                ++errors;
                return;
            }
            if (top->FLASHNPU_BK(req_write)) {
                const uint64_t mask = top->FLASHNPU_BK(req_wmask);
                for (int i = 0; i < kWordBytes; ++i)
                    if (mask >> i & 1) buffer[addr + i] = uint8_t(top->FLASHNPU_BK(req_wdata)[i / 4] >> (8 * (i % 4)));
            } else {
                answers.emplace_back(buffer + addr, buffer + addr + kWordBytes);
                due.push_back(cycle + 1);
            }
        }
    } else {                                           // rising edge: drive the answer
        if (!due.empty() && due.front() <= cycle + 1) {
            const auto &w = answers.front();
            for (int i = 0; i < kWordBytes / 4; ++i) {
                uint32_t v;
                std::memcpy(&v, w.data() + 4 * i, 4);
                top->FLASHNPU_BK(resp_data)[i] = v;
            }
            top->FLASHNPU_BK(resp_valid) = 1;
            answers.pop_front();
            due.pop_front();
        } else {
            top->FLASHNPU_BK(resp_valid) = 0;
        }
    }
}
