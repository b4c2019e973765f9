// Bit views: a tensor's bytes seen as integers of the same width, so that copies between a
// storage and a transfer slot move bits, never values.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace spbcast::detail {

// A view of `storage` that reads the same bytes as a tensor of `dtype`, but typed as an
// integer of the same width, so copies move bits and never values (NaN payloads, float8 without
// copy kernels, conj/neg bits all stay exactly as stored).
inline at::Tensor raw_bits_view(const c10::Storage& storage, c10::ScalarType dtype,
                                std::int64_t offset, std::vector<std::int64_t> sizes,
                                std::vector<std::int64_t> strides) {
    const auto itemsize = static_cast<std::int64_t>(c10::elementSize(dtype));
    c10::ScalarType bits = at::kByte;
    switch (itemsize) {
        case 1: bits = at::kByte; break;
        case 2: bits = at::kShort; break;
        case 4: bits = at::kInt; break;
        default: bits = at::kLong; break;
    }
    if (itemsize > 8) {  // complex128: two int64 words per element
        const std::int64_t words = itemsize / 8;
        for (auto& s : strides) s *= words;
        sizes.push_back(words);
        strides.push_back(1);
        offset *= words;
    }
    return at::empty({0}, at::TensorOptions().dtype(bits)).set_(storage, offset, sizes, strides);
}

}  // namespace spbcast::detail
