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
#ifndef FLASHNPU_DRAM_CHANNELS
#error "FLASHNPU_DRAM_CHANNELS (the NPU's DRAM channels) must be defined"
#endif

namespace flashnpu_dram {
constexpr int kWordBytes = FLASHNPU_WORD_BYTES;
uint8_t *buffer = nullptr;
uint64_t size = 0;
int serving = 0;
int prev_clk = -1;
uint64_t cycle = 0;
uint64_t errors = 0;
// One channel's answer queue: read answers in request order.
struct Channel {
    std::deque<std::vector<uint8_t>> answers;
    std::deque<uint64_t> due;
};
Channel channels[FLASHNPU_DRAM_CHANNELS];
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

// Start (1) or stop (0) serving the backend buses; either clears the queues.
__attribute__((visibility("default"))) void flashnpu_dram_serve(int on) {
    using namespace flashnpu_dram;
    serving = on;
    for (auto &ch : channels) {
        ch.answers.clear();
        ch.due.clear();
    }
}

// Out-of-range accesses since the last call (the access is dropped).
__attribute__((visibility("default"))) uint64_t flashnpu_dram_errors(void) {
    uint64_t e = flashnpu_dram::errors;
    flashnpu_dram::errors = 0;
    return e;
}
}

// Verilator escapes the double underscores of the backend ports' names
// (bk__<c>__req_valid, ...).
#define FLASHNPU_BK(c, name) bk___05F##c##___05F##name

namespace flashnpu_dram {
// Falling edge: take channel c's request (if any).
template <class Wdata>
static inline void take(Channel &ch, bool valid, bool write, uint64_t word, uint64_t mask, const Wdata &wdata) {
    if (!valid) return;
    const uint64_t addr = word * kWordBytes;
    if (addr + kWordBytes > size) {
        ++errors;
        return;
    }
    if (write) {
        for (int i = 0; i < kWordBytes; ++i)
            if (mask >> i & 1) buffer[addr + i] = uint8_t(wdata[i / 4] >> (8 * (i % 4)));
    } else {
        ch.answers.emplace_back(buffer + addr, buffer + addr + kWordBytes);
        ch.due.push_back(cycle + 1);
    }
}

// Rising edge: drive channel c's answer (if one is due).
template <class Rdata>
static inline void answer(Channel &ch, uint8_t &valid, Rdata &rdata) {
    if (!ch.due.empty() && ch.due.front() <= cycle + 1) {
        const auto &w = ch.answers.front();
        for (int i = 0; i < kWordBytes / 4; ++i) {
            uint32_t v;
            std::memcpy(&v, w.data() + 4 * i, 4);
            rdata[i] = v;
        }
        valid = 1;
        ch.answers.pop_front();
        ch.due.pop_front();
    } else {
        valid = 0;
    }
}
}  // namespace flashnpu_dram

#define FLASHNPU_TAKE(c)                                                                          \
    flashnpu_dram::take(flashnpu_dram::channels[c], top->FLASHNPU_BK(c, req_valid),              \
                        top->FLASHNPU_BK(c, req_write), uint64_t(top->FLASHNPU_BK(c, req_addr)), \
                        uint64_t(top->FLASHNPU_BK(c, req_wmask)), top->FLASHNPU_BK(c, req_wdata));
#define FLASHNPU_ANSWER(c)                                                                      \
    flashnpu_dram::answer(flashnpu_dram::channels[c], top->FLASHNPU_BK(c, resp_valid),         \
                          top->FLASHNPU_BK(c, resp_data));
// FLASHNPU_EACH(X): X(0) ... X(FLASHNPU_DRAM_CHANNELS - 1), up to 16 channels
#if FLASHNPU_DRAM_CHANNELS > 16
#error "dram_hook.cpp serves at most 16 DRAM channels"
#endif
#define FLASHNPU_EACH(X)                                                                     \
    X(0) FLASHNPU_C1(X) FLASHNPU_C2(X) FLASHNPU_C3(X) FLASHNPU_C4(X) FLASHNPU_C5(X)          \
    FLASHNPU_C6(X) FLASHNPU_C7(X) FLASHNPU_C8(X) FLASHNPU_C9(X) FLASHNPU_C10(X)              \
    FLASHNPU_C11(X) FLASHNPU_C12(X) FLASHNPU_C13(X) FLASHNPU_C14(X) FLASHNPU_C15(X)
#if FLASHNPU_DRAM_CHANNELS > 1
#define FLASHNPU_C1(X) X(1)
#else
#define FLASHNPU_C1(X)
#endif
#if FLASHNPU_DRAM_CHANNELS > 2
#define FLASHNPU_C2(X) X(2)
#else
#define FLASHNPU_C2(X)
#endif
#if FLASHNPU_DRAM_CHANNELS > 3
#define FLASHNPU_C3(X) X(3)
#else
#define FLASHNPU_C3(X)
#endif
#if FLASHNPU_DRAM_CHANNELS > 4
#define FLASHNPU_C4(X) X(4)
#else
#define FLASHNPU_C4(X)
#endif
#if FLASHNPU_DRAM_CHANNELS > 5
#define FLASHNPU_C5(X) X(5)
#else
#define FLASHNPU_C5(X)
#endif
#if FLASHNPU_DRAM_CHANNELS > 6
#define FLASHNPU_C6(X) X(6)
#else
#define FLASHNPU_C6(X)
#endif
#if FLASHNPU_DRAM_CHANNELS > 7
#define FLASHNPU_C7(X) X(7)
#else
#define FLASHNPU_C7(X)
#endif
#if FLASHNPU_DRAM_CHANNELS > 8
#define FLASHNPU_C8(X) X(8)
#else
#define FLASHNPU_C8(X)
#endif
#if FLASHNPU_DRAM_CHANNELS > 9
#define FLASHNPU_C9(X) X(9)
#else
#define FLASHNPU_C9(X)
#endif
#if FLASHNPU_DRAM_CHANNELS > 10
#define FLASHNPU_C10(X) X(10)
#else
#define FLASHNPU_C10(X)
#endif
#if FLASHNPU_DRAM_CHANNELS > 11
#define FLASHNPU_C11(X) X(11)
#else
#define FLASHNPU_C11(X)
#endif
#if FLASHNPU_DRAM_CHANNELS > 12
#define FLASHNPU_C12(X) X(12)
#else
#define FLASHNPU_C12(X)
#endif
#if FLASHNPU_DRAM_CHANNELS > 13
#define FLASHNPU_C13(X) X(13)
#else
#define FLASHNPU_C13(X)
#endif
#if FLASHNPU_DRAM_CHANNELS > 14
#define FLASHNPU_C14(X) X(14)
#else
#define FLASHNPU_C14(X)
#endif
#if FLASHNPU_DRAM_CHANNELS > 15
#define FLASHNPU_C15(X) X(15)
#else
#define FLASHNPU_C15(X)
#endif

template <class Top>
static inline void flashnpu_dram_step(Top *top) {
    using namespace flashnpu_dram;
    const int clk = top->clk;
    if (clk == prev_clk) return;
    prev_clk = clk;
    if (!serving) return;
    if (!clk) {                                        // falling edge: take the requests
        ++cycle;
        FLASHNPU_EACH(FLASHNPU_TAKE)
    } else {                                           // rising edge: drive the answers
        FLASHNPU_EACH(FLASHNPU_ANSWER)
    }
}
