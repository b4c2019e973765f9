// A payload damaged in transit is detected (options.checksum) and reported as
// errc::payload_corrupt on the rank that received it; the group stays in step. A damaged frame
// is always detected (its header and body carry checksums) and reported as errc::corrupt_frame.
// The damage is done by a transport that wraps a real Gloo group and flips bits in what a
// follower received, after the real broadcast completed and before spbcast looks at it.
#include "support/frames.hpp"
#include "outcomes.hpp"
#include "support/identical.hpp"
#include "support/ranks.hpp"

#include <boost/hana/define_struct.hpp>

#include <latch>
#include <map>
#include <string>
#include <vector>

using namespace spbcast_fault;
using namespace std::chrono_literals;

namespace integrity {

struct Batch {
    BOOST_HANA_DEFINE_STRUCT(Batch,
        (at::Tensor, pixels),                      // 2 MB: an in-place slot
        (std::vector<at::Tensor>, small),          // one bucket each
        (std::map<std::string, double>, scalars));
};

Batch make(int64_t step) {
    Batch b;
    b.pixels = at::arange(512 * 1024, at::kFloat).add_(static_cast<double>(step)).view({512, 1024});
    // 1.25 MiB together: more than a frame carries, so the buckets are messages of their own.
    for (int i = 0; i < 5; ++i) b.small.push_back(at::full({65536 + i}, static_cast<double>(step * 10 + i)));
    b.scalars = {{"loss_scale", 1024.0}, {"step", static_cast<double>(step)}};
    return b;
}

}  // namespace integrity

namespace {

const spbcast::options base_opts{.root = 0, .timeout = 10s, .inplace_min_bytes = 1 << 20,
                                 .bucket_bytes = 300 << 10, .checksum = true};

// The messages of one broadcast of make(1), as the follower receives them: which are frame,
// which payload slots (in-place or bucket), which the checksum trailer.
struct layout {
    std::size_t frame = 0, slots = 0;
    std::vector<std::size_t> in_place, bucket;  // message indices
    std::size_t trailer = 0;
};

layout layout_of(spbcast::options opts) {
    opts.root = 0;  // the recording root is rank 0; the messages are the same from any root
    const auto messages = record(integrity::make(1), opts);
    layout l;
    l.frame = frame_message_count(messages);
    const auto parts = split_frame(messages);
    spbcast::detail::byte_reader in(parts.body.data(), parts.body.size(), "test");
    const auto slots = spbcast::detail::read_slots(in);
    l.slots = slots.size();
    for (std::size_t i = 0; i < slots.size(); ++i) {
        REQUIRE_FALSE(slots[i].in_frame);  // every slot is a message of its own here
        (slots[i].in_place ? l.in_place : l.bucket).push_back(l.frame + i);
    }
    l.trailer = l.frame + slots.size();
    REQUIRE(messages.size() == l.frame + l.slots + 1);
    return l;
}

// Rank `victim` receives message `message` (0-based within the first broadcast) with one bit
// flipped. Returns each rank's outcome of that first broadcast; when `recover`, every rank then
// broadcasts make(2) and make(3) on the same group, which must arrive intact.
std::vector<caught> damage(int victim, std::size_t message, std::size_t bit, spbcast::options opts,
                           bool recover, std::vector<integrity::Batch>* received = nullptr) {
    std::vector<caught> outcomes(3);
    if (received) received->assign(3, {});
    // No rank leaves (and closes its connections) before every rank is done: a rank that
    // raised must not turn into a dead peer for the others.
    std::latch finished(3);
    spbcast_test::run_ranks(3, [&](int rank, auto& real) {
        struct arrive {
            std::latch& l;
            ~arrive() { l.arrive_and_wait(); }
        } at_exit{finished};
        bool armed = rank == victim;
        hooked_group group(real, {}, [&](int call, std::vector<at::Tensor>& t) {
            if (armed && static_cast<std::size_t>(call) == message + 1) {
                flip_bit(t[0], bit);
                armed = false;
            }
        });
        integrity::Batch value;
        if (rank == opts.root) value = integrity::make(1);
        outcomes[rank] = catch_from([&] { spbcast::broadcast(value, group, opts); });
        if (received) (*received)[rank] = value;
        if (!recover) return;
        for (int64_t step = 2; step <= 3; ++step) {
            integrity::Batch next;
            if (rank == opts.root) next = integrity::make(step);
            spbcast::broadcast(next, group, opts);
            spbcast_test::require_identical(integrity::make(step), next);
        }
    });
    return outcomes;
}

}  // namespace

