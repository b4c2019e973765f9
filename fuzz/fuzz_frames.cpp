// libFuzzer target: a follower's decoding of a frame and its payload - parse_frame (header
// status and version, slot table, schema, tensor and storage tables, limits), the payload
// filled into the slots and unpacked into storages, and decode_value rebuilding the batch -
// for the realistic xtuner::Batch and for dynamic c10::IValue batches. Input format:
// fuzz_common.hpp. Anything but a spbcast::error escaping, a crash, an ASan/UBSan report, or an
// allocation beyond -malloc_limit_mb is a finding. Run it with scripts/fuzz.sh.
#include "fuzz_common.hpp"
#include "xtuner_batch.hpp"

#include <spbcast/broadcast.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// Checks that the first and the last element of every rebuilt tensor lie in its storage and
// reads them through the storage pointer: with strides validated non-negative, every element
// lies between the two. The explicit check matters because a storage received in a bucket is
// a part of that bucket, where ASan would not see a read past its end. (Not .contiguous(): an expanded or self-overlapping
// view may legitimately be far larger than its storage.)
template <class T>
void touch_tensors(const T& value) {
    using namespace spbcast::detail;
    const spbcast::limits unbounded{~std::size_t{0}, ~std::size_t{0}, ~std::size_t{0}, ~std::uint64_t{0},
                                    ~std::size_t{0}, ~std::size_t{0}, 4096};
    send_plan plan;
    byte_writer out;
    encoder enc(out, plan, unbounded);
    enc.value(value);
    volatile std::uint8_t sink = 0;
    for (const at::Tensor& t : plan.tensors()) {
        if (t.numel() == 0) continue;
        const auto* base = static_cast<const std::uint8_t*>(t.storage().data());
        const auto itemsize = static_cast<std::int64_t>(t.element_size());
        std::int64_t last = t.storage_offset();
        for (std::int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
        if (t.storage_offset() < 0 || (last + 1) * itemsize > static_cast<std::int64_t>(t.storage().nbytes()))
            __builtin_trap();  // a view past its storage got through validation
        for (std::int64_t k = 0; k < itemsize; ++k)
            sink = sink ^ base[t.storage_offset() * itemsize + k] ^ base[last * itemsize + k];
    }
    (void)sink;
}

// The status trailer that ends the broadcast: the next announced bytes of the payload stream,
// zero-filled where the input ends.
std::vector<std::uint8_t> trailer_from(const spbcast::detail::frame_header& header,
                                       const std::uint8_t* payload, std::size_t payload_size) {
    std::vector<std::uint8_t> trailer(spbcast::detail::announced_trailer_bytes(header), 0);
    const std::size_t have = std::min(trailer.size(), payload_size);
    if (have) std::memcpy(trailer.data(), payload, have);
    return trailer;
}

template <class T>
void decode(const spbcast::detail::frame_header& header, const std::vector<std::uint8_t>& body,
            const std::uint8_t* payload, std::size_t payload_size) {
    using namespace spbcast::detail;
    static const spbcast::limits lim = spbcast_fuzz::fuzz_limits();
    if (header.body_bytes > lim.max_frame_bytes) return;  // receive_frame refuses it first
    try {
        parsed_frame frame = parse_frame<T>(header, body, lim, "fuzz", 0);
        const auto& slots = frame.plan.slots();
        if (frame.mismatch) {
            // drain_payload: one scratch buffer as large as the largest slot, if within
            // limits.max_payload_bytes, then the trailer, whose root status is read before this
            // rank's refusal
            const auto largest = drain_scratch_bytes(slots);
            if (largest <= lim.max_payload_bytes) (void)at::empty({static_cast<std::int64_t>(largest)}, at::kByte);
            read_trailer(header, trailer_from(header, payload, payload_size), "fuzz", 0);
            return;
        }
        frame.plan.allocate(spbcast::detail::receive_cache::instance());
        std::size_t used = 0;
        for (std::uint32_t i = 0; i < slots.size(); ++i) {
            at::Tensor buffer = frame.plan.slot_receive_tensor(i);
            auto* out = static_cast<std::uint8_t*>(buffer.data_ptr());
            const auto n = static_cast<std::size_t>(buffer.numel());
            if (slots[i].in_frame) {  // validated to lie inside the body
                if (n) std::memcpy(out, body.data() + slots[i].frame_offset, n);
            } else {
                const std::size_t have = std::min(n, payload_size - used);
                if (have) std::memcpy(out, payload + used, have);
                if (n > have) std::memset(out + have, 0, n - have);
                used += have;
            }
            frame.plan.unpack_slot(i);
        }
        read_trailer(header, trailer_from(header, payload + used, payload_size - used), "fuzz", 0);
        T value = decode_value<T>(frame, body, lim, "fuzz");
        touch_tensors(value);
    } catch (const spbcast::error&) {
        // the expected outcome for a bad frame
    }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
    // Received memory freed at once, not cached: ASan then sees a use after free, and memory
    // stays within -rss_limit_mb over millions of inputs.
    spbcast::set_receive_cache_limit(0);
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    using spbcast::detail::frame_header;
    if (size < 1 + sizeof(frame_header)) return 0;
    frame_header header;
    std::memcpy(&header, data + 1, sizeof header);
    const std::uint8_t* rest = data + 1 + sizeof header;
    const std::size_t rest_size = size - 1 - sizeof header;
    const std::size_t body_size =
        static_cast<std::size_t>(std::min<std::uint64_t>(header.body_bytes, rest_size));
    const std::vector<std::uint8_t> body(rest, rest + body_size);
    if (data[0] % 2 == 0)
        decode<xtuner::Batch>(header, body, rest + body_size, rest_size - body_size);
    else
        decode<c10::IValue>(header, body, rest + body_size, rest_size - body_size);
    return 0;
}
