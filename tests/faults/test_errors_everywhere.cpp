// A failure on one rank is an error on every rank, and the group stays usable.
//
// Root-side failures before the first collective (an unsupported tensor, an exception in the
// user's code, a limit exceeded): the root raises its own spbcast::error, every follower raises
// spbcast::remote_error with the root's message, field path and rank, and the next broadcast on
// the same group works. Follower-side mismatches (batch type, wire-format version): the
// follower drains the announced payload and raises; the root completes; the next step works.
// Ranks are threads with real Gloo groups on one store; every root is tried.
#include "support/frames.hpp"
#include "outcomes.hpp"
#include "support/identical.hpp"
#include "support/ranks.hpp"

#include <boost/hana/define_struct.hpp>

#include <ATen/ops/_nested_tensor_from_tensor_list.h>

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

using namespace spbcast_fault;
using namespace std::chrono_literals;

namespace faults {

// A user type whose codec can throw, as a collator's conversion might.
struct Fragile {
    bool explode = false;
    at::Tensor data;
};

struct Media {
    BOOST_HANA_DEFINE_STRUCT(Media,
        (at::Tensor, pixels),
        (std::optional<at::Tensor>, extra));
};

struct Step {
    BOOST_HANA_DEFINE_STRUCT(Step,
        (int64_t, id),
        (std::vector<Media>, items),
        (std::map<std::string, at::Tensor>, named),
        (std::string, note),
        (std::vector<int64_t>, lengths),
        (Fragile, fragile),
        (c10::IValue, dynamic));
};

// The same batch type, one field renamed: a follower built from other sources.
struct StepRenamed {
    BOOST_HANA_DEFINE_STRUCT(StepRenamed,
        (int64_t, id),
        (std::vector<Media>, items),
        (std::map<std::string, at::Tensor>, named_tensors),
        (std::string, note),
        (std::vector<int64_t>, lengths),
        (Fragile, fragile),
        (c10::IValue, dynamic));
};

}  // namespace faults

template <>
struct spbcast::codec<faults::Fragile> {
    static std::tuple<bool, at::Tensor> to_wire(const faults::Fragile& f) {
        if (f.explode) throw std::runtime_error("the image decoder exploded on sample 17");
        return {f.explode, f.data};
    }
    static faults::Fragile from_wire(std::tuple<bool, at::Tensor>&& w) {
        return {std::get<0>(w), std::move(std::get<1>(w))};
    }
};

namespace {

using faults::Step;

Step good_step(int64_t id) {
    Step s;
    s.id = id;
    at::Tensor big = at::arange(300000, at::kInt).view({600, 500});  // 1.2 MB: an in-place slot
    s.items = {{big.narrow(0, 0, 10), std::nullopt}, {big, at::ones({2, 2}, at::kDouble)}};
    s.named = {{"ids", at::arange(7 + id)}, {"mask", at::ones({3}, at::kBool)}};
    s.note = "step " + std::to_string(id);
    s.lengths = {1, 2, 3};
    s.fragile = {false, at::full({2}, 0.5)};
    s.dynamic = c10::IValue(std::vector<int64_t>{id, id + 1});
    return s;
}

// Every rank tries `broadcast(bad)` (followers start from an empty Step), records what it
// raised, then broadcasts good_step on the same group and checks the result: the group must
// still be usable. `bad` runs on the root only.
std::vector<caught> fail_then_recover(int world, int root, const std::function<Step()>& bad,
                                      spbcast::options opts = {}) {
    opts.root = root;
    opts.timeout = 10s;
    std::vector<caught> outcomes(world);
    spbcast_test::run_ranks(world, [&](int rank, auto& group) {
        Step value;
        if (rank == root) value = bad();
        outcomes[rank] = catch_from([&] { spbcast::broadcast(value, group, opts); });
        Step next;
        if (rank == root) next = good_step(42);
        spbcast::broadcast(next, group, {.root = root, .timeout = 10s});
        spbcast_test::require_identical(good_step(42), next);
    });
    return outcomes;
}

struct bad_tensor_case {
    std::string name;
    std::function<at::Tensor()> make;  // empty optional result: not constructible here
    std::string reason;                // part of the root's message
};

std::vector<bad_tensor_case> bad_tensors() {
    std::vector<bad_tensor_case> cases;
    cases.push_back({"meta", [] { return at::empty({2, 3}, at::TensorOptions().device(at::kMeta)); },
                     "on device meta"});
    cases.push_back({"sparse COO", [] { return at::eye(3).to_sparse(); }, "not strided"});
    cases.push_back({"sparse CSR", [] { return at::eye(3).to_sparse_csr(); }, "not strided"});
    cases.push_back({"quantized", [] { return at::quantize_per_tensor(at::rand({4}), 0.1, 10, at::kQUInt8); },
                     "quantized"});
    if (at::hasMKLDNN())
        cases.push_back({"MKLDNN", [] { return at::rand({2, 2}).to_mkldnn(); }, "cannot send"});
    cases.push_back({"nested", [] {
                         return at::_nested_tensor_from_tensor_list({at::ones({2}), at::ones({3})});
                     },
                     "nested"});
    if (at::hasCUDA())
        cases.push_back({"CUDA", [] { return at::ones({2}, at::TensorOptions().device(at::kCUDA)); },
                         "on device cuda"});
    return cases;
}

}  // namespace

