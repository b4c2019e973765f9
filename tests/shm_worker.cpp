// One rank of the same-host path's multi-process tests (tests/test_shared_memory.cpp), started
// with the launcher environment over a real Gloo group.
//
//   spbcast_shm_worker check <profile> <micro_batches> <steps> <root> <auto|network|shm|hier> <shared|hosts|network|refused>
//       broadcasts realistic batches; checks digests, which path was chosen (hosts: the
//       hierarchical one, over hosts), that a follower's writes stay private to it, that storages
//       resize; prints this rank's descriptors.
//   spbcast_shm_worker root_dies <profile>
//       the root sends one batch and exits; followers check that batch afterwards.
//   spbcast_shm_worker kill_loop <seed>
//       broadcasts batches of random sizes until the group fails (a rank is SIGKILLed by the
//       test); a survivor must raise spbcast::error, then holds no descriptor of ours: exit 3.
//   spbcast_shm_worker fallback <profile>
//       the root cannot create a segment for one batch: it goes over the network, intact.
//   spbcast_shm_worker cgroup_fallback <profile>
//       the root moves into a memory cgroup too small for the batch's segment: the batch goes
//       over the network, intact, and the root lives (exit 77 on every rank where it may not).
//   spbcast_shm_worker leader_allocates <profile> <micro_batches> <steps>
//       the root builds its batches in a shared_memory_scope: they travel without a copy, stay
//       bit-exact, and neither the root's later writes nor a follower's reach another rank; a
//       child a follower forks (a loader worker) neither releases its segments nor allocates
//       from the pool.
//   spbcast_shm_worker group_memory <profile> <micro_batches> <auto|network|shm> [leader_allocates|plain] [root]
//       prints the group's memory while a batch is alive (sum of Pss_Anon + change in Shmem).
//   spbcast_shm_worker soak <rounds>
//       many small and mid-sized batches; descriptor count and memory must stay flat.
//   spbcast_shm_worker fork_child <follower|root>
//       a follower (or a root allocating its batch in a shared_memory_scope) forks a child that
//       keeps the batch; the parent drops it and three more batches of the same size go by; the
//       child's batch must be unchanged, and the child holds none of our descriptors.
//   spbcast_shm_worker burst <kept>
//       a follower keeps <kept> batches with a segment each, then drops them all at once while
//       the root waits in another collective: nothing blocks, and the root's tracked segments
//       and descriptors stay under the pool's bound, then fall back once the answers are read.
//   spbcast_shm_worker fd_limit
//       a follower at its descriptor limit gets a clear limit_exceeded error per batch while the
//       root's held memory and descriptors stay flat; with room again it gets batches again.
//   spbcast_shm_worker disagree
//       a follower passes another options.transport than the other ranks on the group's first
//       broadcast: every rank raises invalid_argument naming both; then all agree, and it works.
//   spbcast_shm_worker lost_link
//       a follower's link is lost, and a follower skips a same-host broadcast (a network call):
//       stale messages are skipped, the lost link moves every rank to the network, intact.
//   spbcast_shm_worker hosts_bench <profile> <micro_batches> <root> <repeats> [relay chunk bytes]
//       for bench/hosts_bench.sh (ranks in network namespaces): one raw Gloo broadcast of the
//       payload's bytes, the network path and automatic (hierarchical over hosts), side by side:
//       median time and bytes over the links per batch (the namespaces' veth counters;
//       HOST_COUNTER=1 on one rank per namespace) over the payload.
//   spbcast_shm_worker slow_links <relay chunk bytes>
//       for shm_netns_test.sh (3 namespaces x 2 ranks at 200 Mbit/s): 96 MiB twice with a 1 s timeout
//       arrives on the hierarchical path; a 2 MiB view of a 48 MiB shared storage sends 2 MiB.
//   spbcast_shm_worker budget <follows|fixed|keeps_one> <steps>
//       the root's free-segment bound against batches larger than its base (1 MiB; 4 MiB
//       batches): "follows" (free_batches = 2: the bound follows the batch size) reuses one
//       segment from the second batch on; "fixed" (set_shared_memory_limit, the user's bound)
//       creates one per batch; "keeps_one": followers keep batch t while t + 1 arrives and are
//       slow to come back, the root is fast - the released segment returns before the next batch
//       is placed, so the root never tracks more than the two batches the loop keeps alive.
//   spbcast_shm_worker ranks <world> <mode> <arguments...>
//       starts <world> ranks of this program in <mode> on a store of their own (the test kit's
//       launcher, for bench/report.py), prints rank 0's output, fails if a rank failed.
#include "profiles.hpp"
#include "support/processes.hpp"

#include <ATen/Parallel.h>

#include <spbcast/spbcast.hpp>

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <iostream>
#include <optional>
#include <random>
#include <thread>

