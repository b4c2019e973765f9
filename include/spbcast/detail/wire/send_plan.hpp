// The root's plan of a batch's tensors and how their bytes travel.
//
// Every tensor met while encoding is added once per TensorImpl (a second reference is the same
// table index, so aliases survive) and grouped by storage (views share one storage entry). Per
// storage only the bytes its views touch are sent: the span [lo, hi), or, when the views touch
// a small part of a large span (a strided slice), each view's elements gathered - whichever is
// smaller, so a storage never costs more than sending its tensors contiguously. Storages then
// go into transfer slots: large spans alone and in place (no copy on the root, received
// straight into their final storage), the rest coalesced into buckets.
#pragma once

#include "../../error.hpp"
#include "../../options.hpp"
#include "bit_views.hpp"
#include "bytes.hpp"
#include "dtype.hpp"
#include "wire_tables.hpp"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace spbcast::detail {

class send_plan {
public:
    struct storage_source {
        c10::Storage storage;  // keeps the bytes alive until the send completes
        const std::uint8_t* base = nullptr;
        std::uint64_t lo = std::numeric_limits<std::uint64_t>::max(), hi = 0;
        std::uint64_t gather_bytes = 0;
    };

    // Adds a tensor (or finds it again) and returns its table index. `where` names the field
    // for error messages; it is only called on failure.
    std::uint32_t add(const at::Tensor& tensor, const limits& lim,
                      const std::function<std::string()>& where) {
        if (!tensor.defined()) return undefined_tensor;
        auto* impl = tensor.unsafeGetTensorImpl();
        if (auto found = by_impl_.find(impl); found != by_impl_.end()) return found->second;
        check_sendable(tensor, lim, where);

        c10::StorageImpl* storage_impl = tensor.storage().unsafeGetStorageImpl();
        auto [entry, inserted] =
            by_storage_.try_emplace(storage_impl, static_cast<std::uint32_t>(storages_.size()));
        if (inserted) {
            storages_.emplace_back();
            sources_.push_back({tensor.storage(),
                                static_cast<const std::uint8_t*>(tensor.storage().data())});
        }
        const std::uint32_t storage_index = entry->second;

        tensor_meta meta;
        meta.dtype = tensor.scalar_type();
        meta.flags = static_cast<std::uint8_t>((tensor.requires_grad() ? requires_grad_flag : 0) |
                                               (tensor.is_conj() ? conj_flag : 0) |
                                               (tensor.is_neg() ? neg_flag : 0));
        meta.storage = storage_index;
        meta.offset = tensor.storage_offset();  // absolute until finish() rebases it
        meta.sizes = tensor.sizes().vec();
        meta.strides = tensor.strides().vec();

        const auto itemsize = static_cast<std::uint64_t>(tensor.element_size());
        const auto start = static_cast<std::uint64_t>(meta.offset) * itemsize;
        storage_source& source = sources_[storage_index];
        if (tensor.numel() > 0) {  // empty views touch no bytes and do not widen the span
            source.lo = std::min(source.lo, start);
            std::uint64_t last = static_cast<std::uint64_t>(meta.offset);
            for (std::size_t d = 0; d < meta.sizes.size(); ++d)
                last += static_cast<std::uint64_t>((meta.sizes[d] - 1) * meta.strides[d]);
            source.hi = std::max(source.hi, (last + 1) * itemsize);
            source.gather_bytes += static_cast<std::uint64_t>(numel_of(distinct_sizes(meta))) * itemsize;
        }
        const auto index = static_cast<std::uint32_t>(tensors_.size());
        if (tensors_.size() >= lim.max_tensors)
            throw error(errc::limit_exceeded,
                        "more than limits.max_tensors = " + std::to_string(lim.max_tensors) +
                            " distinct tensors (at " + where() +
                            "); raise spbcast::options::limits.max_tensors on every rank");
        tensors_.push_back(std::move(meta));
        tensor_objects_.push_back(tensor);
        storages_[storage_index].tensors.push_back(index);
        by_impl_.emplace(impl, index);
        return index;
    }

