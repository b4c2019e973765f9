// Process-group helpers for SP training: read the standard launcher environment, build the
// store, and lay the ranks out as DP x SP Gloo groups (contiguous SP ranks, like a
// ("dp", "sp", "tp") device mesh with tp = 1). The same program runs under
// `torchrun --no-python` and under any launcher that sets the same variables.
#pragma once

#include "detail/base/version.hpp"
#include "error.hpp"
#include "group.hpp"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <signal.h>

#include <chrono>
#include <cstdlib>
#include <exception>
#include <optional>
#include <string>
#include <type_traits>

namespace spbcast::dist {

// MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK as torchrun sets them.
struct launch_env {
    std::string master_addr;
    int master_port = 0;
    int rank = 0;
    int world_size = 1;
    int local_rank = 0;

    static launch_env from_environment() {
        auto read = [](const char* name, const char* fallback) -> std::string {
            if (const char* v = std::getenv(name); v && *v) return v;
            if (fallback) return fallback;
            throw error(errc::invalid_argument,
                        std::string("spbcast: the launcher variable ") + name +
                            " is not set; run under torchrun --no-python, or set MASTER_ADDR, "
                            "MASTER_PORT, RANK and WORLD_SIZE yourself");
        };
        auto number = [&](const char* name, const char* fallback) {
            const std::string text = read(name, fallback);
            try {
                std::size_t used = 0;
                const int n = std::stoi(text, &used);
                if (used == text.size() && n >= 0) return n;
            } catch (const std::exception&) {
            }
            throw error(errc::invalid_argument, std::string("spbcast: ") + name + "='" + text +
                                                    "' is not a non-negative integer");
        };
        launch_env env;
        env.master_addr = read("MASTER_ADDR", nullptr);
        env.master_port = number("MASTER_PORT", nullptr);
        env.rank = number("RANK", nullptr);
        env.world_size = number("WORLD_SIZE", nullptr);
        env.local_rank = number("LOCAL_RANK", "0");
        if (env.world_size < 1 || env.rank >= env.world_size)
            throw error(errc::invalid_argument,
                        "spbcast: RANK=" + std::to_string(env.rank) + " is not below WORLD_SIZE=" +
                            std::to_string(env.world_size));
        return env;
    }
};

// The job-wide store: rank 0 serves it on MASTER_ADDR:MASTER_PORT, the others connect. Under
// torchrun (TORCHELASTIC_USE_AGENT_STORE=True) the agent already serves a store on that port,
// so every rank connects as a client, as PyTorch's env:// rendezvous does. That store speaks
// its PyTorch generation's protocol: use a torchrun of the LibTorch you built against.
inline c10::intrusive_ptr<c10d::Store> make_store(const launch_env& env,
                                                  std::chrono::milliseconds timeout) {
    const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
    const bool agent_store = agent && std::string(agent) == "True";
    c10d::TCPStoreOptions opts;
    opts.port = static_cast<std::uint16_t>(env.master_port);
    opts.isServer = env.rank == 0 && !agent_store;
    opts.numWorkers = static_cast<std::size_t>(env.world_size);
    opts.timeout = timeout;
    return c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
}

// The Gloo devices as PyTorch chooses them: one per interface in GLOO_SOCKET_IFNAME (a
// comma-separated list), else the address `hostname` resolves to when one is given, else the
// host's own name (ProcessGroupGloo::createDefaultDevice; loopback only where the name does
// not resolve to a usable address) - so ranks on several hosts reach each other out of the box.
// Gloo's TCP pairs write to their sockets without MSG_NOSIGNAL in some builds (Debian's), and a
// receiving rank writes too (it tells the sender it is ready), so a peer that dies can kill this
// process with SIGPIPE instead of failing the collective with an error every rank can read. A
// program that kept the default action gets SIGPIPE ignored, as every Python process has it; a
// handler of the program's own, or an explicit SIG_IGN, is left as it is.
inline void ignore_sigpipe_if_default() {
    struct sigaction current {};
    if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL &&
        !(current.sa_flags & SA_SIGINFO))
        ::signal(SIGPIPE, SIG_IGN);
}

inline c10::intrusive_ptr<c10d::ProcessGroupGloo> make_gloo_group(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout, const std::string& hostname = {}) {
    ignore_sigpipe_if_default();
    auto options = c10d::ProcessGroupGloo::Options::create(timeout);
    const char* ifnames = std::getenv("GLOO_SOCKET_IFNAME");
    if (ifnames && *ifnames) {
        std::string list = ifnames;
        for (std::size_t start = 0; start <= list.size();) {
            const std::size_t end = std::min(list.find(',', start), list.size());
            if (end > start)
                options->devices.push_back(
                    c10d::ProcessGroupGloo::createDeviceForInterface(list.substr(start, end - start)));
            start = end + 1;
        }
    } else if (!hostname.empty()) {
        options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(hostname));
    } else {
        options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    }
    return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
}