namespace {

struct fd_census {
    int total = 0, sockets = 0, memfds = 0;
};

fd_census count_fds() {
    fd_census c;
    DIR* d = ::opendir("/proc/self/fd");
    while (dirent* e = ::readdir(d)) {
        if (e->d_name[0] == '.') continue;
        char target[256] = {};
        const std::string path = std::string("/proc/self/fd/") + e->d_name;
        if (::readlink(path.c_str(), target, sizeof target - 1) < 0) continue;
        const std::string t = target;
        ++c.total;
        if (t.rfind("socket:", 0) == 0) ++c.sockets;
        if (t.rfind("/memfd:", 0) == 0) ++c.memfds;
    }
    ::closedir(d);
    --c.total;  // the directory stream itself
    return c;
}

long kib_of(const char* file, const char* key) {
    std::ifstream in(file);
    std::string line;
    while (std::getline(in, line))
        if (line.rfind(key, 0) == 0) return std::stol(line.substr(std::strlen(key)));
    return -1;
}

spbcast::transport_mode mode_of(const std::string& s) {
    if (s == "network") return spbcast::transport_mode::network;
    if (s == "shm") return spbcast::transport_mode::shared_memory;
    if (s == "hier") return spbcast::transport_mode::hierarchical;
    return spbcast::transport_mode::automatic;
}

template <class G>
std::shared_ptr<spbcast::detail::same_host_state> path_of(G& group, int root) {
    auto state = spbcast::detail::same_host_registry::instance().find(&spbcast::detail::group_of(group), root);
    return state && state->shared ? state : nullptr;
}

template <class G>
bool chose_shared(G& group, int root) {
    return path_of(group, root) != nullptr;
}

// "shared" (one host), "hosts" (the hierarchical path) or "network".
template <class G>
std::string path_name(G& group, int root) {
    const auto state = path_of(group, root);
    return !state ? "network" : state->relays() ? "hosts" : "shared";
}

// Every tensor of the batch, for writing into.
std::vector<at::Tensor> tensors_of(xtuner::Batch& b) {
    std::vector<at::Tensor> out;
    for (auto& item : b) {
        out.push_back(item.seq_ctx.input_ids);
        out.push_back(item.shifted_labels);
        if (item.seq_ctx.pixel_values) out.push_back(*item.seq_ctx.pixel_values);
    }
    return out;
}

// A group-wide point every rank reaches before any goes on (a tiny network-path broadcast).
template <class G>
void barrier(G& group) {
    at::Tensor t = at::zeros({1}, at::kLong);
    spbcast::broadcast(t, group, {.timeout = std::chrono::seconds(30), .transport = spbcast::transport_mode::network});
}

int check(int argc, char** argv) {
    const auto profile = xtuner::profile_from_name(argv[2]);
    const int micro_batches = std::stoi(argv[3]), steps = std::stoi(argv[4]), root = std::stoi(argv[5]);
    const auto transport = mode_of(argv[6]);
    const std::string expect = argv[7];
    (void)argc;
    auto [env, store, group] = spbcast_test::join_job(std::chrono::seconds(30));
    const spbcast::options opts{.root = root, .timeout = std::chrono::seconds(30), .transport = transport};
    // SPBCAST_TEST_NO_DESCRIPTORS_RANK: that rank can open no descriptor during the first
    // broadcast (its RLIMIT_NOFILE at its lowest free descriptor), so in the handshake it can
    // neither read its host's identity nor create a segment: on the hierarchical path it gets
    // the payload on its own.
    std::optional<rlimit> saved_limit;
    if (const char* r = std::getenv("SPBCAST_TEST_NO_DESCRIPTORS_RANK"); r && std::atoi(r) == env.rank) {
        rlimit limit{};
        ::getrlimit(RLIMIT_NOFILE, &limit);
        saved_limit = limit;
        const int lowest_free = ::dup(0);
        ::close(lowest_free);
        limit.rlim_cur = static_cast<rlim_t>(lowest_free);
        ::setrlimit(RLIMIT_NOFILE, &limit);
    }
    // The followers whose writes must stay private: one on the root's host, and the last rank
    // (on another host when the group spans hosts).
    const int writer = root == 0 ? 1 : 0;
    const int other_writer = env.world_size - 1 == root ? env.world_size - 2 : env.world_size - 1;
    const auto writes = [&](int r) { return r == writer || (r == other_writer && env.world_size > 3); };
    for (int step = 0; step < steps; ++step) {
        xtuner::Batch batch;
        if (env.rank == root) batch = xtuner::make_batch(profile, micro_batches, step);
        try {
            spbcast::broadcast(batch, group, opts);
        } catch (const spbcast::error& e) {
            if (expect == "refused" && e.code() == spbcast::errc::invalid_argument) {
                std::cout << "rank " << env.rank << " refused: " << e.what() << "\n";
                return 0;
            }
            throw;
        }
        if (saved_limit) {
            ::setrlimit(RLIMIT_NOFILE, &*saved_limit);
            saved_limit.reset();
        }
        if (expect == "refused") {
            std::cerr << "rank " << env.rank << ": transport shared_memory was not refused\n";
            return 1;
        }
        const std::string path = path_name(group, root);
        if (step == 0 && path == "hosts") {  // this rank's host leader, and the ranks it serves
            const auto state = path_of(group, root);
            std::cout << "rank " << env.rank << " leader " << state->leader << " serves " << state->links.size() << "\n";
        }
        if (path != expect) {
            std::cerr << "rank " << env.rank << ": expected the " << expect << " path, got " << path << "\n";
            return 1;
        }
        const auto want = spbcast::digest(xtuner::make_batch(profile, micro_batches, step));
        if (spbcast::digest(batch) != want) {
            std::cerr << "rank " << env.rank << ": step " << step << " differs from the root's batch\n";
            return 1;
        }
        if (step == 0 && env.world_size > 2) {
            // One follower writes over its whole batch; every other rank must not see it.
            if (writes(env.rank))
                for (auto& t : tensors_of(batch)) t.fill_(7);
            barrier(group);
            if (spbcast::digest(batch) != want && !writes(env.rank)) {
                std::cerr << "rank " << env.rank << ": another rank's write showed in this rank's batch\n";
                return 1;
            }
            if (writes(env.rank) && spbcast::digest(batch) == want) {
                std::cerr << "rank " << env.rank << ": a write did not change its own batch\n";
                return 1;
            }
            barrier(group);
            // Storages stay resizable: growing one moves it to CPU-allocator memory.
            at::Tensor ids = batch[0].seq_ctx.input_ids;
            const auto before = ids.clone();
            ids.resize_({ids.numel() * 2});
            if (!ids.narrow(0, 0, before.numel()).equal(before.view({-1}))) {
                std::cerr << "rank " << env.rank << ": resizing lost the storage's bytes\n";
                return 1;
            }
        }
        std::cout << "rank " << env.rank << " step " << step << " ok " << path << "\n";
    }
    barrier(group);
    const auto fds = count_fds();
    const auto stats = spbcast::shared_memory_statistics();
    std::cout << "rank " << env.rank << " fds " << fds.total << " memfds " << fds.memfds << " sockets "
              << fds.sockets << " reused " << stats.segments_reused << " created " << stats.segments_created
              << "\n";
    // A follower holds no segment descriptor between batches (its mappings need none); a host
    // leader keeps its pool's, as the root does.
    const auto state = path_of(group, root);
    const bool leads_host = state && state->relays() && state->leader == env.rank;
    if (env.rank != root && !leads_host && fds.memfds != 0) {
        std::cerr << "rank " << env.rank << ": " << fds.memfds << " memfd descriptors left open\n";
        return 1;
    }
    return 0;
}

int leader_allocates(char** argv) {
    const auto profile = xtuner::profile_from_name(argv[2]);
    const int micro_batches = std::stoi(argv[3]), steps = std::stoi(argv[4]);
    auto [env, store, group] = spbcast_test::join_job(std::chrono::seconds(30));
    const spbcast::options opts{.timeout = std::chrono::seconds(30)};
    auto fail = [&](const std::string& what) {
        std::cerr << "rank " << env.rank << ": " << what << "\n";
        return 1;
    };
    xtuner::Batch kept;  // follower 2: the first batch, kept while its forked child drops its copy
    for (int step = 0; step < steps; ++step) {
        const auto before = spbcast::shared_memory_statistics();
        xtuner::Batch batch;
        if (env.rank == 0) {
            spbcast::shared_memory_scope in_shared_memory;
            batch = xtuner::make_batch(profile, micro_batches, step);
        }
        spbcast::broadcast(batch, group, opts);
        const auto want = spbcast::digest(xtuner::make_batch(profile, micro_batches, step));
        if (!chose_shared(group, 0)) return fail("the same-host path was not chosen");
        if (spbcast::digest(batch) != want) return fail("step " + std::to_string(step) + " differs from the root's batch");
        if (env.rank == 0) {
            const auto after = spbcast::shared_memory_statistics();
            const auto shared = after.tensors_shared - before.tensors_shared;
            std::cout << "rank 0 step " << step << " tensors allocated " << after.tensors_allocated - before.tensors_allocated
                      << " shared " << shared << "\n";
            if (shared == 0) return fail("no tensor of the batch was handed over without a copy");
        }
        if (step != 0) continue;
        // The root writes over its batch after the broadcast: its own tensors change, the
        // followers' do not.
        if (env.rank == 0)
            for (auto& t : tensors_of(batch)) t.fill_(9);
        barrier(group);
        if (env.rank == 0 && spbcast::digest(batch) == want) return fail("the root's write did not change its batch");
        if (env.rank != 0 && spbcast::digest(batch) != want) return fail("the root's later write showed in a follower's batch");
        // A follower's write stays its own.
        if (env.rank == 1)
            for (auto& t : tensors_of(batch)) t.fill_(5);
        barrier(group);
        if (env.rank == 2 && spbcast::digest(batch) != want) return fail("a follower's write showed in another follower's batch");
        // The root sends the batch it changed: a segment goes over once, so this is copied,
        // and the followers get the bytes the root holds now, not the segment's.
        xtuner::Batch again = env.rank == 0 ? batch : xtuner::Batch{};
        const auto root_digest = spbcast::digest(batch);
        std::uint64_t expected = root_digest;
        spbcast::broadcast(expected, group, {.timeout = std::chrono::seconds(30), .transport = spbcast::transport_mode::network});
        spbcast::broadcast(again, group, opts);
        if (spbcast::digest(again) != expected) return fail("a second broadcast of the root's changed batch arrived stale");
        if (env.rank == 2) {
            kept = batch;
            const pid_t child = ::fork();
            if (child == 0) {
                batch.clear();
                kept.clear();
                again.clear();
                spbcast::shared_memory_scope in_shared_memory;
                const at::Tensor t = at::empty({1 << 20}, at::kFloat);
                ::_exit(spbcast::detail::shared_allocation_of(t.storage()) == nullptr ? 0 : 1);
            }
            int status = 0;
            ::waitpid(child, &status, 0);
            if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return fail("a forked child allocated from the pool");
        }
    }
    // The root reused no segment this follower's kept batch lies in: its child let go of its
    // copy without telling the root.
    if (env.rank == 2 && spbcast::digest(kept) != spbcast::digest(xtuner::make_batch(profile, micro_batches, 0)))
        return fail("the kept first batch changed after a forked child dropped its copy");
    barrier(group);
    const auto fds = count_fds();
    std::cout << "rank " << env.rank << " ok, fds " << fds.total << " memfds " << fds.memfds << "\n";
    if (env.rank != 0 && fds.memfds != 0) return fail(std::to_string(fds.memfds) + " memfd descriptors left open");
    return 0;
}

// Moves this process into a new memory cgroup of `limit` bytes under its own (cgroup v1 or
// v2). Returns the cgroup's directory, or "" and the reason where it may not (not root, no
// memory controller). Memory charged before the move stays with the old cgroup.
std::string enter_memory_cgroup(std::uint64_t limit, std::string& why) {
    std::ifstream cgroups("/proc/self/cgroup");
    std::string v1, v2;
    for (std::string line; std::getline(cgroups, line);) {
        const auto first = line.find(':'), second = line.find(':', first + 1);
        const std::string controllers = line.substr(first + 1, second - first - 1), path = line.substr(second + 1);
        if (controllers == "memory") v1 = "/sys/fs/cgroup/memory" + path;
        if (line.rfind("0::", 0) == 0) v2 = "/sys/fs/cgroup" + path;
    }
    const bool is_v1 = !v1.empty();
    const std::string dir = (is_v1 ? v1 : v2) + "/spbcast-test-" + std::to_string(::getpid());
    auto write = [](const std::string& path, const std::string& text) {
        std::ofstream out(path);
        out << text;
        out.flush();
        return static_cast<bool>(out);
    };
    if (::mkdir(dir.c_str(), 0755) != 0) {
        why = "cannot create " + dir + ": " + std::strerror(errno);
        return {};
    }
    if (!write(dir + (is_v1 ? "/memory.limit_in_bytes" : "/memory.max"), std::to_string(limit)) ||
        !write(dir + "/cgroup.procs", std::to_string(::getpid()))) {
        why = "cannot limit or enter " + dir + " (no memory controller there)";
        ::rmdir(dir.c_str());
        return {};
    }
    return dir;
}

int cgroup_fallback(char** argv) {
    const auto profile = xtuner::profile_from_name(argv[2]);
    auto [env, store, group] = spbcast_test::join_job(std::chrono::seconds(30));
    const spbcast::options opts{.timeout = std::chrono::seconds(30)};
    std::vector<at::Tensor> nothing;
    spbcast::broadcast(nothing, group, opts);  // the handshake, outside the cgroup
    xtuner::Batch batch;
    std::string cgroup, why;
    if (env.rank == 0) {
        batch = xtuner::make_batch(profile, 1, 3);  // charged to the cgroup the root came from
        cgroup = enter_memory_cgroup(std::uint64_t{40} << 20, why);
    }
    std::int64_t entered = cgroup.empty() ? 0 : 1;
    spbcast::broadcast(entered, group, {.timeout = std::chrono::seconds(30), .transport = spbcast::transport_mode::network});
    if (!entered) {
        if (env.rank == 0) std::cout << "skipped: " << why << "\n";
        return 77;
    }
    const auto before = spbcast::shared_memory_statistics();
    spbcast::broadcast(batch, group, opts);
    if (env.rank == 0) {
        const auto fallbacks = spbcast::shared_memory_statistics().network_fallbacks - before.network_fallbacks;
        std::cout << "rank 0: " << fallbacks << " network fallback, in " << cgroup << "\n";
        // Back to the cgroup it came from, so the test's cgroup can go.
        std::ofstream(cgroup.substr(0, cgroup.find_last_of('/')) + "/cgroup.procs") << ::getpid() << std::flush;
        ::rmdir(cgroup.c_str());
        if (fallbacks != 1) return 1;
    }
    if (!chose_shared(group, 0)) return 1;
    if (spbcast::digest(batch) != spbcast::digest(xtuner::make_batch(profile, 1, 3))) {
        std::cerr << "rank " << env.rank << ": the batch differs from the root's\n";
        return 1;
    }
    return 0;
}

int root_dies(char** argv) {
    const auto profile = xtuner::profile_from_name(argv[2]);
    auto [env, store, group] = spbcast_test::join_job(std::chrono::seconds(30));
    const spbcast::options opts{.timeout = std::chrono::seconds(10), .transport = spbcast::transport_mode::shared_memory};
    xtuner::Batch batch;
    if (env.rank == 0) batch = xtuner::make_batch(profile, 1, 5);
    spbcast::broadcast(batch, group, opts);
    barrier(group);
    if (env.rank == 0) {
        spbcast_test::count_as_done(*store);
        ::_exit(0);  // no clean-up: the kernel closes everything
    }
    // The next broadcast fails: the root is gone.
    try {
        xtuner::Batch next;
        spbcast::broadcast(next, group, opts);
        std::cerr << "rank " << env.rank << ": a broadcast from a dead root succeeded\n";
        return 1;
    } catch (const spbcast::error& e) {
        std::cout << "rank " << env.rank << " raised after the root died: " << e.what() << "\n";
    }
    const auto want = spbcast::digest(xtuner::make_batch(profile, 1, 5));
    if (spbcast::digest(batch) != want) {
        std::cerr << "rank " << env.rank << ": the batch changed after the root died\n";
        return 1;
    }
    for (auto& t : tensors_of(batch)) t.add_(1);
    if (spbcast::digest(batch) == want) return 1;
    std::cout << "rank " << env.rank << " batch intact and writable after the root died\n";
    return 0;
}

int kill_loop(char** argv) {
    auto [env, store, group] = spbcast_test::join_job(std::chrono::seconds(30));
    const auto baseline = count_fds();
    std::mt19937_64 rng(std::stoull(argv[2]));
    // The test picks a victim and a moment; the victim SIGKILLs itself from a thread then,
    // wherever its main thread is (handshake, filling, mapping, a collective).
    const char* victim = std::getenv("SPBCAST_TEST_KILL_RANK");
    const char* after = std::getenv("SPBCAST_TEST_KILL_AFTER_MS");
    if (victim && after && std::atoi(victim) == env.rank)
        std::thread([ms = std::atoi(after)] {
            std::this_thread::sleep_for(std::chrono::milliseconds(ms));
            ::kill(::getpid(), SIGKILL);
        }).detach();
    const spbcast::options opts{.timeout = std::chrono::seconds(5)};
    std::vector<xtuner::Batch> kept;  // followers keep a few batches, as a training loop does
    const auto start = std::chrono::steady_clock::now();
    try {
        for (std::uint64_t step = 0;; ++step) {
            xtuner::Batch batch;
            const std::uint64_t seed = rng();
            if (env.rank == 0) {
                batch = xtuner::make_batch(seed % 3 == 0 ? xtuner::profile::interns1_tiles : xtuner::profile::text,
                                           1 + static_cast<int>(seed % 2), step);
            }
            spbcast::broadcast(batch, group, opts);
            kept.push_back(std::move(batch));
            if (kept.size() > 2) kept.erase(kept.begin());
            if (step == 0) std::cout << "rank " << env.rank << " running\n" << std::flush;
        }
    } catch (const spbcast::error& e) {
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        kept.clear();
        const auto fds = count_fds();
        std::cout << "rank " << env.rank << " raised " << spbcast::to_string(e.code()) << " after " << s
                  << " s; fds " << fds.total << " (baseline " << baseline.total << "), memfds " << fds.memfds
                  << ", sockets " << fds.sockets << " (baseline " << baseline.sockets << "), pool segments "
                  << spbcast::shared_memory_statistics().segments << " (held "
                  << spbcast::shared_memory_statistics().held_bytes << " B): " << e.what()
                  << "\n";
        if (fds.memfds != 0 || fds.sockets > baseline.sockets) {
            std::cerr << "rank " << env.rank << ": descriptors of ours left open\n";
            return 1;
        }
        return 3;
    }
}

// The root cannot create a segment (no descriptor left: memfd_create fails with EMFILE): that
// batch goes over the network, intact; the next one takes the same-host path again.
int fallback(char** argv) {
    const auto profile = xtuner::profile_from_name(argv[2]);
    auto [env, store, group] = spbcast_test::join_job(std::chrono::seconds(30));
    const spbcast::options opts{.timeout = std::chrono::seconds(30)};
    for (int step = 0; step < 3; ++step) {
        rlimit saved{};
        ::getrlimit(RLIMIT_NOFILE, &saved);
        if (env.rank == 0 && step == 1) {
            spbcast::release_shared_memory();
            rlimit tight = saved;
            tight.rlim_cur = 3;  // no new descriptor: 0, 1 and 2 are taken
            ::setrlimit(RLIMIT_NOFILE, &tight);
        }
        xtuner::Batch batch;
        if (env.rank == 0) batch = xtuner::make_batch(profile, 1 + step, step);
        const auto before = spbcast::shared_memory_statistics();
        spbcast::broadcast(batch, group, opts);
        const auto after = spbcast::shared_memory_statistics();
        ::setrlimit(RLIMIT_NOFILE, &saved);
        if (spbcast::digest(batch) != spbcast::digest(xtuner::make_batch(profile, 1 + step, step))) {
            std::cerr << "rank " << env.rank << ": step " << step << " differs from the root's batch\n";
            return 1;
        }
        if (env.rank == 0) {
            const bool fell_back = after.network_fallbacks == before.network_fallbacks + 1;
            std::cout << "rank 0 step " << step << (fell_back ? " network fallback" : " shared segment") << "\n";
            if (fell_back != (step == 1)) return 1;
        }
        barrier(group);
    }
    std::cout << "rank " << env.rank << " ok\n";
    return 0;
}

// Group memory while a batch is alive, as the issue measures it: the sum over ranks of the
// change in Pss_Anon (smaps_rollup), plus the change in the host's Shmem, from before the root
// builds its batch to when every rank holds it. Rank 0 prints it over the payload.
long pss_anon_kib() { return kib_of("/proc/self/smaps_rollup", "Pss_Anon:"); }

template <class G>
std::int64_t sum_over_ranks(G& group, std::int64_t mine) {
    std::int64_t total = 0;
    for (int r = 0; r < group->getSize(); ++r) {
        at::Tensor t = at::full({1}, mine, at::kLong);
        spbcast::broadcast(t, group, {.root = r, .timeout = std::chrono::seconds(30), .transport = spbcast::transport_mode::network});
        total += t.item<std::int64_t>();
    }
    return total;
}

int group_memory(char** argv) {
    const auto profile = xtuner::profile_from_name(argv[2]);
    const int micro_batches = std::stoi(argv[3]);
    const auto transport = mode_of(argv[4]);
    const bool leader_allocates = argv[5] && std::string(argv[5]) == "leader_allocates";
    const int root = argv[5] && argv[6] ? std::stoi(argv[6]) : 0;
    auto [env, store, group] = spbcast_test::join_job(std::chrono::seconds(30));
    const spbcast::options opts{.root = root, .timeout = std::chrono::seconds(60), .transport = transport};
    {   // the handshake, and the loader-side warm-up, outside the measurement
        std::vector<at::Tensor> nothing;
        spbcast::broadcast(nothing, group, opts);
    }
    barrier(group);
    const long shmem_before = kib_of("/proc/meminfo", "Shmem:");
    const long pss_before = pss_anon_kib();
    barrier(group);
    xtuner::Batch batch;
    std::uint64_t payload = 0;
    if (env.rank == root) {
        std::optional<spbcast::shared_memory_scope> in_shared_memory;
        if (leader_allocates) in_shared_memory.emplace();
        batch = xtuner::make_batch(profile, micro_batches, 1);
        in_shared_memory.reset();
        for (auto& t : tensors_of(batch)) payload += t.storage().nbytes();
    }
    spbcast::broadcast(batch, group, opts);
    const auto digest = spbcast::digest(batch);  // every rank reads its whole batch
    (void)digest;
    barrier(group);
    const long pss_after = pss_anon_kib();
    const long shmem_after = kib_of("/proc/meminfo", "Shmem:");
    const std::int64_t pss_sum = sum_over_ranks(group, pss_after - pss_before);
    const std::int64_t payload_all = sum_over_ranks(group, static_cast<std::int64_t>(payload));
    if (env.rank == 0) {
        const double group_kib = static_cast<double>(pss_sum + (shmem_after - shmem_before));
        std::cout << "group memory " << argv[4] << (leader_allocates ? " leader_allocates" : "") << " world "
                  << env.world_size << ": sum Pss_Anon +"
                  << pss_sum / 1024 << " MiB, Shmem +" << (shmem_after - shmem_before) / 1024
                  << " MiB, payload " << payload_all / 1048576 << " MiB: "
                  << group_kib * 1024 / static_cast<double>(payload_all) << "x the payload\n";
    }
    barrier(group);
    return 0;
}

// Whether `fd` is an open descriptor of this process.
bool fd_open(int fd) { return fd >= 0 && ::fcntl(fd, F_GETFD) != -1; }

// A child of this process that waits for the parent's word, then checks `check` and exits
// with its verdict (0 ok). The parent gets the child's pid and the pipe to wake it.
template <class Check>
std::pair<pid_t, int> fork_waiting_child(Check check) {
    int go[2];
    if (::pipe(go) != 0) throw std::runtime_error("pipe failed");
    const pid_t child = ::fork();
    if (child == 0) {
        // libgomp is not fork-safe: a child of a process that ran OpenMP regions must not start
        // one (as DataLoader workers do, LibTorch 2.x then runs every op on this thread).
        at::set_num_threads(1);
        ::close(go[1]);
        char c;
        while (::read(go[0], &c, 1) < 0 && errno == EINTR) {
        }
        ::_exit(check());
    }
    ::close(go[0]);
    return {child, go[1]};
}

// Wakes the child and waits for it (at most 30 s): its exit code, or -1.
int wake_and_wait(std::pair<pid_t, int> child) {
    if (::write(child.second, "g", 1) != 1) return -1;
    ::close(child.second);
    for (int i = 0; i < 300; ++i) {
        int status = 0;
        if (::waitpid(child.first, &status, WNOHANG) == child.first)
            return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    ::kill(child.first, SIGKILL);
    ::waitpid(child.first, nullptr, 0);
    return -1;
}

// Rank 1 keeps batches and drops them in bursts, and now and then forks a child that keeps what
// it holds while three more batches go by: the child's copy must not change.
int soak(char** argv) {
    const int rounds = std::stoi(argv[2]);
    auto [env, store, group] = spbcast_test::join_job(std::chrono::seconds(30));
    std::mt19937_64 rng(42);
    fd_census fds_at_warm{};
    long rss_at_warm = 0;
    const int warm = std::min(rounds / 10, 1000);
    at::Tensor big = at::arange(std::int64_t{3} << 17, at::kLong);  // 3 MiB: in place
    std::vector<std::vector<at::Tensor>> kept;
    std::pair<pid_t, int> child{-1, -1};
    int child_round = -1, children = 0;
    for (int round = 0; round < rounds; ++round) {
        const std::uint64_t r = rng();
        std::vector<at::Tensor> batch;
        if (env.rank == 0) {
            batch.push_back(at::full({static_cast<std::int64_t>(r % 4096) + 1}, static_cast<std::int64_t>(round), at::kLong));
            if (r % 4 == 0) batch.push_back(big.narrow(0, 0, static_cast<std::int64_t>((r >> 20) % (big.numel() - 1)) + 1));
            if (r % 4 == 1) {  // a tensor the root allocated in shared memory: its segment goes over
                spbcast::shared_memory_scope in_shared_memory;
                batch.push_back(big.narrow(0, 0, static_cast<std::int64_t>((r >> 20) % (big.numel() - (1 << 17))) + (1 << 17)).clone());
            }
            if (r % 8 == 2) batch.push_back(at::full({(32 << 10) + static_cast<std::int64_t>(r % 1000)}, round, at::kInt));
        }
        spbcast::broadcast(batch, group, {.timeout = std::chrono::seconds(30)});
        if (batch.empty() || batch[0].numel() != static_cast<std::int64_t>(r % 4096) + 1 ||
            batch[0][0].item<std::int64_t>() != round) {
            std::cerr << "rank " << env.rank << ": round " << round << " arrived wrong\n";
            return 1;
        }
        if (batch.size() == 2 && batch[1].scalar_type() == at::kLong && !batch[1].equal(big.narrow(0, 0, batch[1].numel()))) {
            std::cerr << "rank " << env.rank << ": round " << round << " arrived wrong\n";
            return 1;
        }
        if (env.rank == 1) {
            kept.push_back(batch);
            if (kept.size() >= 1 + (r >> 40) % 300) kept.clear();  // a burst of releases
            if (round % 997 == std::min(500, rounds / 2) && child.first < 0) {  // at least one per run
                std::vector<std::uint64_t> digests;
                for (const auto& b : kept) digests.push_back(spbcast::digest(b));
                child = fork_waiting_child([&kept, digests] {
                    for (std::size_t i = 0; i < kept.size(); ++i)
                        if (spbcast::digest(kept[i]) != digests[i]) return 1;
                    return 0;
                });
                child_round = round;
                kept.clear();  // the parent lets go; the child keeps them
            }
            if (child.first >= 0 && round == child_round + 3) {
                if (wake_and_wait(child) != 0) {
                    std::cerr << "rank 1: a forked child's kept batches changed (forked at round " << child_round << ")\n";
                    return 1;
                }
                child = {-1, -1};
                ++children;
            }
        }
        if (round == warm) {
            kept.clear();
            fds_at_warm = count_fds();
            rss_at_warm = kib_of("/proc/self/status", "RssAnon:");
        }
    }
    if (child.first >= 0 && wake_and_wait(child) != 0) return 1;
    kept.clear();
    barrier(group);
    barrier(group);  // the root has read every answer by now
    const auto fds = count_fds();
    const long rss = kib_of("/proc/self/status", "RssAnon:");  // free segments the root keeps are checked above
    const auto stats = spbcast::shared_memory_statistics();
    std::cout << "rank " << env.rank << " shared " << chose_shared(group, 0) << " fds " << fds_at_warm.total
              << " -> " << fds.total << " (memfds " << fds_at_warm.memfds << " -> " << fds.memfds << "), anonymous rss "
              << rss_at_warm << " -> " << rss << " KiB, pool cached "
              << stats.cached_bytes << " held " << stats.held_bytes << " reused " << stats.segments_reused
              << " created " << stats.segments_created << " forgotten " << stats.segments_forgotten
              << " segments " << stats.segments << (env.rank == 1 ? ", forked children " + std::to_string(children) : "")
              << "\n";
    if (!chose_shared(group, 0)) return 1;
    // Followers hold no segment between batches. The root's other descriptors stay as they
    // were; its segments are only the free ones its pool keeps (every answer has been read).
    if (env.rank != 0 && fds.total != fds_at_warm.total) return 1;
    const auto limits = spbcast::shared_memory_limits_in_use();
    if (env.rank == 0 && (fds.total - fds.memfds > fds_at_warm.total - fds_at_warm.memfds ||
                          stats.held_bytes != 0 || fds.memfds > static_cast<int>(limits.free_segments) + 1 ||
                          stats.cached_bytes > (64u << 20)))
        return 1;
#if !defined(__SANITIZE_ADDRESS__)
    // Not under AddressSanitizer: its quarantine keeps freed memory resident by design
    // (LeakSanitizer checks for leaks at exit instead; descriptors are still checked above).
    if (rss - rss_at_warm > 16 * 1024) return 1;
#endif
    return 0;
}

int fork_child(char** argv) {
    const bool on_root = std::string(argv[2]) == "root";
    auto [env, store, group] = spbcast_test::join_job(std::chrono::seconds(30));
    const spbcast::options opts{.timeout = std::chrono::seconds(30)};
    const int forker = on_root ? 0 : 1;
    auto fail = [&](const std::string& what) {
        std::cerr << "rank " << env.rank << ": " << what << "\n";
        return 1;
    };
    const auto profile = xtuner::profile::qwen3_vl_image;
    auto make = [&](int step) {
        std::optional<spbcast::shared_memory_scope> in_shared_memory;
        if (on_root) in_shared_memory.emplace();
        return xtuner::make_batch(profile, 1, static_cast<std::uint64_t>(step));
    };
    xtuner::Batch batch;
    if (env.rank == 0) batch = make(0);
    spbcast::broadcast(batch, group, opts);
    if (!chose_shared(group, 0)) return fail("the same-host path was not chosen");
    const auto want = spbcast::digest(xtuner::make_batch(profile, 1, 0));
    std::pair<pid_t, int> child{-1, -1};
    if (env.rank == forker) {
        const auto state = spbcast::detail::same_host_registry::instance().find(&spbcast::detail::group_of(group), 0);
        const int link_fd = on_root ? state->links.at(0).sock.get() : state->link->socket();
        child = fork_waiting_child([&, link_fd] {
            // Our descriptors were closed as the child started: no memfd, no same-host socket.
            if (count_fds().memfds != 0 || fd_open(link_fd)) return 2;
            return spbcast::digest(batch) == want ? 0 : 3;
        });
    }
    batch.clear();  // every rank lets go; the forker's child keeps its copy
    for (int step = 1; step <= 3; ++step) {  // batches of the same size: each could reuse the segment
        xtuner::Batch next;
        if (env.rank == 0) next = make(step);
        spbcast::broadcast(next, group, opts);
        if (spbcast::digest(next) != spbcast::digest(xtuner::make_batch(profile, 1, static_cast<std::uint64_t>(step))))
            return fail("step " + std::to_string(step) + " differs from the root's batch");
    }
    barrier(group);
    if (env.rank == forker) {
        const int verdict = wake_and_wait(child);
        if (verdict == 2) return fail("the forked child inherited a memfd or the same-host socket open");
        if (verdict != 0) return fail("the forked child's batch changed after the parent let go (exit " + std::to_string(verdict) + ")");
        std::cout << "rank " << env.rank << ": the child's batch is intact after 3 more broadcasts\n";
    }
    if (env.rank == 0)
        std::cout << "rank 0 forgotten " << spbcast::shared_memory_statistics().segments_forgotten << "\n";
    barrier(group);
    return 0;
}

int burst(char** argv) {
    const int kept_count = std::stoi(argv[2]);
    auto [env, store, group] = spbcast_test::join_job(std::chrono::seconds(60));
    const spbcast::options opts{.timeout = std::chrono::seconds(30)};
    auto fail = [&](const std::string& what) {
        std::cerr << "rank " << env.rank << ": " << what << "\n";
        return 1;
    };
    auto make = [](int step) { return std::vector<at::Tensor>{at::full({64 << 10}, step, at::kInt)}; };  // 256 KiB
    std::vector<std::vector<at::Tensor>> kept;
    std::size_t most_segments = 0;
    int most_memfds = 0;
    for (int step = 0; step < kept_count; ++step) {
        std::vector<at::Tensor> batch = env.rank == 0 ? make(step) : std::vector<at::Tensor>{};
        spbcast::broadcast(batch, group, opts);
        if (batch.size() != 1 || !batch[0].equal(make(step)[0])) return fail("step " + std::to_string(step) + " arrived wrong");
        if (env.rank == 1) kept.push_back(std::move(batch));
        if (env.rank == 0) {
            most_segments = std::max(most_segments, spbcast::shared_memory_statistics().segments);
            most_memfds = std::max(most_memfds, count_fds().memfds);
        }
    }
    if (!chose_shared(group, 0)) return fail("the same-host path was not chosen");
    const auto limits = spbcast::shared_memory_limits_in_use();
    if (env.rank == 0) {
        std::cout << "rank 0: at most " << most_segments << " segments tracked, " << most_memfds << " memfds, bound "
                  << limits.segments << "\n";
        if (most_segments > limits.segments || most_memfds > static_cast<int>(limits.segments) + 2)
            return fail("the root tracked more segments than its bound");
    }
    // All at once, while the root waits in a collective of its own.
    const auto start = std::chrono::steady_clock::now();
    kept.clear();
    const double drop_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    barrier(group);
    if (env.rank == 1) {
        std::cout << "rank 1 dropped " << kept_count << " batches in " << drop_s << " s\n";
        if (drop_s > 5) return fail("dropping kept batches took too long");
    }
    for (int step = 0; step < 4; ++step) {  // the answers are read at every broadcast
        std::vector<at::Tensor> batch = env.rank == 0 ? make(step) : std::vector<at::Tensor>{};
        spbcast::broadcast(batch, group, opts);
        if (!batch[0].equal(make(step)[0])) return fail("a batch after the burst arrived wrong");
        barrier(group);
    }
    if (env.rank == 0) {
        const auto stats = spbcast::shared_memory_statistics();
        std::cout << "rank 0 after the burst: held " << stats.held_bytes << " segments " << stats.segments << "\n";
        if (stats.held_bytes > (std::size_t{4} << 20)) return fail("the root still holds the released segments");
    }
    return 0;
}

int fd_limit(char**) {
    auto [env, store, group] = spbcast_test::join_job(std::chrono::seconds(30));
    const spbcast::options opts{.timeout = std::chrono::seconds(30)};
    auto fail = [&](const std::string& what) {
        std::cerr << "rank " << env.rank << ": " << what << "\n";
        return 1;
    };
    auto make = [](int step) { return std::vector<at::Tensor>{at::full({1 << 20}, step, at::kInt)}; };  // 4 MiB
    std::vector<at::Tensor> first = env.rank == 0 ? make(0) : std::vector<at::Tensor>{};
    spbcast::broadcast(first, group, opts);
    if (!chose_shared(group, 0)) return fail("the same-host path was not chosen");
    barrier(group);
    rlimit saved{};
    ::getrlimit(RLIMIT_NOFILE, &saved);
    std::size_t held_at_start = 0;
    int memfds_at_start = 0;
    for (int step = 1; step <= 20; ++step) {
        if (env.rank == 1) {  // no room for one more descriptor
            rlimit tight = saved;
            tight.rlim_cur = static_cast<rlim_t>(count_fds().total);
            ::setrlimit(RLIMIT_NOFILE, &tight);
        }
        std::vector<at::Tensor> batch = env.rank == 0 ? make(step) : std::vector<at::Tensor>{};
        try {
            spbcast::broadcast(batch, group, opts);
            if (env.rank == 1) return fail("a batch arrived with no descriptor to spare");
        } catch (const spbcast::error& e) {
            if (env.rank != 1 || e.code() != spbcast::errc::limit_exceeded ||
                std::string(e.what()).find("RLIMIT_NOFILE") == std::string::npos)
                throw;
            if (step == 1) std::cout << "rank 1 raised: " << e.what() << "\n";
        }
        if (env.rank == 1) ::setrlimit(RLIMIT_NOFILE, &saved);
        if (env.rank == 2 && !batch.at(0).equal(make(step)[0])) return fail("step " + std::to_string(step) + " arrived wrong");
        barrier(group);
        if (env.rank == 0 && step == 3) {
            held_at_start = spbcast::shared_memory_statistics().held_bytes;
            memfds_at_start = count_fds().memfds;
        }
    }
    std::vector<at::Tensor> batch = env.rank == 0 ? make(99) : std::vector<at::Tensor>{};
    spbcast::broadcast(batch, group, opts);
    if (!batch.at(0).equal(make(99)[0])) return fail("the batch after the limit was lifted arrived wrong");
    if (env.rank == 0) {
        const auto held = spbcast::shared_memory_statistics().held_bytes;
        const int memfds = count_fds().memfds;
        std::cout << "rank 0: held " << held_at_start << " -> " << held << " bytes, memfds " << memfds_at_start << " -> "
                  << memfds << "\n";
        if (held > held_at_start + (std::size_t{8} << 20) || memfds > memfds_at_start + 2)
            return fail("the root's held memory or descriptors grew while a follower was at its limit");
    }
    barrier(group);
    return 0;
}

int disagree(char**) {
    auto [env, store, group] = spbcast_test::join_job(std::chrono::seconds(30));
    auto fail = [&](const std::string& what) {
        std::cerr << "rank " << env.rank << ": " << what << "\n";
        return 1;
    };
    const auto mine = env.rank == 2 ? spbcast::transport_mode::network : spbcast::transport_mode::automatic;
    const auto start = std::chrono::steady_clock::now();
    std::vector<at::Tensor> batch = env.rank == 0 ? std::vector<at::Tensor>{at::ones({1 << 20})} : std::vector<at::Tensor>{};
    try {
        spbcast::broadcast(batch, group, {.timeout = std::chrono::seconds(20), .transport = mine});
        return fail("a disagreement on options.transport was not raised");
    } catch (const spbcast::error& e) {
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        std::cout << "rank " << env.rank << " raised after " << s << " s: " << e.what() << "\n";
        const std::string what = e.what();
        if (e.code() != spbcast::errc::invalid_argument || what.find("transport_mode::network on rank 2") == std::string::npos ||
            what.find("transport_mode::automatic on the root") == std::string::npos)
            return fail("not the disagreement's message");
        if (s > 3) return fail("the disagreement took too long to raise");
    }
    // The group stays usable: with the same options, the next broadcast takes the same-host path.
    batch = env.rank == 0 ? std::vector<at::Tensor>{at::ones({1 << 20})} : std::vector<at::Tensor>{};
    spbcast::broadcast(batch, group, {.timeout = std::chrono::seconds(20)});
    if (!batch.at(0).equal(at::ones({1 << 20}))) return fail("the batch after the disagreement arrived wrong");
    if (!chose_shared(group, 0)) return fail("the same-host path was not chosen after the disagreement");
    // Later, a follower that changes its transport alone is refused on that rank, its batch
    // drained; the stream stays in step.
    batch = env.rank == 0 ? std::vector<at::Tensor>{at::full({1 << 20}, 2.0)} : std::vector<at::Tensor>{};
    try {
        spbcast::broadcast(batch, group, {.timeout = std::chrono::seconds(20), .transport = mine});
        if (env.rank == 2) return fail("a later disagreement was not raised");
    } catch (const spbcast::error& e) {
        if (env.rank != 2 || e.code() != spbcast::errc::invalid_argument) throw;
    }
    batch = env.rank == 0 ? std::vector<at::Tensor>{at::full({1 << 20}, 3.0)} : std::vector<at::Tensor>{};
    spbcast::broadcast(batch, group, {.timeout = std::chrono::seconds(20)});
    if (!batch.at(0).equal(at::full({1 << 20}, 3.0))) return fail("the batch after the later disagreement arrived wrong");
    if (!chose_shared(group, 0)) return fail("the same-host path ended after a skipped message");
    std::cout << "rank " << env.rank << " ok\n";
    return 0;
}

int lost_link(char**) {
    auto [env, store, group] = spbcast_test::join_job(std::chrono::seconds(30));
    const spbcast::options opts{.timeout = std::chrono::seconds(20)};
    auto fail = [&](const std::string& what) {
        std::cerr << "rank " << env.rank << ": " << what << "\n";
        return 1;
    };
    auto make = [](int step) { return std::vector<at::Tensor>{at::full({1 << 20}, step, at::kInt)}; };
    for (int step = 0; step < 6; ++step) {
        if (step == 3 && env.rank == 2) {  // this rank's link goes (as if its socket broke)
            auto state = spbcast::detail::same_host_registry::instance().find(&spbcast::detail::group_of(group), 0);
            state->link->close();
        }
        if (step == 3) barrier(group);
        std::vector<at::Tensor> batch = env.rank == 0 ? make(step) : std::vector<at::Tensor>{};
        spbcast::broadcast(batch, group, opts);
        if (!batch.at(0).equal(make(step)[0])) return fail("step " + std::to_string(step) + " arrived wrong");
        const bool shared = chose_shared(group, 0);
        if (shared != (step < 3)) return fail("step " + std::to_string(step) + (shared ? " still shared" : " not shared"));
    }
    std::cout << "rank " << env.rank << " ok: the lost link moved every rank to the network\n";
    return 0;
}

// This namespace's bytes sent over its link (the interface Gloo uses), on the rank that counts
// for its namespace; 0 elsewhere.
std::int64_t link_bytes_sent() {
    const char* counts = std::getenv("HOST_COUNTER");
    const char* dev = std::getenv("GLOO_SOCKET_IFNAME");
    if (!counts || std::string(counts) != "1" || !dev) return 0;
    std::ifstream in(std::string("/sys/class/net/") + dev + "/statistics/tx_bytes");
    std::int64_t bytes = 0;
    in >> bytes;
    return bytes;
}

int hosts_bench(char** argv) {
    const auto profile = xtuner::profile_from_name(argv[2]);
    const int micro_batches = std::stoi(argv[3]), root = std::stoi(argv[4]), repeats = std::stoi(argv[5]);
    const std::size_t chunk = argv[6] ? std::stoull(argv[6]) : spbcast::options{}.relay_chunk_bytes;
    auto [env, store, group] = spbcast_test::join_job(std::chrono::seconds(60));
    const auto payload_of = [](xtuner::Batch& b) {
        std::int64_t bytes = 0;
        for (auto& t : tensors_of(b)) bytes += static_cast<std::int64_t>(t.storage().nbytes());
        return bytes;
    };
    xtuner::Batch probe = env.rank == root ? xtuner::make_batch(profile, micro_batches, 1) : xtuner::Batch{};
    spbcast::options opts{.root = root, .timeout = std::chrono::seconds(120), .transport = spbcast::transport_mode::network,
                          .relay_chunk_bytes = chunk};
    spbcast::broadcast(probe, group, opts);
    const std::int64_t payload = payload_of(probe);
    const auto want = spbcast::digest(probe);
    probe = {};
    struct method {
        const char* name;
        spbcast::transport_mode transport;
        bool raw, leader_allocates;
    };
    const method methods[] = {{"raw gloo broadcast", spbcast::transport_mode::network, true, false},
                              {"spbcast network path", spbcast::transport_mode::network, false, false},
                              {"spbcast automatic", spbcast::transport_mode::automatic, false, false},
                              {"spbcast automatic, leader allocates", spbcast::transport_mode::automatic, false, true}};
    double raw_ms = 0;
    for (const method& m : methods) {
        opts.transport = m.transport;
        // One batch of the method (the root builds it first, outside any time): its time on
        // rank 0 up to a barrier after it, and the bytes this namespace sent meanwhile.
        auto one_batch = [&](double& ms, std::int64_t& sent) {
            xtuner::Batch batch;
            if (env.rank == root) {
                std::optional<spbcast::shared_memory_scope> in_shared_memory;
                if (m.leader_allocates) in_shared_memory.emplace();
                batch = xtuner::make_batch(profile, micro_batches, 1);
            }
            barrier(group);
            const std::int64_t sent_before = link_bytes_sent();
            const auto start = std::chrono::steady_clock::now();
            if (m.raw) {
                std::vector<at::Tensor> tensors{at::empty({payload}, at::kByte)};
                c10d::BroadcastOptions bo;
                bo.rootRank = root;
                group->broadcast(tensors, bo)->wait();
            } else {
                spbcast::broadcast(batch, group, opts);
            }
            barrier(group);
            ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
            sent = link_bytes_sent() - sent_before;
            if (!m.raw && spbcast::digest(batch) != want) throw std::runtime_error("a batch differs from the root's");
        };
        double ms = 0;
        std::int64_t sent = 0;
        one_batch(ms, sent);  // the handshake and warm caches, outside the measurement
        std::vector<double> times;
        std::int64_t link = 0;
        for (int i = 0; i < repeats; ++i) {
            one_batch(ms, sent);
            times.push_back(ms);
            link += sum_over_ranks(group, sent);
        }
        std::sort(times.begin(), times.end());
        const double median = times[times.size() / 2];
        if (m.raw) raw_ms = median;
        if (env.rank == 0)
            std::cout << "hosts_bench | " << m.name << " | " << median << " ms | " << median / raw_ms << "x raw | link "
                      << static_cast<double>(link) / repeats / static_cast<double>(payload) << "x payload | payload "
                      << payload / 1048576.0 << " MiB\n";
    }
    barrier(group);
    return 0;
}

// Hosts on slow links (shm_netns_test.sh: 3 namespaces x 2 ranks on a bridge at 200 Mbit/s):
// twelve 8 MiB tensors, about 4 s per relay, broadcast twice in a row with options.timeout = 1 s
// (each wait's bound, with the backend's grace, is 3 s): they arrive intact on the hierarchical
// path, since every wait covers one chunk - on the root's host too, where a follower holds the
// batch before the relay and its next broadcast must not wait for the whole relay. Then a 2 MiB
// view of a 48 MiB storage the root allocated in shared memory sends only the view's bytes over
// each namespace's link (HOST_COUNTER=1 on one rank per namespace), at most 1.05x.
int slow_links(char** argv) {
    const std::size_t chunk = std::stoull(argv[2]);
    auto [env, store, group] = spbcast_test::join_job(std::chrono::seconds(60));
    const spbcast::options opts{.timeout = std::chrono::seconds(1), .relay_chunk_bytes = chunk};
    std::vector<at::Tensor> batch;
    if (env.rank == 0)
        for (int i = 0; i < 12; ++i) batch.push_back(at::randint(0, 1 << 30, {std::int64_t{1} << 21}, at::kInt));
    const auto start = std::chrono::steady_clock::now();
    spbcast::broadcast(batch, group, opts);
    std::vector<at::Tensor> again = env.rank == 0 ? batch : std::vector<at::Tensor>{};
    spbcast::broadcast(again, group, opts);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    auto digest_all = [&](std::uint64_t mine) {
        at::Tensor t = at::full({1}, static_cast<std::int64_t>(mine), at::kLong);
        spbcast::broadcast(t, group, {.timeout = std::chrono::seconds(30), .transport = spbcast::transport_mode::network});
        return static_cast<std::uint64_t>(t.item<std::int64_t>());
    };
    if (digest_all(spbcast::digest(batch)) != spbcast::digest(batch) || digest_all(spbcast::digest(again)) != spbcast::digest(batch))
        throw std::runtime_error("a batch differs from the root's");
    auto state = path_of(group, 0);
    if (!state || !state->relays()) throw std::runtime_error("the hierarchical path was not taken");
    std::cout << "rank " << env.rank << ": 96 MiB twice over slow links in " << s << " s with timeout 1 s\n" << std::flush;
    batch.clear();
    again.clear();
    barrier(group);

    constexpr std::int64_t view_bytes = std::int64_t{2} << 20;
    at::Tensor view;
    if (env.rank == 0) {
        spbcast::shared_memory_scope in_shared_memory;
        at::Tensor storage = at::randint(0, 255, {std::int64_t{48} << 20}, at::kByte);
        view = storage.narrow(0, std::int64_t{20} << 20, view_bytes);
    }
    // Every (group, root) the checks below broadcast from has made its handshake (watch-only on
    // the network path) before the count, so the two checks send the same bytes.
    sum_over_ranks(group, 0);
    barrier(group);
    const std::int64_t before = link_bytes_sent();
    spbcast::broadcast(view, group, opts);
    // Counted once every rank holds the view (each has broadcast since: until then bytes may
    // wait in the link's queue), less what that check itself sends.
    auto check_all = [&] {
        if (digest_all(spbcast::digest(view)) != spbcast::digest(view)) throw std::runtime_error("the view differs from the root's");
        sum_over_ranks(group, 0);
    };
    check_all();
    const std::int64_t after_view = link_bytes_sent();
    check_all();
    const std::int64_t sent = 2 * after_view - before - link_bytes_sent();
    if (std::getenv("HOST_COUNTER") && std::string(std::getenv("HOST_COUNTER")) == "1") {
        const double ratio = static_cast<double>(sent) / static_cast<double>(view_bytes);
        std::cout << "rank " << env.rank << ": a 2 MiB view of a 48 MiB shared storage sent " << ratio
                  << "x the view over this namespace's link\n";
        if (ratio > 1.05) throw std::runtime_error("more than the view's bytes crossed the link");
    }
    barrier(group);
    return 0;
}

// The launcher stops its ranks at this deadline (report.py waits a minute longer).
int budget(char** argv) {
    const std::string mode = argv[2];
    const int steps = std::stoi(argv[3]);
    auto [env, store, group] = spbcast_test::join_job(std::chrono::seconds(30));
    const spbcast::options opts{.timeout = std::chrono::seconds(30)};
    auto fail = [&](const std::string& what) {
        std::cerr << "rank " << env.rank << ": " << what << "\n";
        return 1;
    };
    constexpr std::size_t base = std::size_t{1} << 20, batch_bytes = std::size_t{4} << 20;
    if (mode == "fixed")
        spbcast::set_shared_memory_limit(base);
    else
        spbcast::set_shared_memory_limits({.free_bytes = base, .free_segments = 16, .segments = 256, .free_batches = 2});
    // 4 MiB: copied into the batch's segment (not in the frame, not a segment of its own).
    auto make = [](int step) { return std::vector<at::Tensor>{at::full({1 << 20}, step, at::kInt)}; };
    static_assert(batch_bytes == (std::size_t{1} << 20) * sizeof(std::int32_t));
    std::vector<at::Tensor> kept;  // keeps_one: the batch in use while the next arrives
    std::size_t most_segments = 0;
    for (int step = 0; step < steps; ++step) {
        if (mode == "keeps_one") {
            // The loop keeps batch t (`kept`) while t + 1 arrives, then lets it go; the root is
            // fast, the followers take their time before the next broadcast (a training step).
            std::vector<at::Tensor> batch = env.rank == 0 ? make(step) : std::vector<at::Tensor>{};
            spbcast::broadcast(batch, group, opts);
            if (batch.size() != 1 || !batch[0].equal(make(step)[0])) return fail("step " + std::to_string(step) + " arrived wrong");
            kept = std::move(batch);  // batch t - 1 goes here
            if (env.rank != 0) std::this_thread::sleep_for(std::chrono::milliseconds(150));
        } else {
            std::vector<at::Tensor> batch = env.rank == 0 ? make(step) : std::vector<at::Tensor>{};
            spbcast::broadcast(batch, group, opts);
            if (batch.size() != 1 || !batch[0].equal(make(step)[0])) return fail("step " + std::to_string(step) + " arrived wrong");
        }  // a follower lets its batch go before the next one comes
        if (env.rank == 0) most_segments = std::max(most_segments, spbcast::shared_memory_statistics().segments);
    }
    if (!chose_shared(group, 0)) return fail("the same-host path was not chosen");
    kept.clear();
    barrier(group);
    if (env.rank != 0) return 0;
    const auto s = spbcast::shared_memory_statistics();
    std::cout << "rank 0 " << mode << ": created " << s.segments_created << " reused " << s.segments_reused
              << " limit " << s.limit_bytes << " largest batch " << s.largest_batch_bytes << " most segments "
              << most_segments << "\n";
    // The batch's segment: its bytes, placed page-wise and rounded to the pool's 64 KiB.
    if (s.largest_batch_bytes < batch_bytes || s.largest_batch_bytes > batch_bytes + (std::size_t{64} << 10))
        return fail("the largest batch is not the one sent");
    const auto n = static_cast<std::size_t>(steps);
    if (mode == "fixed") {
        if (s.limit_bytes != base) return fail("the bound set with set_shared_memory_limit moved");
        if (s.segments_created != n || s.segments_reused != 0) return fail("a segment beyond the user's bound was kept");
    } else if (mode == "follows") {
        if (s.limit_bytes != 2 * s.largest_batch_bytes) return fail("the bound does not follow the batch size");
        if (s.segments_created != 1 || s.segments_reused != n - 1) return fail("batches larger than the base were not reused");
    } else {
        if (s.segments_created != 2 || s.segments_reused != n - 2 || most_segments > 2)
            return fail("the root placed a batch before the segment let go of came back");
    }
    return 0;
}

int launch_ranks(int argc, char** argv) {
    const int world = std::stoi(argv[2]);
    const std::vector<std::string> args(argv + 3, argv + argc);
    const auto results = spbcast_test::run_processes(std::filesystem::canonical("/proc/self/exe"), world,
                                                     [&](int) { return args; }, std::chrono::minutes(10));
    std::cout << results.at(0).output;
    for (const auto& r : results)
        if (r.exit_code != 0) {
            std::cerr << spbcast_test::describe(results);
            return 1;
        }
    return 0;
}

}  // namespace

int run_mode(int argc, char** argv) {
    if (argc < 2) {
        std::cerr << "usage: see the top of tests/shm_worker.cpp\n";
        return 2;
    }
    const std::string mode = argv[1];
    try {
        if (mode == "check" && argc == 8) return check(argc, argv);
        if (mode == "root_dies") return root_dies(argv);
        if (mode == "kill_loop") return kill_loop(argv);
        if (mode == "soak") return soak(argv);
        if (mode == "fallback") return fallback(argv);
        if (mode == "cgroup_fallback") return cgroup_fallback(argv);
        if (mode == "group_memory") return group_memory(argv);
        if (mode == "hosts_bench" && (argc == 6 || argc == 7)) return hosts_bench(argv);
        if (mode == "slow_links" && argc == 3) return slow_links(argv);
        if (mode == "ranks" && argc >= 4) return launch_ranks(argc, argv);
        if (mode == "leader_allocates" && argc == 5) return leader_allocates(argv);
        if (mode == "fork_child" && argc == 3) return fork_child(argv);
        if (mode == "burst" && argc == 3) return burst(argv);
        if (mode == "fd_limit") return fd_limit(argv);
        if (mode == "disagree") return disagree(argv);
        if (mode == "lost_link") return lost_link(argv);
        if (mode == "budget" && argc == 4) return budget(argv);
        std::cerr << "unknown mode or arguments\n";
        return 2;
    } catch (const std::exception& e) {
        std::cerr << "shm worker failed: " << e.what() << "\n";
        return 1;
    }
}

int main(int argc, char** argv) { return spbcast_test::leave_job(run_mode(argc, argv)); }
