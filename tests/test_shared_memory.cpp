// The same-host path (include/spbcast/detail/transport/: shm_*.hpp, same_host.hpp, relay.hpp and
// the sockets, links and handshake under them): real processes over a real Gloo group on
// 127.0.0.1 (tests/shm_worker.cpp), real SIGKILLs, real descriptors; and the follower's checks of
// a segment it is handed, over a real socket.
#include "support/counting_group.hpp"
#include "support/fixtures.hpp"
#include "support/processes.hpp"
#include "support/ranks.hpp"

#include <spbcast/spbcast.hpp>

#include <doctest/doctest.h>

#include <ATen/Parallel.h>
#include <c10/core/CPUAllocator.h>

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/wait.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <optional>
#include <random>
#include <thread>

namespace {

using namespace std::chrono_literals;

std::filesystem::path worker() { return spbcast_test::binary_dir() / "spbcast_shm_worker"; }

long shmem_kib() {
    std::ifstream in("/proc/meminfo");
    std::string line;
    while (std::getline(in, line))
        if (line.rfind("Shmem:", 0) == 0) return std::stol(line.substr(6));
    return -1;
}

// Shmem is system-wide: wait a little for the kernel to free the pages of exited processes.
bool shmem_back_to(long baseline, long tolerance_kib) {
    for (int i = 0; i < 50; ++i) {
        if (shmem_kib() <= baseline + tolerance_kib) return true;
        std::this_thread::sleep_for(100ms);
    }
    return false;
}

std::vector<spbcast_test::process_result> run_check(int world, const std::string& profile, int mb, int steps,
                                                    int root, const std::string& transport,
                                                    const std::string& expect) {
    return spbcast_test::run_processes(
        worker(), world,
        [&](int) {
            return std::vector<std::string>{"check", profile, std::to_string(mb), std::to_string(steps),
                                            std::to_string(root), transport, expect};
        },
        120s);
}

void require_all_ok(const std::vector<spbcast_test::process_result>& results) {
    for (const auto& r : results) REQUIRE_MESSAGE(r.exit_code == 0, spbcast_test::describe(results));
}

// A group of one, only for the messages of the follower-side checks below.
struct solo_group {
    int getRank() const { return 1; }
    int getSize() const { return 2; }
    void broadcast(std::vector<at::Tensor>&, const c10d::BroadcastOptions&) {}
};

}  // namespace

TEST_CASE("shared memory: ranks on one host use it; batches bit-exact, writes private, storages resizable") {
    const long baseline = shmem_kib();
    for (auto [world, root] : {std::pair{3, 0}, std::pair{4, 2}}) {
        CAPTURE(world);
        const auto results = run_check(world, "qwen3-vl-image", 1, 4, root, "auto", "shared");
        require_all_ok(results);
        // Steady state fills recycled segments.
        CHECK_MESSAGE(results[root].output.find("reused 0 ") == std::string::npos, results[root].output);
    }
    CHECK(shmem_back_to(baseline, 4096));
}

TEST_CASE("shared memory: transport_mode::network never uses it") {
    require_all_ok(run_check(3, "text", 1, 3, 0, "network", "network"));
}

TEST_CASE("shared memory: a follower's batch stays valid and writable after the root dies") {
    const long baseline = shmem_kib();
    const auto results = spbcast_test::run_processes(
        worker(), 3, [](int) { return std::vector<std::string>{"root_dies", "qwen3-vl-image"}; }, 120s);
    require_all_ok(results);
    for (int r = 1; r < 3; ++r)
        CHECK_MESSAGE(results[r].output.find("intact and writable") != std::string::npos, spbcast_test::describe(results));
    CHECK(shmem_back_to(baseline, 4096));
}

