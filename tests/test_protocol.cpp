// One broadcast is a fixed sequence of collectives: whatever a rank finds after the header, it
// issues exactly the announced messages and only then raises, so the next broadcast works; a
// rank that cannot stay in step issues no collective on the group again. Real Gloo groups,
// ranks as threads; allocation failures are real ones, from a CPU allocator that refuses.
#include "support/counting_group.hpp"
#include "support/roundtrip.hpp"

#include <spbcast/broadcast.hpp>
#include <spbcast/digest.hpp>

#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <chrono>
#include <new>

using namespace spbcast_test;

namespace {

// Wraps LibTorch's CPU allocator and refuses, on the thread that armed it, the next
// allocations of exactly `size` bytes - an out-of-memory at the point a test chooses, through
// the same allocator ATen and spbcast use.
class refusing_allocator final : public c10::Allocator {
public:
    static refusing_allocator& install() {
        static refusing_allocator* self = [] {
            auto* a = new refusing_allocator(c10::GetCPUAllocator());
            c10::SetCPUAllocator(a, /*priority=*/100);
            return a;
        }();
        return *self;
    }
    static void arm(std::size_t size, int times) {
        refuse_size = size;
        refusals_left = times;
    }
    static void disarm() { refusals_left = 0; }

#if TORCH_VERSION_MAJOR >= 2
    c10::DataPtr allocate(size_t n) override { return check(n); }
    void copy_data(void* dest, const void* src, std::size_t count) const override {
        std::memcpy(dest, src, count);
    }
#else
    c10::DataPtr allocate(size_t n) const override { return check(n); }
#endif
    c10::DeleterFnPtr raw_deleter() const override { return real_->raw_deleter(); }

private:
    explicit refusing_allocator(c10::Allocator* real) : real_(real) {}
    c10::DataPtr check(size_t n) const {
        if (refusals_left > 0 && n == refuse_size) {
            --refusals_left;
            throw std::bad_alloc();
        }
        return real_->allocate(n);
    }
    c10::Allocator* real_;
    static inline thread_local std::size_t refuse_size = 0;
    static inline thread_local int refusals_left = 0;
};

// A transport whose broadcast() fails from its `fail_at`-th message on, as a backend does whose
// peer connection broke.
template <class Group>
struct breaking_group {
    Group& inner;
    int fail_at;
    int calls = 0;
    ~breaking_group() { spbcast::forget_group(*this); }
    int getRank() const { return inner.getRank(); }
    int getSize() const { return inner.getSize(); }
    auto broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) {
        if (++calls >= fail_at) throw std::runtime_error("Connection reset by peer");
        return inner.broadcast(tensors, opts);
    }
};
template <class Group>
breaking_group(Group&, int) -> breaking_group<Group>;

struct Pair {
    at::Tensor a, b;
};

Pair make_pair_batch() {
    return {at::arange(1000, at::kFloat), at::arange(3000, at::kLong).reshape({30, 100})};
}

std::string what_of(const std::exception_ptr& e) { return e ? message_of(e) : std::string("no exception"); }

