// A frame from the wire is data: truncated, bit-flipped, oversized or deliberately crafted
// frames make a follower raise spbcast::error - never crash, never read or write out of
// bounds, never raise anything else, never allocate beyond the configured limits.
//
// Frames are recorded from a real root (support/frames.hpp: record) and replayed into a
// follower with no network (replay_group), so thousands of variants run in seconds. Every
// replay runs under a counting CPU allocator that checks what decoding allocated. Crafted
// frames that could crash the decoder run in a separate process (spbcast_fault_worker
// replay=...), so a crash is reported as a failed check instead of ending the test run.
#include "support/frames.hpp"
#include "support/fixtures.hpp"
#include "support/processes.hpp"

#include <spbcast/detail/base/version.hpp>

#include <boost/hana/define_struct.hpp>
#include <c10/core/CPUAllocator.h>
#include <doctest/doctest.h>

#include "profiles.hpp"

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <random>
#include <string>
#include <vector>

using namespace spbcast_fault;

namespace {

// ---------------------------------------------------------------------------------------------
// Counts what at::empty & co. allocate on the CPU while it is installed.

class counting_allocator final : public c10::Allocator {
public:
    explicit counting_allocator(c10::Allocator* inner) : inner_(inner) {}
#if SPBCAST_TORCH_AT_LEAST(2, 3)
    c10::DataPtr allocate(size_t n) override {
        note(n);
        return inner_->allocate(n);
    }
    void copy_data(void* dest, const void* src, std::size_t count) const override {
        default_copy_data(dest, src, count);
    }
#else
    c10::DataPtr allocate(size_t n) const override {
        const_cast<counting_allocator*>(this)->note(n);
        return inner_->allocate(n);
    }
#endif
    c10::DeleterFnPtr raw_deleter() const override { return inner_->raw_deleter(); }

