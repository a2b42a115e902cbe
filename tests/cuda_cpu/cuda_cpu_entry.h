// Registering kernels with the CPU runtime: an entry calls its kernel with cudaLaunchKernel-style
// arguments (an array of pointers to the values), the parameter types taken from the kernel itself.
#pragma once

#include <cstddef>
#include <type_traits>
#include <utility>

namespace hvd_cpu {

typedef void (*Kernel)(void** args);

struct Entry {
    const char* name;
    Kernel kernel;
};

struct Registrar {
    Registrar(const Entry* entries, int n);
};

template <typename... A, std::size_t... I>
inline void invoke_at(void (*f)(A...), void** args, std::index_sequence<I...>) {
    f(*static_cast<std::remove_reference_t<A>*>(args[I])...);
}

template <typename... A>
inline void invoke(void (*f)(A...), void** args) {
    invoke_at(f, args, std::index_sequence_for<A...>{});
}

}  // namespace hvd_cpu