    // Chooses span or gather per storage, rebases offsets, and assigns transfer slots.
    void finish(const options& opts) {
        std::uint64_t total = 0;
        std::uint32_t open_bucket = no_slot;
        for (std::uint32_t s = 0; s < storages_.size(); ++s) {
            storage_meta& storage = storages_[s];
            storage_source& source = sources_[s];
            // Round lo down so that every view's rebased offset stays a whole element.
            if (source.hi == 0) source.lo = 0;  // only empty views
            source.lo = source.lo / storage_alignment * storage_alignment;
            storage.nbytes = source.hi - source.lo;
            storage.gather = source.gather_bytes < storage.nbytes && !has_internal_overlap(s);
            storage.wire_bytes = storage.gather ? source.gather_bytes : storage.nbytes;
            for (std::uint32_t t : storage.tensors) {
                const auto itemsize = c10::elementSize(tensors_[t].dtype);
                const auto start = static_cast<std::uint64_t>(tensors_[t].offset) * itemsize;
                // An empty view below the span keeps offset 0: it reads nothing either way.
                tensors_[t].offset =
                    start < source.lo ? 0 : static_cast<std::int64_t>((start - source.lo) / itemsize);
            }
            total += storage.nbytes;
            if (storage.wire_bytes == 0) continue;
            if (!storage.gather && storage.wire_bytes >= opts.inplace_min_bytes) {
                storage.slot = static_cast<std::uint32_t>(slots_.size());
                slots_.push_back({true, storage.wire_bytes, {s}});
                continue;
            }
            const std::uint64_t aligned =
                open_bucket == no_slot ? 0
                                       : (slots_[open_bucket].bytes + bucket_alignment - 1) /
                                             bucket_alignment * bucket_alignment;
            if (open_bucket == no_slot || (slots_[open_bucket].bytes != 0 &&
                                           aligned + storage.wire_bytes > opts.bucket_bytes)) {
                open_bucket = static_cast<std::uint32_t>(slots_.size());
                slots_.push_back({false, 0, {}});
                storage.slot_offset = 0;
            } else {
                storage.slot_offset = aligned;
            }
            storage.slot = open_bucket;
            slots_[open_bucket].bytes = storage.slot_offset + storage.wire_bytes;
            slots_[open_bucket].storages.push_back(s);
        }
        if (total > opts.limits.max_payload_bytes)
            throw error(errc::limit_exceeded,
                        "the batch holds " + std::to_string(total) +
                            " tensor bytes, more than limits.max_payload_bytes = " +
                            std::to_string(opts.limits.max_payload_bytes) +
                            "; raise it on every rank or send a smaller batch");
        // All of a batch's buckets ride in the frame, or none.
        const std::uint64_t frame_budget = std::min<std::uint64_t>(frame_payload_max_bytes, opts.limits.max_frame_bytes / 2);
        std::uint64_t bucket_total = 0;
        for (const slot_meta& slot : slots_)
            if (!slot.in_place) bucket_total += slot.bytes;
        if (bucket_total <= frame_budget)
            for (slot_meta& slot : slots_) slot.in_frame = !slot.in_place;
    }

    // The same-host path: buckets ride in the frame only while they fit `budget` (the frame then
    // stays one message); larger ones go into the shared segment, which costs no copy through a
    // socket per follower.
    void keep_frame_within(std::uint64_t budget) {
        std::uint64_t in_frame = 0;
        for (const slot_meta& slot : slots_)
            if (slot.in_frame) in_frame += slot.bytes;
        if (in_frame > budget)
            for (slot_meta& slot : slots_) slot.in_frame = false;
    }

    // The bytes of the slots that travel in the frame, after the tables. Packed before the
    // header is sent, so a failure here is an error frame.
    void write_frame_payload(byte_writer& out) const {
        for (std::uint32_t i = 0; i < slots_.size(); ++i)
            if (slots_[i].in_frame) {
                const at::Tensor bytes = slot_tensor(i);
                out.put_bytes(bytes.data_ptr<std::uint8_t>(), static_cast<std::size_t>(bytes.numel()));
            }
    }

    void write_tensor_tables(byte_writer& out) const {
        out.put<std::uint32_t>(static_cast<std::uint32_t>(tensors_.size()));
        for (const tensor_meta& t : tensors_) {
            out.put<std::uint8_t>(*dtype_code(t.dtype));
            out.put<std::uint8_t>(t.flags);
            out.put<std::uint8_t>(static_cast<std::uint8_t>(t.sizes.size()));
            out.put<std::uint32_t>(t.storage);
            out.put<std::int64_t>(t.offset);
            for (auto v : t.sizes) out.put<std::int64_t>(v);
            for (auto v : t.strides) out.put<std::int64_t>(v);
        }
        out.put<std::uint32_t>(static_cast<std::uint32_t>(storages_.size()));
        for (const storage_meta& s : storages_) {
            out.put<std::uint64_t>(s.nbytes);
            out.put<std::uint8_t>(s.gather ? 1 : 0);
            out.put<std::uint32_t>(s.slot);
            out.put<std::uint64_t>(s.slot_offset);
            out.put<std::uint64_t>(s.wire_bytes);
        }
    }

    void write_slot_table(byte_writer& out) const { write_slots(out, slots_); }

    // The bytes of slot `i` as a uint8 tensor: the storage itself for an in-place slot, a
    // freshly packed bucket otherwise.
    at::Tensor slot_tensor(std::uint32_t i) const {
        const slot_meta& slot = slots_[i];
        if (slot.in_place) {
            const storage_source& source = sources_[slot.storages.front()];
            // The view owns a reference to the storage, so a send that outlives this plan
            // (a failed broadcast whose buffers are quarantined) never reads freed memory.
            return at::from_blob(const_cast<std::uint8_t*>(source.base + source.lo),
                                 {static_cast<std::int64_t>(slot.bytes)},
                                 [keep = source.storage](void*) {}, at::kByte);
        }
        at::Tensor bucket = at::empty({static_cast<std::int64_t>(slot.bytes)}, at::kByte);
        pack_slot(i, bucket.data_ptr<std::uint8_t>());
        return bucket;
    }