    void reset() {
        total_ = 0;
        largest_ = 0;
    }
    std::uint64_t total() const { return total_; }
    std::uint64_t largest() const { return largest_; }

private:
    void note(std::size_t n) {
        total_ += n;
        std::uint64_t seen = largest_;
        while (n > seen && !largest_.compare_exchange_weak(seen, n)) {
        }
    }
    c10::Allocator* inner_;
    std::atomic<std::uint64_t> total_{0}, largest_{0};
};

counting_allocator& allocations() {
    static counting_allocator* counting = [] {
        auto* a = new counting_allocator(c10::GetCPUAllocator());
        c10::SetCPUAllocator(a, /*priority=*/200);
        return a;
    }();
    return *counting;
}

// Small limits, so "beyond the limits" is cheap to try.
spbcast::options hostile_opts() {
    spbcast::options o;
    o.limits.max_frame_bytes = 1 << 20;
    o.limits.max_tensors = 4096;
    o.limits.max_dims = 64;
    o.limits.max_payload_bytes = 8 << 20;
    o.limits.max_string_bytes = 64 << 10;
    o.limits.max_container_size = 1 << 16;
    o.limits.max_depth = 64;
    return o;
}

// What one replay may allocate through the CPU allocator: the first frame message, the rest of
// the body, the storages and the coalescing buckets (each at most the payload limit), the
// checksum trailer.
std::uint64_t allocation_bound(const spbcast::options& o) {
    return spbcast::detail::inline_frame_bytes + o.limits.max_frame_bytes +
           2 * o.limits.max_payload_bytes + 8 * 4096 + (1 << 16);
}

template <class T>
replay_result checked_replay(const message_list& messages,
                             const spbcast::options& opts = hostile_opts()) {
    auto& counter = allocations();
    counter.reset();
    replay_result r = replay<T>(messages, opts);
    CHECK_MESSAGE(counter.total() <= allocation_bound(opts),
                  "decoding allocated " << counter.total() << " bytes (largest " << counter.largest()
                                        << "), more than the limits allow: " << r.message);
    return r;
}

#define CHECK_SPBCAST_ERROR(r)                                                                  \
    CHECK_MESSAGE((r).what == outcome::spbcast_error,                                          \
                  ((r).what == outcome::ok ? std::string("accepted") : (r).message))

bool contains_text(const std::string& text, const std::string& part) {
    return text.find(part) != std::string::npos;
}

#define CHECK_NOT_OTHER(r) CHECK_MESSAGE((r).what != outcome::other_exception, (r).message)

// ---------------------------------------------------------------------------------------------
// Seeds: recordings of real broadcasts.

using Tensors = std::vector<at::Tensor>;

Tensors varied_tensors() {
    at::Tensor base = at::arange(4 * 6 * 5, at::kFloat).view({4, 6, 5});
    at::Tensor big = at::arange(1 << 19, at::kShort);  // 1 MiB: an in-place slot
    return {base,
            base.transpose(0, 2),
            base.select(1, 2),
            base.slice(2, 0, 5, 2),                       // gathered
            at::ones({3, 1}, at::kDouble).expand({3, 7}), // stride 0
            at::scalar_tensor(7, at::kLong),
            at::empty({0, 3}, at::kBFloat16),
            at::Tensor(),
            at::complex(at::ones({4}), at::zeros({4})).conj(),
            at::ones({2, 2}, at::kBool),
            big,
            big.narrow(0, 10, 100),
            at::rand({3}).requires_grad_()};
}

struct seed {
    std::string name;
    std::vector<std::vector<std::uint8_t>> messages;
    std::function<replay_result(const message_list&)> replay;
};

std::vector<seed> seeds() {
    std::vector<seed> out;
    spbcast::options opts = hostile_opts();
    opts.inplace_min_bytes = 1 << 18;
    out.push_back({"xtuner text batch", record(xtuner::make_batch(xtuner::profile::text, 1, 7), opts),
                   [](const auto& m) { return checked_replay<xtuner::Batch>(m); }});
    out.push_back({"varied tensors", record(varied_tensors(), opts),
                   [](const auto& m) { return checked_replay<Tensors>(m); }});
    opts.checksum = true;
    out.push_back({"IValue dict, checksum", record(spbcast_test::representative_dict(), opts),
                   [opts](const auto& m) { return checked_replay<c10::IValue>(m, opts); }});
    return out;
}

// Runs a recording in a separate process; returns its exit code (-1: killed by a signal) and output.
spbcast_test::process_result replay_in_process(const std::string& name, const std::string& type,
                                               const std::vector<std::vector<std::uint8_t>>& messages) {
    const auto file = std::filesystem::temp_directory_path() /
                      ("spbcast-hostile-" + std::to_string(::getpid()) + "-" + name + ".bin");
    save_messages(file.string(), messages);
    const auto worker = spbcast_test::binary_dir() / "spbcast_fault_worker";
    auto results = spbcast_test::run_processes(worker, 1, [&](int) {
        return std::vector<std::string>{"replay=" + file.string(), "type=" + type};
    }, std::chrono::seconds(60));
    std::filesystem::remove(file);
    return results.at(0);
}

}  // namespace

