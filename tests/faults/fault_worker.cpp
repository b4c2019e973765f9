// One rank of the fault tests that need real processes (a rank killed with SIGKILL, a rank
// stuck) and of scripts/netns_test.sh (ranks in two network namespaces). Started with the
// launcher environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE); the Gloo device follows
// GLOO_SOCKET_IFNAME when set (spbcast::dist::make_gloo_group).
//
//   spbcast_fault_worker [key=value ...]
//     steps=5             broadcasts to run
//     root=0              the root rank
//     profile=text        batch profile (examples/common/profiles.hpp), micro=1 micro-batches
//     timeout_ms=3000     options.timeout
//     group_timeout_ms=60000  the Gloo group's own timeout (longer: options.timeout must win)
//     inplace_min=131072  options.inplace_min_bytes (small: several payload slots)
//     checksum=0          options.checksum
//     interval_ms=0       pause between steps (netns: time to cut the link mid-run)
//     transport=automatic options.transport: automatic|network|shared_memory (this worker's
//                         group wrapper is not a c10d group, so automatic means the network path;
//                         shared_memory makes the same-host handshake, which watches the peers
//                         on this host: peer_watch.hpp)
//     group=faulty        faulty: the broadcasts go through this worker's group wrapper, which
//                         injects the fault below at a message; c10d: to the c10d group itself
//                         (a tracked group: automatic and network make the handshake), the
//                         fault injected before the step's broadcast (fault_call is ignored)
//     fault_rank=-1 fault_step=0 fault_call=1 fault=kill|hang|stop
//                         rank fault_rank, in step fault_step (1-based), just before handing its
//                         fault_call-th message of that step to Gloo (1 = the frame; 2 = the
//                         first payload slot for a small frame), waits until its earlier
//                         messages of the step completed, then raises SIGKILL on itself (kill),
//                         stops calling spbcast for hang_ms and exits 5 (hang), or stops itself
//                         with SIGSTOP, a child of its own sending it SIGKILL hang_ms later (stop)
//     hang_ms=10000
//     fork_child=0        1: after step 1, fork a child that holds the rank's descriptors and
//                         lives on after it, as a DataLoader worker does (it checks every 5 s,
//                         as torch's worker watchdog, whether its parent is gone)
//     exit=now            now: leave with _Exit right after reporting a failure; clean: return
//                         from main, destroying the Gloo group and the store (how soon the
//                         survivor's process can end after its error)
//     leave=together      after the last step: together waits for every rank to be done
//                         (set_up.hpp, leave_together); at_once exits at once, with status 0
//     late_rank=-1 late_ms=0  rank late_rank waits late_ms before its last step's broadcast
//     reaped=0            1: the rank runs in a child of this process, reaped the moment it ends
//
//   spbcast_fault_worker serve_store=<port> [serve_ms=120000]
//                         serves the job's TCPStore on MASTER_ADDR:<port>, as torchrun's agent
//                         does for ranks started with TORCHELASTIC_USE_AGENT_STORE=True
//
//   spbcast_fault_worker replay=<file> type=tensors|ivalue|xtuner
//                         replays a recording (support/frames.hpp: save_messages) into a
//                         follower of that batch type, with no network, and prints
//                         "REPLAY ok", "REPLAY spbcast_error <errc>: <message>" (exit 3) or
//                         "REPLAY other_exception <message>" (exit 4); a crash is a signal.
//
// Output, one line each: "rank R step S ok digest D ms T" per verified step; on failure
// "SPBCAST_FAULT rank=R step=S type=T errc='E' phase='P' ms=T" then "SPBCAST_WHAT <message>" (new
// lines shown as " | ") and "SPBCAST_AT <steady clock ms>"; a fault injected here prints
// "rank R step S FAULT <fault> before message C at <steady clock ms>" (CLOCK_MONOTONIC, shared by
// the processes of a host), exit 3 (spbcast::error) or 4 (any other exception); 1 when a step
// arrived different from the root's batch; "rank R done rss_mib M" and exit 0 otherwise.
#include "support/frames.hpp"
#include "support/set_up.hpp"
#include "profiles.hpp"