    // Writes the bytes of slot `i` to `out` (slot.bytes of them): the storage's span for an
    // in-place slot, the packed bucket otherwise.
    void pack_slot(std::uint32_t i, std::uint8_t* out) const {
        const slot_meta& slot = slots_[i];
        if (slot.in_place) {
            const storage_source& source = sources_[slot.storages.front()];
            std::memcpy(out, source.base + source.lo, slot.bytes);
            return;
        }
        for (std::uint32_t s : slot.storages) {
            const storage_meta& storage = storages_[s];
            const storage_source& source = sources_[s];
            if (!storage.gather) {
                std::memcpy(out + storage.slot_offset, source.base + source.lo, storage.nbytes);
                continue;
            }
            for_each_gathered_view(storage, tensors_, [&](const tensor_meta& meta, auto sizes,
                                                          std::uint64_t offset) {
                const auto itemsize = static_cast<std::int64_t>(c10::elementSize(meta.dtype));
                at::Tensor src = raw_bits_view(source.storage, meta.dtype,
                                               meta.offset + static_cast<std::int64_t>(source.lo) / itemsize,
                                               std::move(sizes), meta.strides);
                at::from_blob(out + offset, src.sizes(), src.options()).copy_(src);
            });
        }
    }

    const std::vector<slot_meta>& slots() const { return slots_; }
    // What an in-place slot sends: its storage, whose bytes from base + lo are the slot's.
    const storage_source& in_place_source(std::uint32_t i) const { return sources_[slots_[i].storages.front()]; }
    const std::vector<at::Tensor>& tensors() const { return tensor_objects_; }
    std::uint64_t payload_bytes() const {
        std::uint64_t total = 0;
        for (const auto& s : slots_) total += s.bytes;
        return total;
    }

private:
    static void check_sendable(const at::Tensor& t, const limits& lim,
                               const std::function<std::string()>& where) {
        auto reject = [&](const std::string& why, const std::string& fix,
                          errc code = errc::unsupported_value) {
            throw error(code, "cannot send the tensor at " + where() + ": " + why + "; " + fix);
        };
        if (!t.device().is_cpu())
            reject("it is on device " + t.device().str(),
                   "spbcast sends CPU tensors - move it with .cpu() in the loader or collator");
        if (t.is_sparse() || t.layout() != at::kStrided)
            reject("its layout is not strided (sparse or another layout)",
                   "convert it with .to_dense() before broadcasting");
        if (t.is_quantized())
            reject("it is quantized", "send .int_repr() and the quantization parameters instead");
        if (t.is_mkldnn()) reject("it is an MKLDNN tensor", "convert it with .to_dense()");
        if (t.is_nested())
            reject("it is a nested tensor", "send its components (unbind) as a list of tensors");
        if (!t.has_storage())
            reject("it has no storage (a wrapper or functional tensor)",
                   "materialize it as a plain CPU tensor first");
        if (!dtype_code(t.scalar_type()))
            reject(std::string("its dtype ") + c10::toString(t.scalar_type()) +
                       " has no spbcast wire code",
                   "convert it to a supported dtype (docs/broadcast.md: 'Supported types')");
        if (static_cast<std::size_t>(t.dim()) > lim.max_dims)
            reject("it has " + std::to_string(t.dim()) + " dimensions, more than limits.max_dims = " +
                       std::to_string(lim.max_dims),
                   "raise limits.max_dims on every rank", errc::limit_exceeded);
    }

    // Gathering writes each view's elements back on the follower; a view that overlaps
    // itself (other than through stride 0, which distinct_sizes removes) would be written
    // twice, so such storages are sent as a span.
    bool has_internal_overlap(std::uint32_t s) const {
        for (std::uint32_t t : storages_[s].tensors) {
            const tensor_meta& meta = tensors_[t];
            const auto sizes = distinct_sizes(meta);
            std::vector<std::pair<std::int64_t, std::int64_t>> dims;  // (stride, size)
            for (std::size_t d = 0; d < sizes.size(); ++d)
                if (sizes[d] > 1) dims.emplace_back(meta.strides[d], sizes[d]);
            std::sort(dims.begin(), dims.end());
            std::int64_t reach = 1;  // elements spanned by the smaller-stride dimensions
            for (auto [stride, size] : dims) {
                if (stride < reach) return true;
                reach = stride * (size - 1) + reach;
            }
        }
        return false;
    }

    std::vector<tensor_meta> tensors_;
    std::vector<at::Tensor> tensor_objects_;
    std::vector<storage_meta> storages_;
    std::vector<storage_source> sources_;
    std::vector<slot_meta> slots_;
    std::unordered_map<const c10::TensorImpl*, std::uint32_t> by_impl_;
    std::unordered_map<const c10::StorageImpl*, std::uint32_t> by_storage_;
};

}  // namespace spbcast::detail