TEST_SUITE("hostile frames") {

TEST_CASE("the seeds themselves replay cleanly (the harness is sound)") {
    for (const auto& s : seeds()) {
        CAPTURE(s.name);
        const auto r = s.replay(s.messages);
        CHECK_MESSAGE(r.what == outcome::ok, r.message);
    }
    Tensors got;
    const auto r = replay<Tensors>(record(varied_tensors()), {}, &got);
    REQUIRE(r.what == outcome::ok);
    CHECK(got.size() == varied_tensors().size());
    CHECK(got[1].storage().is_alias_of(got[0].storage()));
}

TEST_CASE("validation admits every frame a root sends: self-overlapping, expanded and strided views") {
    // A view may overlap itself (unfold's sliding windows, as_strided): it holds more elements
    // than its storage, is sent as a span, and must be accepted and rebuilt exactly.
    at::Tensor series = at::arange(10, at::kFloat);
    const Tensors value = {series.unfold(0, 4, 1),                        // (7, 4), strides (1, 1)
                           at::arange(6, at::kLong).as_strided({3, 3}, {1, 1}),
                           at::arange(4, at::kDouble).as_strided({2, 3, 2}, {1, 0, 1}),
                           series.unfold(0, 3, 2).t()};
    Tensors got;
    const auto r = replay<Tensors>(record(value, hostile_opts()), hostile_opts(), &got);
    REQUIRE_MESSAGE(r.what == outcome::ok, r.message);
    REQUIRE(got.size() == value.size());
    for (std::size_t i = 0; i < value.size(); ++i) {
        CAPTURE(i);
        CHECK(got[i].sizes().vec() == value[i].sizes().vec());
        CHECK(got[i].strides().vec() == value[i].strides().vec());
        CHECK(at::equal(got[i], value[i]));
    }
}

TEST_CASE("truncated frame bodies (re-signed, as a hostile root would) raise spbcast::error at every length") {
    for (const auto& s : seeds()) {
        CAPTURE(s.name);
        const frame_parts whole = split_frame(s.messages);
        for (std::size_t len = 0; len < whole.body.size(); ++len) {
            frame_parts cut = whole;
            cut.body.resize(len);
            const auto r = s.replay(message_list(join_frame(cut), s.messages));
            CAPTURE(len);
            CHECK_SPBCAST_ERROR(r);
        }
    }
}

TEST_CASE("truncated and missing messages on the wire are spbcast errors") {
    for (const auto& s : seeds()) {
        CAPTURE(s.name);
        for (std::size_t drop = 1; drop <= s.messages.size(); ++drop) {
            auto messages = s.messages;
            messages.resize(messages.size() - drop);  // the root stopped early
            CHECK_SPBCAST_ERROR(s.replay(messages));
        }
        for (std::size_t i = 0; i < s.messages.size(); ++i) {
            auto messages = s.messages;
            if (messages[i].empty()) continue;
            messages[i].pop_back();  // a short message
            CHECK_SPBCAST_ERROR(s.replay(messages));
        }
    }
}

TEST_CASE("bit flips on the wire in the frame are always corrupt_frame") {
    std::mt19937_64 rng(1);
    for (const auto& s : seeds()) {
        CAPTURE(s.name);
        const frame_parts whole = split_frame(s.messages);
        // The header and the inline body; the zero padding after a short body is not data.
        const std::size_t meaningful =
            std::min(sizeof(spbcast::detail::frame_header) + whole.body.size(), s.messages[0].size());
        for (int i = 0; i < 300; ++i) {
            auto messages = s.messages;
            const std::size_t bit = rng() % (8 * meaningful);
            messages[0][bit / 8] ^= static_cast<std::uint8_t>(1u << (bit % 8));
            const auto r = s.replay(messages);
            CAPTURE(bit);
            CHECK_SPBCAST_ERROR(r);
            if (r.what == outcome::spbcast_error) CHECK(r.code == spbcast::errc::corrupt_frame);
        }
    }
}

TEST_CASE("bit flips and byte smashes in re-signed frame bodies: accepted or spbcast::error, nothing else") {
    std::mt19937_64 rng(2);
    for (const auto& s : seeds()) {
        CAPTURE(s.name);
        const frame_parts whole = split_frame(s.messages);
        // every byte set to 0x00, 0xff and 0x80 in turn
        for (std::size_t at = 0; at < whole.body.size(); ++at) {
            for (std::uint8_t v : {std::uint8_t{0}, std::uint8_t{0xff}, std::uint8_t{0x80}}) {
                frame_parts bad = whole;
                bad.body[at] = v;
                const auto r = s.replay(message_list(join_frame(bad), s.messages));
                CAPTURE(at);
                CAPTURE(int(v));
                CHECK_NOT_OTHER(r);
            }
        }
        // random flips of 1 to 4 bits
        for (int i = 0; i < 2000; ++i) {
            frame_parts bad = whole;
            const int flips = 1 + static_cast<int>(rng() % 4);
            for (int f = 0; f < flips; ++f) {
                const std::size_t bit = rng() % (8 * bad.body.size());
                bad.body[bit / 8] ^= static_cast<std::uint8_t>(1u << (bit % 8));
            }
            const auto r = s.replay(message_list(join_frame(bad), s.messages));
            CAPTURE(i);
            CHECK_NOT_OTHER(r);
        }
    }
}

TEST_CASE("re-signed header fields: unknown status, other version, lying slot count, flags") {
    for (const auto& s : seeds()) {
        CAPTURE(s.name);
        const std::size_t payload_from = frame_message_count(s.messages);
        auto with = [&](const std::function<void(spbcast::detail::frame_header&)>& change) {
            frame_parts parts = split_frame(s.messages);
            change(parts.header);
            auto messages = join_frame(parts);
            messages.insert(messages.end(), s.messages.begin() + static_cast<std::ptrdiff_t>(payload_from), s.messages.end());
            return s.replay(messages);
        };
        CHECK_SPBCAST_ERROR(with([](auto& h) { h.status = 7; }));
        CHECK_SPBCAST_ERROR(with([](auto& h) { h.slot_count += 1; }));
        CHECK_SPBCAST_ERROR(with([](auto& h) { h.fingerprint ^= 1; }));
        const auto version = with([](auto& h) { h.version = 0xffff; });
        CHECK_SPBCAST_ERROR(version);
        CHECK(version.code == spbcast::errc::version_mismatch);
        CHECK_NOT_OTHER(with([](auto& h) { h.flags ^= spbcast::detail::payload_checksums; }));
        CHECK_NOT_OTHER(with([](auto& h) { h.flags = 0xfffffffe; }));
    }
}

TEST_CASE("oversized announcements are refused before anything that large is allocated") {
    const spbcast::options opts = hostile_opts();
    const auto& lim = opts.limits;
    const auto messages = record(varied_tensors(), opts);
    const editable_frame base = editable_frame::from(messages);

    SUBCASE("a frame body larger than max_frame_bytes and than max_payload_bytes (the most a follower drains)") {
        frame_parts parts = split_frame(messages);
        parts.header.body_bytes = std::max<std::uint64_t>(lim.max_frame_bytes, lim.max_payload_bytes) + 1;
        parts.header.header_checksum = parts.header.compute_checksum();
        const auto r = checked_replay<Tensors>(join_frame(parts, false), opts);
        CHECK_SPBCAST_ERROR(r);
        CHECK(r.code == spbcast::errc::limit_exceeded);
        CHECK(allocations().largest() <= spbcast::detail::inline_frame_bytes);
    }
    SUBCASE("a body of 2^63 bytes") {
        frame_parts parts = split_frame(messages);
        parts.header.body_bytes = std::uint64_t{1} << 63;
        parts.header.header_checksum = parts.header.compute_checksum();
        CHECK_SPBCAST_ERROR(checked_replay<Tensors>(join_frame(parts, false), opts));
    }
    SUBCASE("storages larger than max_payload_bytes") {
        editable_frame f = base;
        f.storages[0].nbytes = lim.max_payload_bytes + 16;
        CHECK_SPBCAST_ERROR(checked_replay<Tensors>(f.messages(), opts));
        f.storages[0].nbytes = std::numeric_limits<std::uint64_t>::max();
        CHECK_SPBCAST_ERROR(checked_replay<Tensors>(f.messages(), opts));
    }
    SUBCASE("many storages that together exceed max_payload_bytes") {
        editable_frame f = base;
        for (auto& st : f.storages) st.nbytes = lim.max_payload_bytes / 2;
        CHECK_SPBCAST_ERROR(checked_replay<Tensors>(f.messages(), opts));
    }
    SUBCASE("a slot larger than max_payload_bytes") {
        editable_frame f = base;
        f.slots[0].bytes = lim.max_payload_bytes + 1;
        CHECK_SPBCAST_ERROR(checked_replay<Tensors>(f.frame_messages(), opts));
    }
    SUBCASE("a tensor count of 2^32 - 1, dims of 255, a storage index out of range") {
        editable_frame f = base;
        f.tensors[0].sizes.assign(255, 1);
        f.tensors[0].strides.assign(255, 1);
        CHECK_SPBCAST_ERROR(checked_replay<Tensors>(f.messages(), opts));
        f = base;
        f.tensors[0].storage = 1u << 30;
        CHECK_SPBCAST_ERROR(checked_replay<Tensors>(f.messages(), opts));
        f = base;
        f.tensors.resize(lim.max_tensors + 1, f.tensors[0]);
        CHECK_SPBCAST_ERROR(checked_replay<Tensors>(f.messages(), opts));
    }
    SUBCASE("container and string lengths of 2^40 in the value stream") {
        editable_frame f = base;
        // Tensors is a vector: its value stream starts with the u64 element count.
        const std::uint64_t huge = std::uint64_t{1} << 40;
        std::memcpy(f.values.data(), &huge, 8);
        CHECK_SPBCAST_ERROR(checked_replay<Tensors>(f.messages(), opts));

        const auto strings = record(std::vector<std::string>{"a", "bc"}, opts);
        editable_frame g = editable_frame::from(strings);
        std::memcpy(g.values.data() + 8, &huge, 8);  // first string's length
        CHECK_SPBCAST_ERROR(checked_replay<std::vector<std::string>>(g.messages(), opts));
        const std::uint64_t over = lim.max_string_bytes + 1;
        std::memcpy(g.values.data() + 8, &over, 8);
        CHECK_SPBCAST_ERROR(checked_replay<std::vector<std::string>>(g.messages(), opts));
    }
    SUBCASE("IValues nested deeper than max_depth") {
        const auto none = record(c10::IValue(), opts);
        editable_frame f = editable_frame::from(none);
        f.values.clear();
        for (int i = 0; i < 10000; ++i) {  // generic lists of one element, 10000 deep
            f.values.push_back(static_cast<std::uint8_t>(spbcast::detail::ivalue_tag::generic_list));
            f.values.push_back(0);
            const std::uint64_t one = 1;
            f.values.insert(f.values.end(), reinterpret_cast<const std::uint8_t*>(&one),
                            reinterpret_cast<const std::uint8_t*>(&one) + 8);
        }
        f.values.push_back(0);
        const auto r = checked_replay<c10::IValue>(f.messages(), opts);
        CHECK_SPBCAST_ERROR(r);
        CHECK(contains_text(r.message, "max_depth"));
    }
}

TEST_CASE("crafted frames a root never sends are refused with spbcast::error (separate process: a crash fails here, not the run)") {
    struct crafted {
        std::string name, type;
        std::vector<std::vector<std::uint8_t>> messages;
    };
    std::vector<crafted> cases;
    const auto bytes = editable_frame::from(record(Tensors{at::arange(64, at::kByte)}));

    {  // offset near 2^63: the extent check's arithmetic wraps and the view passes as in-bounds
        editable_frame f = bytes;
        f.tensors[0].offset = std::numeric_limits<std::int64_t>::max();
        f.tensors[0].sizes = {3, 2};
        f.tensors[0].strides = {std::int64_t{1} << 62, 11};
        cases.push_back({"storage offset near 2^63", "tensors", f.messages()});
    }
    {  // a gathered complex128 view of 2^60 + 404 overlapping elements: elements x 16 bytes
       // wraps to 6464 bytes, which matches the announced wire size
        editable_frame f = bytes;
        const std::vector<std::int64_t> factors = {2, 2, 3, 3, 5, 167, 167, 409, 761, 859, 859};
        std::int64_t last = 0;
        for (auto x : factors) last += x - 1;
        f.tensors[0] = {13 /* complex128 */, 0, 0, 0, factors, std::vector<std::int64_t>(factors.size(), 1)};
        const std::uint64_t nbytes = static_cast<std::uint64_t>(last + 1) * 16;
        f.storages[0] = {nbytes, 1, 0, 0, 6464};
        f.slots[0] = {0, 6464};
        cases.push_back({"gathered element count x itemsize wraps", "tensors", f.messages()});
    }
    {  // requires_grad on an integer tensor
        editable_frame f = bytes;
        f.tensors[0].flags = spbcast::detail::requires_grad_flag;
        cases.push_back({"requires_grad on uint8", "tensors", f.messages()});
    }
    {  // the conjugate bit on a real tensor
        editable_frame f = bytes;
        f.tensors[0].flags = spbcast::detail::conj_flag;
        cases.push_back({"conj bit on uint8", "tensors", f.messages()});
    }
    {  // a dict whose key is a list: not hashable
        editable_frame f = editable_frame::from(record(c10::IValue()));
        using spbcast::detail::ivalue_tag;
        f.values = {static_cast<std::uint8_t>(ivalue_tag::generic_dict), 0, 0, 1, 0, 0, 0, 0, 0, 0, 0,
                    static_cast<std::uint8_t>(ivalue_tag::int_list), 0, 0, 0, 0, 0, 0, 0, 0,
                    static_cast<std::uint8_t>(ivalue_tag::none)};
        cases.push_back({"dict with a list key", "ivalue", f.messages()});
    }
    {  // a dict whose key is a generic dict
        editable_frame f = editable_frame::from(record(c10::IValue()));
        using spbcast::detail::ivalue_tag;
        f.values = {static_cast<std::uint8_t>(ivalue_tag::generic_dict), 0, 0, 1, 0, 0, 0, 0, 0, 0, 0,
                    static_cast<std::uint8_t>(ivalue_tag::generic_dict), 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                    static_cast<std::uint8_t>(ivalue_tag::none)};
        cases.push_back({"dict with a dict key", "ivalue", f.messages()});
    }
    {  // an expanded view whose element count overflows int64 (found by the fuzzer)
        editable_frame f = bytes;
        f.tensors[0].sizes = {std::int64_t{1} << 40, std::int64_t{1} << 40};
        f.tensors[0].strides = {0, 0};
        cases.push_back({"element count overflows int64", "tensors", f.messages()});
    }
    {  // a generic list declaring bool elements that holds an int (found by the fuzzer): c10
       // asserts when such a list is read with toBoolList()
        editable_frame f = editable_frame::from(record(c10::IValue()));
        using spbcast::detail::ivalue_tag;
        f.values = {static_cast<std::uint8_t>(ivalue_tag::generic_list),
                    static_cast<std::uint8_t>(spbcast::detail::ivalue_type::boolean), 1, 0, 0, 0, 0, 0, 0, 0,
                    static_cast<std::uint8_t>(ivalue_tag::integer), 7, 0, 0, 0, 0, 0, 0, 0};
        cases.push_back({"list of bool holding an int", "ivalue", f.messages()});
    }
    {  // another wire-format version whose slot sizes wrap when summed (found by the fuzzer):
       // the follower must refuse to drain, not allocate what the wrapped sum allows
        editable_frame f = bytes;
        f.header.version = spbcast::detail::format_version + 1;
        f.slots = {{0, std::numeric_limits<std::uint64_t>::max() - 65}, {0, 100}};
        cases.push_back({"slot sizes that wrap, in a frame of another version", "tensors", f.frame_messages()});
    }
    for (const auto& c : cases) {
        CAPTURE(c.name);
        const auto r = replay_in_process(std::to_string(&c - cases.data()), c.type, c.messages);
        CHECK_MESSAGE(r.exit_code == 3,
                      c.name << ": exit " << r.exit_code << ", signal " << r.signal << ": " << r.output);
    }
}

}  // TEST_SUITE
