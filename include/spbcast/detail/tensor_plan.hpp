// The tensors of one batch and how their bytes travel.
//
// Root: every tensor met while encoding is added once per TensorImpl (a second reference is the
// same table index, so aliases survive) and grouped by storage (views share one storage
// entry). Per storage only the bytes its views touch are sent: the span [lo, hi), or, when the
// views touch a small part of a large span (a strided slice), each view's elements gathered -
// whichever is smaller, so a storage never costs more than sending its tensors contiguously.
// Storages then go into transfer slots: large spans alone and in place (no copy on the root,
// received straight into their final storage), the rest coalesced into buckets.
//
// Follower: the same tables, read back and validated against the limits before any
// allocation; storages are allocated (large ones from the receive cache, small ones inside
// their bucket), filled from the slots, and the tensors rebuilt as views
// with the root's dtypes, sizes, strides, relative offsets and flags.
#pragma once

#include "../error.hpp"
#include "../options.hpp"
#include "bytes.hpp"
#include "dtype.hpp"
#include "receive_memory.hpp"
#include "version.hpp"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <unordered_map>
#include <vector>

namespace spbcast::detail {

inline constexpr std::uint32_t no_slot = std::numeric_limits<std::uint32_t>::max();
inline constexpr std::uint32_t undefined_tensor = std::numeric_limits<std::uint32_t>::max();
inline constexpr std::uint64_t storage_alignment = 16;  // the widest element (complex128)
inline constexpr std::uint64_t bucket_alignment = 64;

enum tensor_flags : std::uint8_t { requires_grad_flag = 1, conj_flag = 2, neg_flag = 4 };

struct tensor_meta {
    c10::ScalarType dtype;
    std::uint8_t flags = 0;
    std::uint32_t storage = 0;
    std::int64_t offset = 0;  // in elements, relative to the storage's lo
    std::vector<std::int64_t> sizes, strides;
};

struct storage_meta {
    std::uint64_t nbytes = 0;      // hi - lo: what the follower allocates
    bool gather = false;           // wire carries each view's elements instead of the span
    std::uint32_t slot = no_slot;
    std::uint64_t slot_offset = 0;
    std::uint64_t wire_bytes = 0;
    std::vector<std::uint32_t> tensors;  // referencing tensors, in table order (not sent)
    bool copied_out = false;  // follower: copied out of its bucket on arrival (not sent)
};

// Where a transfer slot travels. A batch's small buckets ride in the frame body itself (up to
// frame_payload_max_bytes together): a small batch then costs one or two collectives, with
// nothing after the header that could fail.
enum class slot_mode : std::uint8_t { bucket = 0, in_place = 1, in_frame = 2 };
inline constexpr std::uint64_t frame_payload_max_bytes = std::uint64_t{1} << 20;

struct slot_meta {
    bool in_place = false;
    std::uint64_t bytes = 0;
    std::vector<std::uint32_t> storages;  // in storage order (not sent)
    bool in_frame = false;                // its bytes follow the tables in the frame body
    std::size_t frame_offset = 0;         // follower: where in the body (not sent)