TEST_SUITE("integrity") {

TEST_CASE("options.checksum: a bit flipped in any payload slot or in the checksums is payload_corrupt on that rank only; the group stays in step") {
    const layout l = layout_of(base_opts);
    REQUIRE(!l.in_place.empty());
    REQUIRE(!l.bucket.empty());
    struct target {
        std::string name;
        std::size_t message;
    };
    const std::vector<target> targets = {{"in-place slot", l.in_place.front()},
                                         {"first bucket", l.bucket.front()},
                                         {"last bucket", l.bucket.back()},
                                         {"status trailer", l.trailer}};
    for (const auto& t : targets) {
        for (std::size_t bit : {std::size_t{0}, std::size_t{8 * 1000 + 3}}) {
            CAPTURE(t.name);
            CAPTURE(bit);
            const auto outcomes = damage(2, t.message, bit, base_opts, true);
            const std::string all = describe(outcomes);
            CHECK_MESSAGE(!outcomes[0].threw, all);
            CHECK_MESSAGE(!outcomes[1].threw, all);
            REQUIRE_MESSAGE(outcomes[2].threw, all);
            CHECK_MESSAGE(outcomes[2].code == spbcast::errc::payload_corrupt, all);
            CHECK_MESSAGE(contains(outcomes[2].what, "rank 2: broadcast #1 from root 0"), all);
            CHECK_MESSAGE(contains(outcomes[2].what, "checksum mismatch"), all);
        }
    }
}

TEST_CASE("options.checksum on a root other than 0") {
    spbcast::options opts = base_opts;
    opts.root = 1;
    const layout l = layout_of(opts);
    const auto outcomes = damage(0, l.bucket.front(), 5, opts, true);
    REQUIRE_MESSAGE(outcomes[0].threw, describe(outcomes));
    CHECK(outcomes[0].code == spbcast::errc::payload_corrupt);
    CHECK_MESSAGE(!outcomes[2].threw, describe(outcomes));
}

TEST_CASE("without options.checksum a flipped payload bit is not detected (documented: turn the checksum on)") {
    spbcast::options opts = base_opts;
    opts.checksum = false;
    const layout l = layout_of(opts);
    std::vector<integrity::Batch> received;
    const auto outcomes = damage(1, l.in_place.front(), 8 * 64 + 1, opts, true, &received);
    CHECK_MESSAGE(!outcomes[1].threw, describe(outcomes));
    CHECK_FALSE(at::equal(received[1].pixels, integrity::make(1).pixels));
    CHECK(at::equal(received[2].pixels, integrity::make(1).pixels));
}

TEST_CASE("a bit flipped in the frame on the wire is corrupt_frame on that rank, whatever the checksum option; the others fail within the timeout") {
    for (bool checksum : {false, true}) {
        spbcast::options opts = base_opts;
        opts.checksum = checksum;
        opts.timeout = 2s;
        // header (byte 20: body_bytes), body (byte 200)
        for (std::size_t bit : {std::size_t{8 * 20 + 1}, std::size_t{8 * 200 + 6}}) {
            CAPTURE(checksum);
            CAPTURE(bit);
            // The damaged follower cannot trust the frame, so it cannot take part in the
            // payload broadcasts the frame announced: the broadcast is lost for the group. Gloo
            // relays a broadcast through followers, so the root and the other followers wait
            // for that rank and raise errc::timeout (bounded by options.timeout). After that
            // the group is out of step, as after any transport error: restart.
            const auto outcomes = damage(1, 0, bit, opts, false);
            const std::string all = describe(outcomes);
            REQUIRE_MESSAGE(outcomes[1].threw, all);
            CHECK_MESSAGE(outcomes[1].code == spbcast::errc::corrupt_frame, all);
            CHECK_MESSAGE(contains(outcomes[1].what, "checksum mismatch"), all);
            for (int other : {0, 2}) {
                if (!outcomes[other].threw) continue;
                CHECK_MESSAGE(outcomes[other].type == "transport_error", all);
                CHECK_MESSAGE(outcomes[other].seconds <= 2.0 + 3.0, all);
            }
        }
    }
}

}  // TEST_SUITE
