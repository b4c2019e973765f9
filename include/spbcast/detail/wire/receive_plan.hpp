// The follower's plan of a batch's tensors: the tables the root sent, read back and validated
// against the limits before any allocation; storages allocated (large ones from the receive
// cache the caller passes in, small ones inside their bucket), filled from the slots, and the tensors rebuilt as
// views with the root's dtypes, sizes, strides, relative offsets and flags.
#pragma once

#include "../../error.hpp"
#include "../../options.hpp"
#include "bit_views.hpp"
#include "bytes.hpp"
#include "dtype.hpp"
#include "wire_tables.hpp"

#include <ATen/ATen.h>

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace spbcast::detail {

// Where a follower's storages come from: the receive cache (transport/receive_cache.hpp) in a
// broadcast. The plan takes it as a parameter so that the wire layer needs no transport: the
// fuzzer and the frame tests decode with the same cache, passed in by their caller.
template <class Memory>
concept storage_memory = requires(Memory& memory, std::size_t bytes) {
    { memory.allocate(bytes) } -> std::convertible_to<at::Tensor>;
    memory.begin_batch();
    { Memory::min_cached_bytes } -> std::convertible_to<std::size_t>;
};

class receive_plan {
public:
    // The slot table comes first in every frame body and keeps its layout in every format
    // version, so a follower can always drain the payload it was announced.
    void read_slot_table(byte_reader& in) { slots_ = read_slots(in); }

    // Reads and validates the tensor and storage tables. Nothing is allocated beyond the table
    // vectors, whose lengths are checked against the limits and the frame size first.
    void read_tensor_tables(byte_reader& in, const limits& lim) {
        const auto tensor_count = in.get<std::uint32_t>();
        if (tensor_count > lim.max_tensors)
            in.fail_limit(std::to_string(tensor_count) + " tensors exceed limits.max_tensors = " +
                          std::to_string(lim.max_tensors) + "; use the same limits on every rank");
        if (tensor_count > in.remaining() / 16)
            in.fail("tensor count " + std::to_string(tensor_count) + " exceeds the frame");
        tensors_.resize(tensor_count);
        for (tensor_meta& t : tensors_) {
            const auto code = in.get<std::uint8_t>();
            const auto dtype = dtype_from_code(code);
            if (!dtype)
                in.fail("dtype code " + std::to_string(code) +
                        " is unknown to this LibTorch build (a newer dtype or a corrupt frame)");
            t.dtype = *dtype;
            t.flags = in.get<std::uint8_t>();
            // Only flags a root can send: conj on complex, requires_grad on floating or complex.
            const bool complex = c10::isComplexType(t.dtype);
            if ((t.flags & ~(requires_grad_flag | conj_flag | neg_flag)) != 0 ||
                ((t.flags & conj_flag) && !complex) ||
                ((t.flags & requires_grad_flag) && !complex && !c10::isFloatingType(t.dtype)))
                in.fail("tensor flags " + std::to_string(t.flags) + " are invalid for dtype " +
                        c10::toString(t.dtype));
            const auto dim = in.get<std::uint8_t>();
            if (dim > lim.max_dims)
                in.fail_limit("a tensor with " + std::to_string(dim) + " dimensions exceeds limits.max_dims = " +
                              std::to_string(lim.max_dims) + "; use the same limits on every rank");
            t.storage = in.get<std::uint32_t>();
            t.offset = in.get<std::int64_t>();
            t.sizes.resize(dim);
            t.strides.resize(dim);
            for (auto& v : t.sizes) v = in.get<std::int64_t>();
            for (auto& v : t.strides) v = in.get<std::int64_t>();
        }
        const auto storage_count = in.get<std::uint32_t>();
        if (storage_count > tensor_count)
            in.fail("more storages (" + std::to_string(storage_count) + ") than tensors");
        storages_.resize(storage_count);
        for (storage_meta& s : storages_) {
            s.nbytes = in.get<std::uint64_t>();
            s.gather = in.get<std::uint8_t>() != 0;
            s.slot = in.get<std::uint32_t>();
            s.slot_offset = in.get<std::uint64_t>();
            s.wire_bytes = in.get<std::uint64_t>();
        }
        if (slots_.size() > storage_count)
            in.fail("more transfer slots (" + std::to_string(slots_.size()) + ") than storages");
        validate(in, lim);
        for (slot_meta& slot : slots_) {
            if (!slot.in_frame) continue;
            if (slot.in_place) in.fail("an in-place slot in the frame");
            slot.frame_offset = in.offset();
            in.get_bytes(static_cast<std::size_t>(slot.bytes));
        }
    }

    // Allocates every storage and bucket. Called only once the frame has been validated. A
    // storage sent as a span that fills at least a quarter of its bucket stays a part of that
    // bucket (received in place, never copied); a smaller one is copied out on arrival, so a
    // small tensor a caller keeps alive pins memory in proportion to itself, not a bucket.
    // Gathered storages get memory of their own and are scattered into on arrival.
    template <storage_memory Memory>
    void allocate(Memory& memory) {
        // Only batches that use the cache advance its clock: a small broadcast between two big
        // ones (a loader's envelope, metrics) must not evict the blocks the next big one reuses.
        const bool uses_cache = std::any_of(slots_.begin(), slots_.end(), [](const slot_meta& slot) {
            return slot.bytes >= Memory::min_cached_bytes;
        });
        if (uses_cache) memory.begin_batch();
        storage_data_.assign(storages_.size(), at::Tensor());
        bucket_data_.assign(slots_.size(), at::Tensor());
        for (std::uint32_t i = 0; i < slots_.size(); ++i) {
            const slot_meta& slot = slots_[i];
            if (slot.in_place) continue;
            bucket_data_[i] = memory.allocate(slot.bytes);
            place_bucket_storages(i);
        }
        allocate_remaining_storages(memory);
    }

    // The same-host path: transferred slot `i` already lies in `slot_data[i]` (a mapping of the
    // root's segment). In-place storages and every span in a bucket are those bytes, with no
    // copy: any tensor kept alive keeps its segment mapped anyway (a storage of 1 MiB or more is
    // always in place), so copying the small spans out would only cost every follower a private
    // copy of them (docs/transports.md, "What a kept tensor pins"). Gathered storages get memory
    // of their own. Slots in the frame get buckets of their own, filled from the body like on
    // the network path, with its copy-out rule.
    template <storage_memory Memory>
    void adopt_slots(std::vector<at::Tensor> slot_data, Memory& memory) {
        // What it allocates from the cache (gathered storages, buckets of the frame) is a batch
        // of the cache's, as in allocate().
        const bool uses_cache =
            std::any_of(slots_.begin(), slots_.end(),
                        [](const slot_meta& slot) { return slot.in_frame && slot.bytes >= Memory::min_cached_bytes; }) ||
            std::any_of(storages_.begin(), storages_.end(), [](const storage_meta& storage) {
                return storage.gather && storage.nbytes >= Memory::min_cached_bytes;
            });
        if (uses_cache) memory.begin_batch();
        storage_data_.assign(storages_.size(), at::Tensor());
        bucket_data_ = std::move(slot_data);
        bucket_data_.resize(slots_.size());
        for (std::uint32_t i = 0; i < slots_.size(); ++i) {
            const slot_meta& slot = slots_[i];
            if (slot.in_frame) bucket_data_[i] = memory.allocate(slot.bytes);
            if (slot.in_place) {
                storage_data_[slot.storages.front()] = bucket_data_[i];
                continue;
            }
            place_bucket_storages(i, slot.in_frame);
        }
        allocate_remaining_storages(memory);
        for (std::uint32_t i = 0; i < slots_.size(); ++i)
            if (!slots_[i].in_frame) unpack_slot(i);
    }

    // Where slot `i` is received: straight into its storage when in place, else its bucket.
    at::Tensor slot_receive_tensor(std::uint32_t i) const {
        const slot_meta& slot = slots_[i];
        if (slot.in_place) return storage_data_[slot.storages.front()];
        return bucket_data_[i];
    }

    // Scatters a received bucket's gathered storages (everything else is already in place).
    void unpack_slot(std::uint32_t i) const {
        const slot_meta& slot = slots_[i];
        if (slot.in_place) return;
        const auto* in = bucket_data_[i].data_ptr<std::uint8_t>();
        for (std::uint32_t s : slot.storages) {
            const storage_meta& storage = storages_[s];
            if (storage.copied_out && storage.nbytes != 0)
                std::memcpy(storage_data_[s].data_ptr(), in + storage.slot_offset, storage.nbytes);
            if (!storage.gather) continue;
            for_each_gathered_view(storage, tensors_, [&](const tensor_meta& meta, auto sizes,
                                                          std::uint64_t offset) {
                at::Tensor dst = raw_bits_view(storage_data_[s].storage(), meta.dtype, meta.offset,
                                               std::move(sizes), meta.strides);
                dst.copy_(at::from_blob(const_cast<std::uint8_t*>(in + offset), dst.sizes(), dst.options()));
            });
        }
    }

    // The rebuilt tensors, in table order; equal indices are one tensor (aliases).
    std::vector<at::Tensor> build_tensors() const {
        std::vector<at::Tensor> out;
        out.reserve(tensors_.size());
        for (const tensor_meta& meta : tensors_) {
            at::Tensor t = at::empty({0}, at::TensorOptions().dtype(meta.dtype))
                               .set_(storage_data_[meta.storage].storage(), meta.offset,
                                     meta.sizes, meta.strides);
            if (meta.flags & conj_flag) t._set_conj(true);
            if (meta.flags & neg_flag) t._set_neg(true);
            if (meta.flags & requires_grad_flag) t.set_requires_grad(true);
            out.push_back(std::move(t));
        }
        return out;
    }

    const std::vector<slot_meta>& slots() const { return slots_; }
    std::size_t tensor_count() const { return tensors_.size(); }

private:
    // The span storages of bucket `i`: a part of the bucket, or with `copy_small` (a bucket of
    // memory of its own) copied out on arrival when they fill less than a quarter of it, so a
    // small tensor kept alive does not pin its bucket.
    void place_bucket_storages(std::uint32_t i, bool copy_small = true) {
        const slot_meta& slot = slots_[i];
        for (std::uint32_t s : slot.storages) {
            storage_meta& storage = storages_[s];
            if (storage.gather) continue;
            storage.copied_out = copy_small && storage.nbytes < slot.bytes / 4;
            if (!storage.copied_out)
                storage_data_[s] = storage_within(bucket_data_[i], storage.slot_offset, storage.nbytes);
        }
    }

    template <storage_memory Memory>
    void allocate_remaining_storages(Memory& memory) {
        for (std::uint32_t s = 0; s < storages_.size(); ++s)
            if (!storage_data_[s].defined()) storage_data_[s] = memory.allocate(storages_[s].nbytes);
    }

    void validate(byte_reader& in, const limits& lim) {
        constexpr auto max_u64 = std::numeric_limits<std::uint64_t>::max();
        std::uint64_t total = 0;
        for (std::uint32_t s = 0; s < storages_.size(); ++s) {
            storage_meta& storage = storages_[s];
            if (storage.nbytes > lim.max_payload_bytes - std::min(total, lim.max_payload_bytes))
                in.fail_limit("storages exceed limits.max_payload_bytes = " +
                              std::to_string(lim.max_payload_bytes) + "; use the same limits on every rank");
            total += storage.nbytes;
            if (storage.slot == no_slot) {
                if (storage.wire_bytes != 0) in.fail("a storage with bytes but no slot");
                continue;
            }
            if (storage.slot >= slots_.size()) in.fail("storage slot out of range");
            slot_meta& slot = slots_[storage.slot];
            if (storage.slot_offset > slot.bytes || storage.wire_bytes > slot.bytes - storage.slot_offset)
                in.fail("storage bytes outside their transfer slot");
            if (!storage.gather && storage.wire_bytes != storage.nbytes)
                in.fail("span storage whose wire size differs from its size");
            if (slot.in_place && (storage.gather || storage.slot_offset != 0 ||
                                  storage.wire_bytes != slot.bytes || !slot.storages.empty()))
                in.fail("malformed in-place slot");
            slot.storages.push_back(s);
        }
        std::uint64_t slot_total = 0;
        for (const slot_meta& slot : slots_) {
            if (slot.bytes > max_u64 - slot_total) in.fail("slot sizes overflow");
            slot_total += slot.bytes;
            if (slot.storages.empty()) in.fail("a transfer slot that no storage uses");
        }
        if (slot_total > lim.max_payload_bytes)
            in.fail_limit("the payload exceeds limits.max_payload_bytes = " +
                          std::to_string(lim.max_payload_bytes) + "; use the same limits on every rank");

        std::vector<std::uint64_t> gathered(storages_.size(), 0);
        for (std::uint32_t t = 0; t < tensors_.size(); ++t) {
            tensor_meta& meta = tensors_[t];
            if (meta.storage >= storages_.size()) in.fail("tensor storage index out of range");
            if (meta.offset < 0) in.fail("negative storage offset");
            // Keeps `last` below max_u64 / 4 from the start, so the extent check below cannot
            // wrap (an offset near 2^63 passed it, and ATen then threw from set_).
            if (static_cast<std::uint64_t>(meta.offset) > max_u64 / 4) in.fail("storage offset out of range");
            const std::uint64_t itemsize = c10::elementSize(meta.dtype);
            // Last element touched, computed without overflow; a view must lie inside its
            // storage, so the rebuilt tensor can never read or write outside it.
            bool empty = false;
            std::uint64_t last = static_cast<std::uint64_t>(meta.offset);
            std::uint64_t distinct = 1;
            // ATen refuses (with its own exception) a view whose element count, zero sizes
            // aside, overflows int64 - an expanded view can be that large on a tiny storage.
            constexpr auto max_numel = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
            std::uint64_t numel = 1;
            for (std::size_t d = 0; d < meta.sizes.size(); ++d) {
                const auto size = meta.sizes[d], stride = meta.strides[d];
                if (size < 0 || stride < 0) in.fail("negative size or stride");
                if (size == 0) empty = true;
                const auto factor = static_cast<std::uint64_t>(size == 0 ? 1 : size);
                if (numel > max_numel / factor) in.fail("tensor element count overflows");
                numel *= factor;
                const auto extent = static_cast<std::uint64_t>(size == 0 ? 0 : size - 1);
                if (stride != 0 && extent > (max_u64 / 4 - last) / static_cast<std::uint64_t>(stride))
                    in.fail("tensor extent overflows");
                last += extent * static_cast<std::uint64_t>(stride);
                const auto kept = static_cast<std::uint64_t>(stride == 0 && size > 1 ? 1 : size);
                if (kept != 0 && distinct > max_u64 / 4 / kept) in.fail("tensor size overflows");
                distinct *= kept;
            }
            const storage_meta& storage = storages_[meta.storage];
            if (!empty) {
                if (last + 1 > storage.nbytes / itemsize)
                    in.fail("tensor reaches past the end of its storage");
                if (storage.gather) {
                    // A gathered storage's views do not overlap themselves (the root sends
                    // those as a span), so their distinct elements fit in the storage; this also
                    // keeps distinct * itemsize from wrapping. A spanned view may overlap itself
                    // (unfold, as_strided) and hold more elements than its storage.
                    if (distinct > storage.nbytes / itemsize)
                        in.fail("a gathered view with more elements than its storage");
                    gathered[meta.storage] += distinct * itemsize;
                }
            }
            storages_[meta.storage].tensors.push_back(t);
        }
        for (std::uint32_t s = 0; s < storages_.size(); ++s)
            if (storages_[s].gather && gathered[s] != storages_[s].wire_bytes)
                in.fail("gathered storage whose wire size does not match its views");
    }

    std::vector<tensor_meta> tensors_;
    std::vector<storage_meta> storages_;
    std::vector<slot_meta> slots_;
    std::vector<at::Tensor> storage_data_;  // one uint8 tensor per storage
    std::vector<at::Tensor> bucket_data_;   // per slot: its bucket (undefined for in-place slots)
};

}  // namespace spbcast::detail