    slot_mode mode() const { return in_place ? slot_mode::in_place : in_frame ? slot_mode::in_frame : slot_mode::bucket; }
};

// Slots that travel as collectives of their own, in slot order.
inline std::uint32_t transferred_slot_count(const std::vector<slot_meta>& slots) {
    return static_cast<std::uint32_t>(std::count_if(slots.begin(), slots.end(), [](const slot_meta& s) { return !s.in_frame; }));
}

// Sizes with every stride-0 dimension narrowed to one element: what a view of an expanded
// tensor really holds. Used for gathering, so an expand costs its source, not its expansion.
inline std::vector<std::int64_t> distinct_sizes(const tensor_meta& t) {
    std::vector<std::int64_t> sizes = t.sizes;
    for (std::size_t d = 0; d < sizes.size(); ++d)
        if (t.strides[d] == 0 && sizes[d] > 1) sizes[d] = 1;
    return sizes;
}

inline std::int64_t numel_of(const std::vector<std::int64_t>& sizes) {
    std::int64_t n = 1;
    for (auto s : sizes) n *= s;
    return n;
}

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

inline void write_slots(byte_writer& out, const std::vector<slot_meta>& slots) {
    out.put<std::uint32_t>(static_cast<std::uint32_t>(slots.size()));
    for (const slot_meta& s : slots) {
        out.put<std::uint8_t>(static_cast<std::uint8_t>(s.mode()));
        out.put<std::uint64_t>(s.bytes);
    }
}

inline std::vector<slot_meta> read_slots(byte_reader& in) {
    const auto count = in.get<std::uint32_t>();
    if (count > in.remaining() / 9) in.fail("slot count " + std::to_string(count) + " exceeds the frame");
    std::vector<slot_meta> slots(count);
    for (slot_meta& s : slots) {
        const auto mode = in.get<std::uint8_t>();
        if (mode > static_cast<std::uint8_t>(slot_mode::in_frame)) in.fail("unknown slot mode " + std::to_string(mode));
        s.in_place = mode == static_cast<std::uint8_t>(slot_mode::in_place);
        s.in_frame = mode == static_cast<std::uint8_t>(slot_mode::in_frame);
        s.bytes = in.get<std::uint64_t>();
    }
    return slots;
}

// Visits the views of a gathered storage in wire order: f(view, its distinct sizes, its offset
// in the slot). Views without elements take no bytes and are skipped.
template <class F>
void for_each_gathered_view(const storage_meta& storage, const std::vector<tensor_meta>& tensors, F&& f) {
    std::uint64_t offset = storage.slot_offset;
    for (std::uint32_t t : storage.tensors) {
        const tensor_meta& meta = tensors[t];
        auto sizes = distinct_sizes(meta);
        const auto bytes = static_cast<std::uint64_t>(numel_of(sizes)) * c10::elementSize(meta.dtype);
        if (bytes == 0) continue;
        f(meta, std::move(sizes), offset);
        offset += bytes;
    }
}

// ---------------------------------------------------------------------------------------------
// Root side

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
                   "convert it to a supported dtype (README: 'Supported types')");
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

// ---------------------------------------------------------------------------------------------
// Follower side

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
    void allocate() {
        auto& memory = receive_memory::instance();
        // Only batches that use the cache advance its clock: a small broadcast between two big
        // ones (a loader's envelope, metrics) must not evict the blocks the next big one reuses.
        const bool uses_cache = std::any_of(slots_.begin(), slots_.end(), [](const slot_meta& slot) {
            return slot.bytes >= receive_memory::min_cached_bytes;
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
        allocate_remaining_storages();
    }

    // The same-host path: transferred slot `i` already lies in `slot_data[i]` (a mapping of the
    // root's segment). In-place storages and large spans in a bucket are those bytes, with no
    // copy; small spans are copied out (as allocate() does, so a small tensor kept alive pins
    // no segment), gathered storages get memory of their own. Slots in the frame get buckets
    // of their own, filled from the body like on the network path.
    void adopt_slots(std::vector<at::Tensor> slot_data) {
        auto& memory = receive_memory::instance();
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
            place_bucket_storages(i);
        }
        allocate_remaining_storages();
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
    // The span storages of bucket `i`: a part of the bucket when they fill at least a quarter
    // of it, else copied out on arrival (a small tensor kept alive must not pin its bucket).
    void place_bucket_storages(std::uint32_t i) {
        const slot_meta& slot = slots_[i];
        for (std::uint32_t s : slot.storages) {
            storage_meta& storage = storages_[s];
            if (storage.gather) continue;
            storage.copied_out = storage.nbytes < slot.bytes / 4;
            if (!storage.copied_out)
                storage_data_[s] = storage_within(bucket_data_[i], storage.slot_offset, storage.nbytes);
        }
    }

    void allocate_remaining_storages() {
        auto& memory = receive_memory::instance();
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