TEST_CASE("shared memory: SIGKILL of any rank at random points; survivors raise and leak nothing") {
    const long baseline = shmem_kib();
    std::mt19937 rng(20261201);
    const int rounds = 8;
    for (int round = 0; round < rounds; ++round) {
        const int world = 3;
        const int victim = static_cast<int>(rng() % world);
        const auto delay = std::chrono::milliseconds(rng() % 600);  // from the handshake on
        CAPTURE(round);
        CAPTURE(victim);
        CAPTURE(delay.count());
        // The victim kills itself from a thread at a random moment of its broadcast loop: a real
        // SIGKILL, delivered wherever its main thread happens to be.
        const auto results = spbcast_test::run_processes(
            worker(), world,
            [&](int rank) {
                return std::vector<std::string>{"kill_loop", std::to_string(round * 7 + 1)};
            },
            60s,
            {"SPBCAST_TEST_KILL_RANK=" + std::to_string(victim),
             "SPBCAST_TEST_KILL_AFTER_MS=" + std::to_string(delay.count())});
        REQUIRE_MESSAGE(results[victim].signal == SIGKILL, spbcast_test::describe(results));
        for (int r = 0; r < world; ++r) {
            if (r == victim) continue;
            // Exit 3: raised spbcast::error and holds no memfd or extra socket afterwards.
            CHECK_MESSAGE(results[r].exit_code == 3, spbcast_test::describe(results));
            CHECK_MESSAGE(results[r].seconds < 30, spbcast_test::describe(results));
        }
    }
    CHECK_MESSAGE(shmem_back_to(baseline, 4096), "Shmem " << shmem_kib() << " KiB, baseline " << baseline);
}

TEST_CASE("shared memory: a soak of SPBCAST_SOAK_STEPS broadcasts keeps descriptors and memory flat") {
    const auto rounds = spbcast_test::soak_steps();
    const auto results = spbcast_test::run_processes(
        worker(), 3, [&](int) { return std::vector<std::string>{"soak", std::to_string(rounds)}; }, 600s);
    require_all_ok(results);
    MESSAGE(spbcast_test::describe(results));
}

TEST_CASE("shared memory: a batch whose segment cannot be created goes over the network, intact") {
    const auto results = spbcast_test::run_processes(
        worker(), 3, [](int) { return std::vector<std::string>{"fallback", "qwen3-vl-image"}; }, 120s);
    require_all_ok(results);
    CHECK_MESSAGE(results[0].output.find("step 1 network fallback") != std::string::npos, spbcast_test::describe(results));
}

TEST_CASE("shared memory: a root whose memory cgroup cannot hold the segment sends over the network, intact, and lives") {
    const auto results = spbcast_test::run_processes(
        worker(), 3, [](int) { return std::vector<std::string>{"cgroup_fallback", "qwen3-vl-image"}; }, 120s);
    if (results[0].exit_code == 77) {
        MESSAGE("skipped: this process may not create a memory cgroup - " << results[0].output);
        return;
    }
    require_all_ok(results);
    CHECK_MESSAGE(results[0].output.find("1 network fallback") != std::string::npos, spbcast_test::describe(results));
}

TEST_CASE("shared memory: ranks as threads - checksums, a root error after the segment was handed over, then the next batch") {
    spbcast_test::run_ranks(3, [&](int rank, auto& group) {
        auto batch = [](int seed) {
            return std::vector<at::Tensor>{at::arange(seed, seed + (1 << 20), at::kFloat),
                                           at::full({7}, seed, at::kLong)};
        };
        std::vector<at::Tensor> b = rank == 1 ? batch(3) : std::vector<at::Tensor>{};
        spbcast::broadcast(b, group, {.root = 1, .checksum = true});
        CHECK(spbcast::digest(b) == spbcast::digest(batch(3)));
        auto state = spbcast::detail::same_host_registry::instance().find(&spbcast::detail::group_of(group), 1);
        REQUIRE(state);
        CHECK(state->shared);
        // The root fails after the payload went into a segment (its frame breaks a limit): every
        // follower raises the root's error and lets the segment go, and the group stays in step.
        std::vector<at::Tensor> bad = rank == 1 ? batch(4) : std::vector<at::Tensor>{};
        spbcast::limits tight;
        tight.max_frame_bytes = 64;
        try {
            spbcast::broadcast(bad, group, {.root = 1, .limits = tight});
            FAIL("a frame beyond the limits was sent");
        } catch (const spbcast::error& e) {
            CHECK((rank == 1 ? e.code() == spbcast::errc::limit_exceeded : e.code() == spbcast::errc::remote));
        }
        std::vector<at::Tensor> next = rank == 1 ? batch(5) : std::vector<at::Tensor>{};
        spbcast::broadcast(next, group, {.root = 1});
        CHECK(spbcast::digest(next) == spbcast::digest(batch(5)));
    });
}