spbcast::errc code_of(const std::exception_ptr& e) {
    try {
        std::rethrow_exception(e);
    } catch (const spbcast::error& error) {
        return error.code();
    }
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

// What a follower allocates and a root packs happens on the network path only (the same-host
// path maps the root's segment and packs before the frame), so these tests take it.
static const spbcast::options network_path{.transport = spbcast::transport_mode::network};

TEST_CASE("a follower whose own limits refuse the batch drains it, raises, and the next broadcast works") {
    struct Case {
        const char* name;
        spbcast::limits limits;
        std::vector<std::string> text;  // makes the frame body large
        const char* expect;
    };
    std::vector<Case> cases{
        {"max_tensors", [] { spbcast::limits l; l.max_tensors = 1; return l; }(), {}, "max_tensors"},
        {"max_frame_bytes", [] { spbcast::limits l; l.max_frame_bytes = 4096; return l; }(),
         std::vector<std::string>(64, std::string(512, 'x')), "max_frame_bytes"},
        {"max_payload_bytes", [] { spbcast::limits l; l.max_payload_bytes = 1024; return l; }(), {}, "max_payload_bytes"},
    };
    for (const auto& c : cases) {
        CAPTURE(c.name);
        const auto errors = run_ranks_collect(3, [&](int rank, auto& group) {
            std::pair<Pair, std::vector<std::string>> batch;
            if (rank == 0) batch = {make_pair_batch(), c.text};
            spbcast::options opts;
            if (rank == 2) opts.limits = c.limits;
            try {
                spbcast::broadcast(batch, group, opts);
            } catch (const spbcast::error&) {
                if (rank != 2) throw;
                // The group is in step: the same ranks, default limits, a batch arrives whole.
                std::pair<Pair, std::vector<std::string>> again;
                if (rank == 0) again = {make_pair_batch(), c.text};
                spbcast::broadcast(again, group);
                require_identical(make_pair_batch().b, again.first.b);
                throw;
            }
            if (rank == 2) FAIL("rank 2 accepted a batch beyond its limits");
            std::pair<Pair, std::vector<std::string>> again;
            if (rank == 0) again = {make_pair_batch(), c.text};
            spbcast::broadcast(again, group);
            require_identical(make_pair_batch().b, again.first.b);
        }, 10s);
        CHECK_MESSAGE(!errors[0], what_of(errors[0]));
        CHECK_MESSAGE(!errors[1], what_of(errors[1]));
        REQUIRE(errors[2]);
        CHECK(code_of(errors[2]) == spbcast::errc::limit_exceeded);
        CHECK_MESSAGE(contains(message_of(errors[2]), c.expect), message_of(errors[2]));
        CHECK(contains(message_of(errors[2]), "rank 2"));
    }
}

TEST_CASE("a follower that cannot allocate the batch drains it, raises, and the next broadcast works") {
    refusing_allocator::install();
    static constexpr std::int64_t bytes = std::int64_t{3} << 20;  // sent in place, into the cache
    const auto errors = run_ranks_collect(3, [&](int rank, auto& group) {
        auto make = [] { return at::full({bytes}, 7, at::kByte); };
        at::Tensor t = rank == 0 ? make() : at::Tensor();
        if (rank == 1) refusing_allocator::arm(bytes, 1);
        std::exception_ptr first;
        try {
            spbcast::broadcast(t, group, network_path);
        } catch (const spbcast::error&) {
            first = std::current_exception();
        }
        refusing_allocator::disarm();
        at::Tensor again = rank == 0 ? make() : at::Tensor();
        spbcast::broadcast(again, group, network_path);
        require_identical(make(), again);
        if (first) std::rethrow_exception(first);
    }, 10s);
    CHECK_MESSAGE(!errors[0], what_of(errors[0]));
    CHECK_MESSAGE(!errors[2], what_of(errors[2]));
    REQUIRE(errors[1]);
    CHECK(code_of(errors[1]) == spbcast::errc::limit_exceeded);
    CHECK_MESSAGE(contains(message_of(errors[1]), "out of memory"), message_of(errors[1]));
}

TEST_CASE("a root that fails mid-payload completes the announced collectives; followers raise its message at once") {
    refusing_allocator::install();
    // Two tensors below options.inplace_min_bytes share one bucket, which the root packs after
    // sending the header.
    auto make = [] { return std::vector<at::Tensor>{at::arange(175000, at::kInt), at::arange(175000, at::kFloat)}; };
    std::vector<std::size_t> bucket_sizes;
    {
        // The bucket's size, as the root will allocate it: the one payload slot of this batch.
        struct recording {
            std::vector<std::size_t>* sizes;
            ~recording() { spbcast::forget_group(*this); }
            int getRank() const { return 0; }
            int getSize() const { return 2; }
            void broadcast(std::vector<at::Tensor>& t, const c10d::BroadcastOptions&) {
                sizes->push_back(static_cast<std::size_t>(t.at(0).numel()));
            }
        } recorder{&bucket_sizes};
        auto batch = make();
        spbcast::broadcast(batch, recorder);
    }
    REQUIRE(bucket_sizes.size() == 3);  // frame, the bucket, the status trailer
    const std::size_t bucket = bucket_sizes[1];
    std::vector<double> seconds(3, 0.0);
    const auto errors = run_ranks_collect(3, [&](int rank, auto& group) {
        std::vector<at::Tensor> batch = rank == 0 ? make() : std::vector<at::Tensor>{};
        if (rank == 0) refusing_allocator::arm(bucket, 1);
        const auto start = std::chrono::steady_clock::now();
        std::exception_ptr first;
        try {
            spbcast::broadcast(batch, group, {.timeout = 20s, .transport = spbcast::transport_mode::network});
        } catch (const spbcast::error&) {
            first = std::current_exception();
        }
        seconds[rank] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        refusing_allocator::disarm();
        std::vector<at::Tensor> again = rank == 0 ? make() : std::vector<at::Tensor>{};
        spbcast::broadcast(again, group, network_path);
        require_identical(make(), again);
        if (first) std::rethrow_exception(first);
    }, 30s);
    for (int rank = 0; rank < 3; ++rank) {
        CAPTURE(rank);
        REQUIRE(errors[rank]);
        const std::string message = message_of(errors[rank]);
        CHECK_MESSAGE(contains(message, "packing payload slot 1/1 failed"), message);
        CHECK(seconds[rank] < 5.0);  // at once, not at options.timeout
    }
    CHECK(code_of(errors[1]) == spbcast::errc::remote);
    CHECK(contains(message_of(errors[1]), "the root (rank 0) failed while sending the batch"));
}

TEST_CASE("a rank that could not finish the announced sequence issues no collective on that group again") {
    std::vector<int> calls_after(3, -1);
    std::vector<std::string> second(3);
    const auto errors = run_ranks_collect(3, [&](int rank, auto& group) {
        // Rank 2's transport fails on its second message, after the frame.
        breaking_group broken{group, rank == 2 ? 2 : 1 << 30};
        Pair batch = rank == 0 ? make_pair_batch() : Pair{};
        try {
            spbcast::broadcast(batch, broken, {.timeout = 3s});
        } catch (const spbcast::transport_error&) {
            if (rank != 2) throw;
            const int calls = broken.calls;
            try {
                spbcast::broadcast(batch, broken, {.timeout = 3s});
            } catch (const spbcast::transport_error& e) {
                second[rank] = e.what();
            }
            calls_after[rank] = broken.calls - calls;
            throw;
        }
    }, 5s);
    // The root and rank 1 may fail too (Gloo relays a broadcast through followers); rank 2
    // must fail once, then stay off the group.
    REQUIRE(errors[2]);
    CHECK(code_of(errors[2]) == spbcast::errc::transport);
    CHECK(contains(message_of(errors[2]), "Connection reset by peer"));
    CHECK(calls_after[2] == 0);
    CHECK_MESSAGE(contains(second[2], "out of step since an earlier broadcast failed"), second[2]);
    CHECK_MESSAGE(contains(second[2], "Connection reset by peer"), second[2]);  // the original cause
}

TEST_CASE("the header's broadcast number is checked: a root counting on another group object is refused, then in step") {
    std::vector<std::string> outcome(3);
    run_ranks(3, [&](int rank, auto& group) {
        // The root sends its first broadcast through a wrapper (its own count), the second
        // directly: its group object's count is behind the followers'.
        Pair first = rank == 0 ? make_pair_batch() : Pair{};
        if (rank == 0) {
            counting_group wrapper{group};
            spbcast::broadcast(first, wrapper);
        } else {
            spbcast::broadcast(first, group);
        }
        Pair second = rank == 0 ? make_pair_batch() : Pair{};
        try {
            spbcast::broadcast(second, group);
            outcome[rank] = "ok";
        } catch (const spbcast::error& e) {
            outcome[rank] = std::string(spbcast::to_string(e.code())) + ": " + e.what();
        }
        Pair third = rank == 0 ? make_pair_batch() : Pair{};
        spbcast::broadcast(third, group);  // in step again: the follower took the root's count
        require_identical(make_pair_batch().a, third.a);
    }, 10s);
    CHECK(outcome[0] == "ok");
    for (int rank = 1; rank < 3; ++rank) {
        CAPTURE(outcome[rank]);
        CHECK(contains(outcome[rank], "out of step"));
        CHECK(contains(outcome[rank], "the root sent its broadcast #1 on this group while this is this rank's #2"));
    }
}

TEST_CASE("options that must agree are checked, not assumed: checksum on the root only") {
    const auto errors = run_ranks_collect(2, [&](int rank, auto& group) {
        Pair batch = rank == 0 ? make_pair_batch() : Pair{};
        std::exception_ptr first;
        try {
            spbcast::broadcast(batch, group, {.checksum = rank == 0});
        } catch (const spbcast::error&) {
            first = std::current_exception();
        }
        Pair again = rank == 0 ? make_pair_batch() : Pair{};
        spbcast::broadcast(again, group);
        require_identical(make_pair_batch().b, again.b);
        if (first) std::rethrow_exception(first);
    }, 10s);
    CHECK_MESSAGE(!errors[0], what_of(errors[0]));
    REQUIRE(errors[1]);
    CHECK(code_of(errors[1]) == spbcast::errc::out_of_step);
    CHECK_MESSAGE(contains(message_of(errors[1]), "options.checksum is true on the root and false on this rank"),
                  message_of(errors[1]));
}
