// Linked into every Verilator ``--hierarchical`` build (see sim/runner.py).
//
// Verilator's hier_block wrappers (--lib-create) keep a sequence number in a
// C++ container, ``long long m_seqnum;``, that the generated constructor
// never initialises.  The container is allocated with aligned ``new``
// (alignas(64) model class), so m_seqnum starts with whatever the heap held.
// The parent compares the (unsigned, 64-bit) numbers returned by the wrapper's
// seq_update and its one-time combo_update to choose which outputs to use;
// when the garbage is a small negative value the counter wraps through zero
// and the block's outputs stay on the time-0 combo values -- e.g. a whole PE
// row reading back P = 0.  Zero-filling aligned allocations makes m_seqnum
// start at 0, deterministically.  Only aligned ``new`` is replaced (Verilator
// models and their symbol tables); the matching deletes free() as libstdc++'s do.
#include <cstdlib>
#include <cstring>
#include <new>

void* operator new(std::size_t n, std::align_val_t al) {
    std::size_t a = static_cast<std::size_t>(al);
    if (a < sizeof(void*)) a = sizeof(void*);
    void* p = nullptr;
    if (posix_memalign(&p, a, n ? n : 1) != 0) throw std::bad_alloc();
    std::memset(p, 0, n);
    return p;
}
void* operator new[](std::size_t n, std::align_val_t al) { return ::operator new(n, al); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
