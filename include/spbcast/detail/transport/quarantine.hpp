// Where the buffers of a failed broadcast go: the backend may still write into them.
#pragma once

#include <ATen/ATen.h>

#include <mutex>
#include <utility>
#include <vector>

namespace spbcast::detail {

// Buffers of broadcasts that failed while possibly still in flight inside the backend. They
// are kept alive until the process exits, so a late write by the backend can never land in
// freed memory. Only failures put anything here.
inline void quarantine(std::vector<at::Tensor> buffers) {
    static std::mutex mutex;
    static auto* kept = new std::vector<at::Tensor>();  // never destroyed: outlives backends
    std::lock_guard<std::mutex> lock(mutex);
    for (auto& b : buffers) kept->push_back(std::move(b));
}

}  // namespace spbcast::detail