#include <spbcast/spbcast.hpp>

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <thread>
#include <vector>

namespace {

long long steady_ms() {
    return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

struct settings {
    std::map<std::string, std::string> values;
    std::string get(const std::string& key, const std::string& fallback) const {
        auto it = values.find(key);
        return it == values.end() ? fallback : it->second;
    }
    long long num(const std::string& key, long long fallback) const {
        return std::stoll(get(key, std::to_string(fallback)));
    }
};

// Forwards to the real Gloo group; injects the configured fault.
class faulty_group {
public:
    faulty_group(c10d::ProcessGroupGloo& inner, bool armed, long long step, long long call,
                 std::string fault, long long hang_ms)
        : inner_(inner), armed_(armed), fault_step_(step), fault_call_(call),
          fault_(std::move(fault)), hang_ms_(hang_ms) {}

    int getRank() const { return inner_.getRank(); }
    int getSize() const { return inner_.getSize(); }

    void begin_step(long long step) {
        step_ = step;
        call_ = 0;
        earlier_.clear();
    }

    c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                             const c10d::BroadcastOptions& opts) {
        ++call_;
        if (armed_ && step_ == fault_step_ && call_ == fault_call_) {
            for (auto& w : earlier_) w->wait();  // what came before really left this rank
            inject();
        }
        auto work = inner_.broadcast(tensors, opts);
        earlier_.push_back(work);
        return work;
    }

    // group=c10d: the broadcast goes to the c10d group itself, and the fault comes before it.
    void before_broadcast() {
        if (armed_ && step_ == fault_step_) inject();
    }

private:
    [[noreturn]] void inject() {
        std::cout << "rank " << getRank() << " step " << step_ << " FAULT " << fault_ << " before message "
                  << call_ << " at " << steady_ms() << std::endl;
        if (fault_ == "kill") ::raise(SIGKILL);
        if (fault_ == "stop") {
            const pid_t self = ::getpid();
            if (::fork() == 0) {  // ends the stopped rank, as a user would
                std::this_thread::sleep_for(std::chrono::milliseconds(hang_ms_));
                ::kill(self, SIGKILL);
                std::_Exit(0);
            }
            ::raise(SIGSTOP);
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(hang_ms_));
        std::cout << "rank " << getRank() << " hang over, exiting" << std::endl;
        std::_Exit(5);
    }

    c10d::ProcessGroupGloo& inner_;
    bool armed_;
    long long fault_step_, fault_call_;
    std::string fault_;
    long long hang_ms_;
    long long step_ = 0, call_ = 0;
    std::vector<c10::intrusive_ptr<c10d::Work>> earlier_;
};

double rss_mib() {
    std::ifstream statm("/proc/self/statm");
    long long pages = 0, resident = 0;
    statm >> pages >> resident;
    return static_cast<double>(resident) * static_cast<double>(::sysconf(_SC_PAGESIZE)) / (1 << 20);
}

std::string one_line(std::string text) {
    for (std::size_t at = text.find('\n'); at != std::string::npos; at = text.find('\n', at))
        text.replace(at, 1, " | ");
    return text;
}

}  // namespace