// The groups Python (c10d::ProcessGroup) and the C++ helpers (ProcessGroupGloo) hand spbcast
// qualify for the hierarchical path.
static_assert(spbcast::detail::point_to_point_group<c10d::ProcessGroup>);
static_assert(spbcast::detail::point_to_point_group<c10d::ProcessGroupGloo>);

TEST_CASE("hierarchical: on one host it is the same-host path; a transport without send/recv is refused on every rank") {
    // Across hosts: scripts/shm_netns_test.sh (network namespaces), bench/hosts_bench.sh.
    spbcast_test::run_ranks(3, [&](int rank, auto& group) {
        const spbcast::options opts{.transport = spbcast::transport_mode::hierarchical};
        std::vector<at::Tensor> b = rank == 0 ? std::vector<at::Tensor>{at::arange(1 << 20, at::kFloat)}
                                              : std::vector<at::Tensor>{};
        spbcast::broadcast(b, group, opts);
        CHECK(spbcast::digest(b) == spbcast::digest(std::vector<at::Tensor>{at::arange(1 << 20, at::kFloat)}));
        auto state = spbcast::detail::same_host_registry::instance().find(&spbcast::detail::group_of(group), 0);
        REQUIRE(state);
        CHECK(state->shared);
        CHECK_FALSE(state->relays());
        spbcast_test::counting_group own{group};  // broadcast only: no send/recv
        try {
            spbcast::broadcast(b, own, opts);
            FAIL("hierarchical was taken without send/recv");
        } catch (const spbcast::error& e) {
            CHECK(e.code() == spbcast::errc::invalid_argument);
            CHECK(std::string(e.what()).find("send and recv") != std::string::npos);
        }
        CHECK(own.collectives == 0);
    });
}

TEST_CASE("shared memory: a leader that allocates its batch in shared memory sends it without a copy") {
    const long baseline = shmem_kib();
    const auto results = spbcast_test::run_processes(
        worker(), 3, [](int) { return std::vector<std::string>{"leader_allocates", "qwen3-vl-image", "2", "3"}; }, 120s);
    require_all_ok(results);
    CHECK_MESSAGE(results[0].output.find("step 2 tensors allocated") != std::string::npos, spbcast_test::describe(results));

    // The group then holds about one copy of the batch: the root's pages are the followers'.
    // The shared part is read from /proc/meminfo's Shmem, a count of the whole machine that
    // another program's shared memory moves too: on a busy machine the least of up to three
    // measurements counts.
    double ratio = 0;
    std::string out;
    for (int attempt = 0; attempt < 3 && (attempt == 0 || ratio >= 1.5); ++attempt) {
        const auto memory = spbcast_test::run_processes(
            worker(), 3,
            [](int) { return std::vector<std::string>{"group_memory", "qwen3-vl-image", "2", "auto", "leader_allocates"}; },
            120s);
        require_all_ok(memory);
        const auto& said = memory[0].output;
        const auto x = said.find("x the payload");
        REQUIRE_MESSAGE(x != std::string::npos, said);
        const double measured = std::stod(said.substr(said.rfind(' ', x - 1) + 1, x));
        if (attempt == 0 || measured < ratio) ratio = measured, out = said;
    }
    MESSAGE(out);
    CHECK_MESSAGE(ratio < 1.5, out);
    CHECK(shmem_back_to(baseline, 4096));
}