// The timeout a c10d group was built with (ProcessGroupGloo::Options::timeout; from Python,
// init_process_group's or new_group's `timeout`): how long the group's own collectives wait,
// so how long a rank of a job without spbcast would wait for a late peer. LibTorch keeps it in
// its backends' options, which are internals of c10d; this is the one place that reads them:
//   - a ProcessGroupGloo, in both generations: getOptions()->timeout;
//   - LibTorch 2.x: a c10d::Backend's getBackendOptions()->timeout, and for a c10d::ProcessGroup
//     that of its CPU backend (the one that carries spbcast's CPU tensors);
//   - LibTorch 1.13: a c10d::ProcessGroup that is a ProcessGroupGloo (its base class keeps no
//     options).
// nullopt for anything else - a transport of your own, a backend that does not say (2.x's
// getBackendOptions throws there) - so the caller chooses its own fallback.
template <class Group>
    requires process_group_like<Group>
std::optional<std::chrono::milliseconds> group_timeout(Group& group) {
    auto& g = detail::group_of(group);
    using G = std::remove_cvref_t<decltype(g)>;
    std::optional<std::chrono::milliseconds> timeout;
    try {
        if constexpr (std::is_base_of_v<c10d::ProcessGroupGloo, G>) {
            timeout = const_cast<G&>(g).getOptions()->timeout;
#if SPBCAST_TORCH_AT_LEAST(2, 0)
        } else if constexpr (std::is_base_of_v<c10d::Backend, G>) {
            timeout = const_cast<G&>(g).getBackendOptions()->timeout;
        } else if constexpr (std::is_base_of_v<c10d::ProcessGroup, G>) {
            timeout = const_cast<G&>(g).getBackend(c10::DeviceType::CPU)->getBackendOptions()->timeout;
#else
        } else if constexpr (std::is_base_of_v<c10d::ProcessGroup, G>) {
            if (auto* gloo = dynamic_cast<c10d::ProcessGroupGloo*>(&const_cast<G&>(g)))
                timeout = gloo->getOptions()->timeout;
#endif
        }
    } catch (const std::exception&) {
        return std::nullopt;  // no backend for CPU tensors, or one that keeps its options to itself
    }
    if (timeout && timeout->count() <= 0) return std::nullopt;
    return timeout;
}

// This rank's place in a DP x SP layout and its two groups. SP groups are contiguous ranks:
// with world 4 and sp 2, SP groups {0,1} {2,3}, DP groups {0,2} {1,3}.
struct sp_layout {
    int world_size = 1, sp_size = 1, dp_size = 1;
    int rank = 0, sp_rank = 0, dp_rank = 0;
    c10::intrusive_ptr<c10d::ProcessGroupGloo> sp_group, dp_group;

    bool is_sp_leader() const { return sp_rank == 0; }
    int sp_leader_global_rank() const { return dp_rank * sp_size; }
};

inline sp_layout make_sp_layout(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                int world_size, int sp_size, std::chrono::milliseconds timeout,
                                const std::string& hostname = {}) {
    if (sp_size < 1 || world_size % sp_size != 0)
        throw error(errc::invalid_argument,
                    "spbcast: rank " + std::to_string(rank) + ": the SP size " +
                        std::to_string(sp_size) + " does not divide the world size " +
                        std::to_string(world_size) + "; choose sp_size | world_size");
    sp_layout layout;
    layout.world_size = world_size;
    layout.sp_size = sp_size;
    layout.dp_size = world_size / sp_size;
    layout.rank = rank;
    layout.sp_rank = rank % sp_size;
    layout.dp_rank = rank / sp_size;
    // Each group rendezvouses under its own key prefix, among its own members only.
    auto sp_store = c10::make_intrusive<c10d::PrefixStore>(
        "spbcast/sp/" + std::to_string(layout.dp_rank), store);
    layout.sp_group = make_gloo_group(sp_store, layout.sp_rank, sp_size, timeout, hostname);
    auto dp_store = c10::make_intrusive<c10d::PrefixStore>(
        "spbcast/dp/" + std::to_string(layout.sp_rank), store);
    layout.dp_group = make_gloo_group(dp_store, layout.dp_rank, layout.dp_size, timeout, hostname);
    return layout;
}

}  // namespace spbcast::dist