int main(int argc, char** argv) {
    settings s;
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        const auto eq = arg.find('=');
        if (eq == std::string::npos) {
            std::cerr << "spbcast_fault_worker: expected key=value, got '" << arg << "'\n";
            return 2;
        }
        s.values[arg.substr(0, eq)] = arg.substr(eq + 1);
    }
    if (s.num("reaped", 0) != 0) {
        // The rank runs in a child that this process reaps the moment it ends, as mp.spawn's
        // parent does: no zombie is left to tell its peers how it ended.
        const pid_t rank_process = ::fork();
        if (rank_process > 0) {
            int status = 0;
            while (::waitpid(rank_process, &status, 0) < 0 && errno == EINTR) {
            }
            if (WIFSIGNALED(status)) {
                ::signal(WTERMSIG(status), SIG_DFL);
                ::raise(WTERMSIG(status));
            }
            return WEXITSTATUS(status);
        }
    }
    if (s.values.count("replay")) {
        const auto messages = spbcast_fault::load_messages(s.get("replay", ""));
        const std::string type = s.get("type", "tensors");
        spbcast_fault::replay_result r;
        if (type == "tensors") r = spbcast_fault::replay<std::vector<at::Tensor>>(messages);
        else if (type == "ivalue") r = spbcast_fault::replay<c10::IValue>(messages);
        else if (type == "xtuner") r = spbcast_fault::replay<xtuner::Batch>(messages);
        else {
            std::cerr << "unknown type '" << type << "'\n";
            return 2;
        }
        switch (r.what) {
            case spbcast_fault::outcome::ok: std::cout << "REPLAY ok" << std::endl; return 0;
            case spbcast_fault::outcome::spbcast_error:
                std::cout << "REPLAY spbcast_error " << spbcast::to_string(r.code) << ": " << one_line(r.message) << std::endl;
                return 3;
            case spbcast_fault::outcome::other_exception:
                std::cout << "REPLAY other_exception " << one_line(r.message) << std::endl;
                return 4;
        }
    }
    if (s.values.count("serve_store")) {
        // torchrun's agent: it serves the job's store, which then outlives any rank (the ranks
        // run with TORCHELASTIC_USE_AGENT_STORE=True), until this process is ended.
        c10d::TCPStoreOptions store_opts;
        store_opts.port = static_cast<std::uint16_t>(s.num("serve_store", 0));
        store_opts.isServer = true;
        store_opts.waitWorkers = false;
        const char* addr = std::getenv("MASTER_ADDR");
        c10d::TCPStore store(addr ? addr : "127.0.0.1", store_opts);
        std::cout << "store serving on port " << store_opts.port << std::endl;
        std::this_thread::sleep_for(std::chrono::milliseconds(s.num("serve_ms", 120000)));
        return 0;
    }
    const long long steps = s.num("steps", 5), root = s.num("root", 0);
    const auto profile = xtuner::profile_from_name(s.get("profile", "text"));
    const int micro = static_cast<int>(s.num("micro", 1));
    spbcast::options opts;
    opts.root = static_cast<int>(root);
    opts.timeout = std::chrono::milliseconds(s.num("timeout_ms", 3000));
    opts.inplace_min_bytes = static_cast<std::size_t>(s.num("inplace_min", 131072));
    opts.checksum = s.num("checksum", 0) != 0;
    const auto interval = std::chrono::milliseconds(s.num("interval_ms", 0));
    const auto group_timeout = std::chrono::milliseconds(s.num("group_timeout_ms", 60000));
    const std::string transport = s.get("transport", "automatic");
    if (transport == "network") opts.transport = spbcast::transport_mode::network;
    else if (transport == "shared_memory") opts.transport = spbcast::transport_mode::shared_memory;
    else if (transport != "automatic") {
        std::cerr << "spbcast_fault_worker: unknown transport '" << transport << "'\n";
        return 2;
    }
    const bool fork_child = s.num("fork_child", 0) != 0;
    const bool exit_clean = s.get("exit", "now") == "clean";
    const bool on_c10d_group = s.get("group", "faulty") == "c10d";
    const bool waits_for_peers = s.get("leave", "together") == "together";
    const long long late_rank = s.num("late_rank", -1);
    const auto late = std::chrono::milliseconds(s.num("late_ms", 0));

    int rank = -1;
    long long step = 0;
    auto ms_since = [](auto start) {
        return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start).count();
    };
    // Reports a failure and leaves at once - without destroying the Gloo group: after a
    // timeout its worker threads may still sit in the abandoned receive until the group's own
    // timeout (LibTorch 1.13's Gloo ignores the per-call timeout), and ~ProcessGroupGloo joins
    // them (see FAILURE_BEHAVIOUR.md).
    auto report = [&](const std::exception& e, long long ms) {
        std::string type = "other", errc, phase;
        if (auto* se = dynamic_cast<const spbcast::error*>(&e)) {
            type = "error";
            errc = spbcast::to_string(se->code());
        }
        if (dynamic_cast<const spbcast::remote_error*>(&e)) type = "remote_error";
        if (dynamic_cast<const spbcast::schema_error*>(&e)) type = "schema_error";
        if (auto* t = dynamic_cast<const spbcast::transport_error*>(&e)) {
            type = "transport_error";
            phase = t->phase();
        }
        std::cout << "SPBCAST_FAULT rank=" << rank << " step=" << step << " type=" << type
                  << " errc='" << errc << "' phase='" << phase << "' ms=" << ms
                  << "\nSPBCAST_WHAT " << one_line(e.what()) << "\nSPBCAST_AT " << steady_ms() << std::endl;
        return type == "other" ? 4 : 3;
    };
    auto report_and_exit = [&](const std::exception& e, long long ms) { std::_Exit(report(e, ms)); };
    int failed = 0;
    try {
        const auto env = spbcast::dist::launch_env::from_environment();
        rank = env.rank;
        auto store = spbcast::dist::make_store(env, std::chrono::seconds(60));
        auto real = spbcast::dist::make_gloo_group(store, env.rank, env.world_size, group_timeout);
        // A rank killed at its first message must not cut a peer that is still connecting.
        spbcast_test::wait_for_set_up(*store, env.rank, env.world_size, group_timeout);
        faulty_group group(*real, s.num("fault_rank", -1) == env.rank, s.num("fault_step", 0),
                           s.num("fault_call", 1), s.get("fault", "kill"), s.num("hang_ms", 10000));
        std::cout << "rank " << rank << " ready" << std::endl;
        for (step = 1; step <= steps; ++step) {
            group.begin_step(step);
            xtuner::Batch batch;
            if (rank == root) batch = xtuner::make_batch(profile, micro, static_cast<uint64_t>(step));
            if (rank == late_rank && step == steps) std::this_thread::sleep_for(late);
            const auto step_start = std::chrono::steady_clock::now();
            try {
                if (on_c10d_group) {
                    group.before_broadcast();
                    spbcast::broadcast(batch, *real, opts);
                } else {
                    spbcast::broadcast(batch, group, opts);
                }
            } catch (const std::exception& e) {
                if (!exit_clean) report_and_exit(e, ms_since(step_start));
                failed = report(e, ms_since(step_start));
                break;
            }
            const auto took = ms_since(step_start);
            const auto got = spbcast::digest(batch);
            const auto want = spbcast::digest(xtuner::make_batch(profile, micro, static_cast<uint64_t>(step)));
            if (got != want) {
                std::cout << "rank " << rank << " step " << step << " MISMATCH" << std::endl;
                return 1;
            }
            std::cout << "rank " << rank << " step " << step << " ok digest " << std::hex << got
                      << std::dec << " ms " << took << std::endl;
            if (step == 1 && fork_child) {
                const pid_t parent = ::getpid();
                if (::fork() == 0) {
                    while (::getppid() == parent) std::this_thread::sleep_for(std::chrono::seconds(5));
                    std::_Exit(0);
                }
            }
            if (interval.count() > 0) std::this_thread::sleep_for(interval);
        }
        if (failed) return failed;  // the group and the store are destroyed on the way out
        std::cout << "rank " << rank << " done rss_mib " << rss_mib() << std::endl;
        if (waits_for_peers) spbcast_test::leave_together(*store, env.rank, env.world_size);
        return 0;
    } catch (const std::exception& e) {
        report_and_exit(e, 0);  // setting up: environment, store, group
    }
    return 4;
}