TEST_CASE("shared memory: shared_memory_scope allocates large CPU tensors of its thread in segments") {
    using spbcast::shared_memory_statistics;
    const auto allocated = [] { return shared_memory_statistics().tensors_allocated; };
    const auto start = allocated();
    at::Tensor outside = at::empty({1 << 20}, at::kFloat);
    CHECK(allocated() == start);
    at::Tensor big, small, nested_small;
    {
        spbcast::shared_memory_scope scope;
        big = at::arange(1 << 20, at::kFloat);        // 4 MiB: in a segment
        small = at::arange(1 << 10, at::kFloat);      // 4 KiB: below min_bytes
        CHECK(allocated() == start + 1);
        {
            spbcast::shared_memory_scope everything(1);  // raised to 64 KiB, the least
            nested_small = at::zeros({1 << 15}, at::kByte);  // 32 KiB: still ordinary
            at::Tensor mid = at::zeros({1 << 17}, at::kByte);  // 128 KiB
            CHECK(allocated() == start + 2);
        }
        // Another thread is outside the scope.
        std::thread([&] { at::Tensor t = at::empty({1 << 20}, at::kFloat); }).join();
        CHECK(allocated() == start + 2);
    }
    at::Tensor after = at::empty({1 << 20}, at::kFloat);
    CHECK(allocated() == start + 2);
    CHECK(spbcast::detail::shared_allocation_of(big.storage()) != nullptr);
    CHECK(spbcast::detail::shared_allocation_of(small.storage()) == nullptr);
    CHECK(spbcast::detail::shared_allocation_of(after.storage()) == nullptr);
    CHECK(big[12345].item<float>() == 12345.0f);
    // An ordinary tensor in every other way: writable, resizable.
    big.mul_(2);
    CHECK(big[12345].item<float>() == 24690.0f);
    big.resize_({3 << 20});
    CHECK(big[12345].item<float>() == 24690.0f);

    // Ranks as threads: the root thread's batch goes over without a copy, checksums included,
    // and a tensor the root kept outside the scope is copied next to it.
    spbcast_test::run_ranks(3, [&](int rank, auto& group) {
        auto make = [](int seed) {
            return std::vector<at::Tensor>{at::arange(seed, seed + (1 << 20), at::kFloat),
                                           at::full({3 << 18}, seed, at::kDouble), at::full({7}, seed, at::kLong)};
        };
        std::vector<at::Tensor> b;
        if (rank == 0) {
            b = make(11);
            spbcast::shared_memory_scope scope;
            b[0] = b[0].clone();
        }
        const auto shared_before = shared_memory_statistics().tensors_shared;
        spbcast::broadcast(b, group, {.checksum = true});
        CHECK(spbcast::digest(b) == spbcast::digest(make(11)));
        if (rank == 0) {
            CHECK(shared_memory_statistics().tensors_shared >= shared_before + 1);
        }
    });
}

