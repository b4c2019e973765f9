// spbcast::digest(value): a 64-bit checksum of everything a broadcast preserves - the schema,
// every scalar and string, container sizes, optional and variant states, and per tensor its
// dtype, sizes, strides, flags, bits, and aliasing. Two values with equal digests are equal as
// far as spbcast can tell; use it to check that every rank of an SP group holds the same batch
// without sending the batch again.
#pragma once

#include "detail/wire/bit_views.hpp"
#include "detail/wire/bytes.hpp"
#include "detail/wire/send_plan.hpp"
#include "detail/wire/value_codec.hpp"
#include "options.hpp"
#include "schema.hpp"

#include <cstdint>

namespace spbcast {

template <class T>
std::uint64_t digest(const T& value) {
    detail::require_supported<T>();
    const limits unbounded{~std::size_t{0}, ~std::size_t{0}, ~std::size_t{0}, ~std::uint64_t{0},
                           ~std::size_t{0}, ~std::size_t{0}, 4096};
    detail::send_plan plan;
    detail::byte_writer out;
    detail::encoder enc(out, plan, unbounded);
    enc.value(value);
    options opts;
    opts.limits = unbounded;
    plan.finish(opts);
    plan.write_tensor_tables(out);
    std::uint64_t hash = detail::checksum64(out.bytes().data(), out.size(), fingerprint_of<T>);
    for (const at::Tensor& t : plan.tensors()) {
        if (t.numel() == 0) continue;
        at::Tensor bits = detail::raw_bits_view(t.storage(), t.scalar_type(), t.storage_offset(),
                                                t.sizes().vec(), t.strides().vec())
                              .contiguous();
        hash = detail::checksum64(bits.data_ptr(), bits.numel() * bits.element_size(), hash);
    }
    return hash;
}

}  // namespace spbcast