TEST_SUITE("errors everywhere") {

TEST_CASE("an unsupported tensor on the root: its error by field path on the root, remote_error on every follower, group usable") {
    for (const auto& c : bad_tensors()) {
        at::Tensor bad;
        try {
            bad = c.make();
        } catch (const std::exception& e) {
            MESSAGE("skipping " << c.name << ": not constructible in this LibTorch build: " << e.what());
            continue;
        }
        for (int root : {0, 2}) {
            CAPTURE(c.name);
            CAPTURE(root);
            const auto outcomes = fail_then_recover(3, root, [&] {
                Step s = good_step(1);
                s.items[1].extra = bad;
                return s;
            });
            check_root_failure_reported(outcomes, root, spbcast::errc::unsupported_value,
                                        {"batch.items[1].extra", c.reason});
        }
    }
}

TEST_CASE("an unsupported tensor inside an IValue is reported with its path") {
    const auto outcomes = fail_then_recover(2, 1, [] {
        Step s = good_step(1);
        c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
        d.insert("ok", at::ones({1}));
        d.insert("bad", at::eye(2).to_sparse());
        s.dynamic = d;
        return s;
    });
    check_root_failure_reported(outcomes, 1, spbcast::errc::unsupported_value,
                                {"batch.dynamic[\"bad\"]", "not strided"});
}

TEST_CASE("an exception thrown by user code while the root encodes names the field and reaches every follower") {
    for (int root : {0, 1}) {
        CAPTURE(root);
        const auto outcomes = fail_then_recover(3, root, [] {
            Step s = good_step(1);
            s.fragile.explode = true;
            return s;
        });
        check_root_failure_reported(outcomes, root, spbcast::errc::unsupported_value,
                                    {"the image decoder exploded on sample 17", "batch.fragile"});
    }
}

TEST_CASE("the root's own error names its rank") {
    const auto outcomes = fail_then_recover(2, 1, [] {
        Step s = good_step(1);
        s.items[0].pixels = at::eye(2).to_sparse();
        return s;
    });
    CHECK_MESSAGE(contains(outcomes[1].what, "rank 1"), describe(outcomes));
}

TEST_CASE("a limit exceeded on the root: limit_exceeded there, remote_error on every follower, group usable") {
    struct limit_case {
        std::string name;
        std::function<void(spbcast::limits&)> set;
        std::function<void(Step&)> grow;
        std::vector<std::string> parts;
    };
    const std::vector<limit_case> cases = {
        {"max_tensors", [](auto& l) { l.max_tensors = 4; }, [](Step&) {}, {"max_tensors", "batch."}},
        {"max_dims", [](auto& l) { l.max_dims = 3; },
         [](Step& s) { s.named["deep"] = at::ones({1, 1, 1, 1}); }, {"max_dims", "batch.named[\"deep\"]"}},
        {"max_string_bytes", [](auto& l) { l.max_string_bytes = 16; },
         [](Step& s) { s.note = std::string(17, 'x'); }, {"max_string_bytes", "batch.note"}},
        {"max_container_size", [](auto& l) { l.max_container_size = 4; },
         [](Step& s) { s.lengths.assign(5, 1); }, {"max_container_size", "batch.lengths"}},
        {"max_payload_bytes", [](auto& l) { l.max_payload_bytes = 1 << 20; }, [](Step&) {},
         {"max_payload_bytes"}},
        {"max_frame_bytes", [](auto& l) { l.max_frame_bytes = 512; },
         [](Step& s) { s.lengths.assign(100, 7); }, {"max_frame_bytes"}},
        // The root's error message is longer than the frame limit itself: the error frame
        // must still reach the followers as the root's error, not as a limit of their own.
        {"max_frame_bytes below the root's message", [](auto& l) { l.max_frame_bytes = 96; },
         [](Step&) {}, {"max_frame_bytes"}},
        {"max_depth", [](auto& l) { l.max_depth = 8; },
         [](Step& s) {
             c10::IValue v = int64_t{1};
             for (int i = 0; i < 10; ++i) {
                 c10::impl::GenericList l(c10::AnyType::get());
                 l.push_back(v);
                 v = l;
             }
             s.dynamic = v;
         },
         {"max_depth", "batch.dynamic"}},
    };
    for (const auto& c : cases) {
        CAPTURE(c.name);
        spbcast::options opts;
        c.set(opts.limits);
        const auto outcomes = fail_then_recover(3, 0, [&] {
            Step s = good_step(1);
            c.grow(s);
            return s;
        }, opts);
        check_root_failure_reported(outcomes, 0, spbcast::errc::limit_exceeded, c.parts);
    }
}

TEST_CASE("a follower built with another batch type drains the payload and raises schema_error; the root and the others complete; the next step works") {
    for (bool checksum : {false, true}) {
        CAPTURE(checksum);
        std::vector<caught> outcomes(3);
        spbcast_test::run_ranks(3, [&](int rank, auto& group) {
            const spbcast::options opts{.root = 0, .timeout = 10s, .inplace_min_bytes = 1 << 16,
                                        .bucket_bytes = 1 << 12, .checksum = checksum};
            if (rank == 1) {
                faults::StepRenamed other;
                outcomes[rank] = catch_from([&] { spbcast::broadcast(other, group, opts); });
            } else {
                Step value;
                if (rank == 0) value = good_step(1);
                outcomes[rank] = catch_from([&] { spbcast::broadcast(value, group, opts); });
                if (rank == 2) spbcast_test::require_identical(good_step(1), value);
            }
            for (int64_t step = 2; step <= 3; ++step) {
                Step next;
                if (rank == 0) next = good_step(step);
                spbcast::broadcast(next, group, opts);
                spbcast_test::require_identical(good_step(step), next);
            }
        });
        const std::string all = describe(outcomes);
        CHECK_MESSAGE(!outcomes[0].threw, all);
        CHECK_MESSAGE(!outcomes[2].threw, all);
        REQUIRE_MESSAGE(outcomes[1].threw, all);
        CHECK_MESSAGE(outcomes[1].type == "schema_error", all);
        CHECK_MESSAGE(outcomes[1].code == spbcast::errc::schema_mismatch, all);
        CHECK_MESSAGE(contains(outcomes[1].what, "named_tensors"), all);
        CHECK_MESSAGE(contains(outcomes[1].what, "rank 1: broadcast #1 from root 0"), all);
    }
}

TEST_CASE("a frame of another wire-format version: followers drain and raise version_mismatch; the root completes; the next step works") {
    // The root's transport rewrites the version of the first frame it sends (and re-signs
    // the header), as a root built from another spbcast release would send. A second variant
    // also scrambles everything after the slot table: a future version may lay out the rest
    // of the body differently, and the slot table is all a follower needs to drain.
    for (bool scramble : {false, true}) {
        CAPTURE(scramble);
        std::vector<caught> outcomes(3);
        spbcast_test::run_ranks(3, [&](int rank, auto& real) {
            const spbcast::options opts{.root = 0, .timeout = 10s, .inplace_min_bytes = 1 << 16,
                                        .bucket_bytes = 1 << 12, .checksum = true};
            bool first = true;
            hooked_group group(real, [&](int call, std::vector<at::Tensor>& t) {
                if (rank != 0 || call != 1 || !first) return;
                first = false;
                rewrite_header(t[0], [&](spbcast::detail::frame_header& h) {
                    h.version = spbcast::detail::format_version + 1;
                    if (!scramble) return;
                    auto* body = static_cast<std::uint8_t*>(t[0].data_ptr()) + sizeof h;
                    spbcast::detail::byte_reader in(body, h.body_bytes, "test");
                    spbcast::detail::read_slots(in);
                    for (std::size_t i = in.offset(); i < h.body_bytes; ++i) body[i] = static_cast<std::uint8_t>(i * 131 + 7);
                    h.body_checksum = spbcast::detail::checksum64(body, h.body_bytes);
                });
            });
            Step value;
            if (rank == 0) value = good_step(1);
            outcomes[rank] = catch_from([&] { spbcast::broadcast(value, group, opts); });
            Step next;
            if (rank == 0) next = good_step(2);
            spbcast::broadcast(next, group, opts);
            spbcast_test::require_identical(good_step(2), next);
        });
        const std::string all = describe(outcomes);
        CHECK_MESSAGE(!outcomes[0].threw, all);
        for (int f : {1, 2}) {
            REQUIRE_MESSAGE(outcomes[f].threw, all);
            CHECK_MESSAGE(outcomes[f].code == spbcast::errc::version_mismatch, all);
            CHECK_MESSAGE(contains(outcomes[f].what, "version " + std::to_string(spbcast::detail::format_version + 1)), all);
        }
    }
}

}  // TEST_SUITE