TEST_CASE("shared memory: a follower rejects a short, unsealed or out-of-order segment as corrupt_frame") {
    using namespace spbcast::detail;
    int pair[2];
    REQUIRE(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair) == 0);
    owned_fd root_end(pair[0]);
    same_host_state state;
    state.shared = true;
    state.link = std::make_shared<follower_link>(owned_fd(pair[1]));
    solo_group group;
    const spbcast::options opts{.timeout = 2s};
    group_state gstate;
    collective<solo_group> c(group, opts, gstate, 1);
    std::vector<slot_meta> slots(1);
    slots[0].bytes = 8192;  // one transferred slot
    segment_layout layout;
    layout.segments = {{5, 64 << 10, 8192}};
    layout.places = {{0, 0}};

    auto hand_over = [&](int fd, std::uint64_t sequence) {
        shm_message m;
        m.kind = shm_message_kind::segments;
        m.sequence = sequence;
        m.count = 1;
        m.descriptors = 1;
        m.ids[0] = 5;
        REQUIRE(send_message(root_end.get(), m, {fd}, 2000ms) == send_status::sent);
    };
    auto released = [&] {
        shm_message m;
        std::vector<owned_fd> none;
        return receive_message(root_end.get(), m, none, 2000ms) == receive_status::ok &&
               m.kind == shm_message_kind::released && m.count == 1 && m.ids[0] == 5;
    };
    auto expect_corrupt = [&](const std::string& what) {
        auto delivery = take_segments(c, &state, 9);
        try {
            map_segments(c, delivery, layout, slots);
            FAIL("accepted a segment that is " << what);
        } catch (const spbcast::error& e) {
            CHECK(e.code() == spbcast::errc::corrupt_frame);
            CHECK(std::string(e.what()).find("rank 1") != std::string::npos);
            MESSAGE(what << ": " << std::string(e.what()));
        }
    };

    SUBCASE("unsealed") {
        owned_fd fd(memfd_create_compat("spbcast-test", MFD_CLOEXEC | MFD_ALLOW_SEALING));
        REQUIRE(::ftruncate(fd.get(), 64 << 10) == 0);
        hand_over(fd.get(), 9);
        expect_corrupt("unsealed");
    }
    SUBCASE("short") {
        std::string why;
        shm_segment s = shm_segment::create(16 << 10, why);
        REQUIRE(s);
        hand_over(s.fd(), 9);
        expect_corrupt("short");
    }
    SUBCASE("stale, then short: the stale message is released unmapped and skipped") {
        std::string why;
        shm_segment stale = shm_segment::create(64 << 10, why), s = shm_segment::create(16 << 10, why);
        REQUIRE(stale);
        REQUIRE(s);
        hand_over(stale.fd(), 8);
        hand_over(s.fd(), 9);
        expect_corrupt("short, after a stale message");
        CHECK(released());  // the stale one
    }
    SUBCASE("valid: mapped privately, released when the last storage goes") {
        std::string why;
        shm_segment s = shm_segment::create(64 << 10, why);
        REQUIRE(s);
        std::memset(s.data(), 0x5a, 8192);
        hand_over(s.fd(), 9);
        auto delivery = take_segments(c, &state, 9);
        auto slot_data = map_segments(c, delivery, layout, slots);
        REQUIRE(slot_data.size() == 1);
        at::Tensor t = slot_data[0];
        CHECK(t.numel() == 8192);
        CHECK(t[100].item<std::uint8_t>() == 0x5a);
        t.fill_(1);  // private: the root's pages keep their bytes
        CHECK(s.data()[100] == 0x5a);
        slot_data.clear();
        t = at::Tensor();
        CHECK(released());
        return;
    }
    // Every rejected segment is reported back, so the root can reuse it.
    CHECK(released());
}

namespace {

std::vector<spbcast_test::process_result> run_mode(int world, std::vector<std::string> args,
                                                   std::chrono::seconds deadline = 120s) {
    return spbcast_test::run_processes(worker(), world, [&](int) { return args; }, deadline);
}

}  // namespace

TEST_CASE("shared memory: what a root sent before it closed its link is read, though it left a report unread") {
    // A root may end its path (close_same_host_channels, an error) as soon as its broadcast
    // returned, before a follower read that broadcast's segments and with the follower's own
    // report unread: the kernel then reports ECONNRESET to the follower first, once.
    using namespace spbcast::detail;
    int pair[2];
    REQUIRE(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair) == 0);
    owned_fd root_end(pair[0]), follower_end(pair[1]);
    shm_message report;
    report.kind = shm_message_kind::released;
    REQUIRE(send_message(follower_end.get(), report, {}, 1000ms) == send_status::sent);
    owned_fd attached(::open("/dev/null", O_RDONLY | O_CLOEXEC));  // stands for a segment's memfd
    shm_message segments;
    segments.kind = shm_message_kind::segments;
    segments.sequence = 7;
    segments.count = segments.descriptors = 1;
    segments.ids[0] = 3;
    REQUIRE(send_message(root_end.get(), segments, {attached.get()}, 1000ms) == send_status::sent);
    root_end.reset();

    shm_message got;
    std::vector<owned_fd> fds;
    REQUIRE(receive_message(follower_end.get(), got, fds, 1000ms) == receive_status::ok);
    CHECK((got.kind == shm_message_kind::segments && got.sequence == 7 && got.ids[0] == 3));
    CHECK(fds.size() == 1);
    CHECK(receive_message(follower_end.get(), got, fds, 1000ms) == receive_status::closed);
}

TEST_CASE("shared memory: a child forked after a batch arrived keeps that batch while later ones reuse memory") {
    const long baseline = shmem_kib();
    for (const std::string side : {"follower", "root"}) {
        CAPTURE(side);
        const auto results = run_mode(3, {"fork_child", side});
        require_all_ok(results);
        CHECK_MESSAGE(results[side == "root" ? 0 : 1].output.find("child's batch is intact") != std::string::npos,
                      spbcast_test::describe(results));
    }
    CHECK(shmem_back_to(baseline, 4096));
}

TEST_CASE("shared memory: a follower drops hundreds of kept batches at once; nothing blocks, the root stays bounded") {
    const auto results = run_mode(3, {"burst", "400"});
    require_all_ok(results);
    MESSAGE(spbcast_test::describe(results));
}

TEST_CASE("shared memory: the free-segment bound follows the batch size unless the user fixed it") {
    // Batches of 4 MiB against a base of 1 MiB: with the bound following the batch size (the
    // default's behaviour, at a small base), the second batch on refills the first one's segment.
    for (const std::string mode : {"follows", "fixed", "keeps_one"}) {
        CAPTURE(mode);
        const auto results = spbcast_test::run_processes(
            worker(), 3, [&](int) { return std::vector<std::string>{"budget", mode, "6"}; }, 120s);
        require_all_ok(results);
        MESSAGE(results[0].output);
    }
    const auto defaults = spbcast::default_shared_memory_limits;
    CHECK(defaults.free_bytes == std::size_t{2} << 30);
    CHECK(defaults.free_batches == 2);
    CHECK(spbcast::shared_memory_limits{}.free_batches == 0);  // limits a user fills in are fixed
}

TEST_CASE("shared memory: a follower at its descriptor limit gets a clear error; the root stays flat") {
    const auto results = run_mode(3, {"fd_limit"});
    require_all_ok(results);
    CHECK_MESSAGE(results[1].output.find("RLIMIT_NOFILE") != std::string::npos, spbcast_test::describe(results));
}

TEST_CASE("shared memory: options.transport is agreed: a disagreement raises on every rank at once, the group stays usable") {
    const auto results = run_mode(3, {"disagree"});
    require_all_ok(results);
    for (const auto& r : results) CHECK_MESSAGE(r.seconds < 30, spbcast_test::describe(results));
}

TEST_CASE("shared memory: a lost link moves every rank to the network together, batches intact") {
    require_all_ok(run_mode(3, {"lost_link"}));
}

TEST_CASE("shared memory: the allocator forwards c10's raw interface, inside and outside a scope") {
    constexpr std::size_t bytes = std::size_t{2} << 20;
    auto* mine = spbcast::detail::install_shared_memory_allocator();
    // Whatever allocator is in front now (this suite installs others later), and spbcast's itself.
    for (c10::Allocator* allocator : {c10::GetCPUAllocator(), static_cast<c10::Allocator*>(mine)}) {
        REQUIRE((allocator->raw_deleter() != nullptr));
        void* outside = allocator->raw_allocate(bytes);
        REQUIRE(outside != nullptr);
        std::memset(outside, 1, bytes);
        allocator->raw_deallocate(outside);
        spbcast::shared_memory_scope in_shared_memory;
        void* inside = allocator->raw_allocate(bytes);
        REQUIRE(inside != nullptr);
        std::memset(inside, 2, bytes);
        allocator->raw_deallocate(inside);
    }
#if SPBCAST_TORCH_AT_LEAST(2, 0)
    spbcast::shared_memory_scope in_shared_memory;
    c10::DataPtr a = mine->allocate(bytes), b = mine->allocate(bytes);
    std::memset(a.get(), 7, bytes);
    mine->copy_data(b.get(), a.get(), bytes);
    CHECK(static_cast<unsigned char*>(b.get())[bytes - 1] == 7);
    CHECK(mine->is_simple_data_ptr(a));
#endif
}

TEST_CASE("shared memory: a scope closed on another thread stops its opener's thread from allocating in segments") {
    using spbcast::detail::shared_allocation_of;
    std::optional<spbcast::shared_memory_scope> scope;
    scope.emplace();
    const at::Tensor inside = at::empty({1 << 20}, at::kFloat);
    CHECK(shared_allocation_of(inside.storage()) != nullptr);
    std::thread([&] { scope.reset(); }).join();
    const at::Tensor after = at::empty({1 << 20}, at::kFloat);
    CHECK(shared_allocation_of(after.storage()) == nullptr);
    {   // nesting still restores the outer scope
        spbcast::shared_memory_scope outer;
        { spbcast::shared_memory_scope inner(std::size_t{8} << 20); }
        const at::Tensor t = at::empty({1 << 20}, at::kFloat);
        CHECK(shared_allocation_of(t.storage()) != nullptr);
    }
}

TEST_CASE("shared memory: fork while other threads allocate, free and report: the child never deadlocks") {
    std::atomic<bool> stop{false};
    std::vector<std::thread> busy;
    for (int t = 0; t < 2; ++t)
        busy.emplace_back([&] {
            while (!stop) {
                spbcast::shared_memory_scope in_shared_memory;
                at::Tensor a = at::empty({1 << 18}, at::kFloat);  // 1 MiB: a segment each
                a.fill_(1);
                (void)spbcast::shared_memory_statistics();
            }
        });
    int hung = 0;
    at::Tensor kept;
    {
        spbcast::shared_memory_scope in_shared_memory;
        kept = at::full({1 << 18}, 3.0f);
    }
    for (int i = 0; i < 40; ++i) {
        const pid_t child = ::fork();
        if (child == 0) {
            at::set_num_threads(1);  // libgomp is not fork-safe (see shm_worker.cpp)
            // Every lock the library may take here must be free in the child.
            {
                spbcast::shared_memory_scope in_shared_memory;
                at::Tensor t = at::empty({1 << 18}, at::kFloat);
                if (spbcast::detail::shared_allocation_of(t.storage()) != nullptr) ::_exit(2);  // a child never uses the pool
            }
            const bool intact = kept.equal(at::full({1 << 18}, 3.0f));
            kept = at::Tensor();  // frees an inherited shared allocation
            (void)spbcast::shared_memory_statistics();
            ::_exit(intact ? 0 : 3);
        }
        int status = 0;
        bool done = false;
        for (int w = 0; w < 100 && !done; ++w) {
            done = ::waitpid(child, &status, WNOHANG) == child;
            if (!done) std::this_thread::sleep_for(50ms);
        }
        if (!done) {
            ++hung;
            ::kill(child, SIGKILL);
            ::waitpid(child, &status, 0);
            continue;
        }
        CHECK_MESSAGE((WIFEXITED(status) && WEXITSTATUS(status) == 0), "child " << i << " status " << status);
    }
    stop = true;
    for (auto& t : busy) t.join();
    CHECK(hung == 0);
}
