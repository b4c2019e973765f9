// Real processes, for the tests where process behaviour matters (crashes, restarts, memory) and
// for the programs that start their own ranks (bench, demo): N copies of a rank program with
// the launcher environment torchrun would give them, supervised up to a deadline.
//
// Ports come from the kernel and are never guessed: the launcher hosts the job's store itself,
// as torchrun's agent does - a c10d TCPStore listening on port 0, open for the whole job - and
// tells its ranks to connect to it as clients (TORCHELASTIC_USE_AGENT_STORE=True, honoured by
// spbcast::dist::make_store). A port picked by binding, closing and hoping could be taken by
// another program (a parallel ctest) before rank 0 binds it again.
#pragma once

#include "set_up.hpp"

#include <spbcast/dist.hpp>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace spbcast_test {

// ---------------------------------------------------------------------------------------------
// The launcher's side

// The job's store, served by the launcher on a port the kernel chose.
class launcher_store {
public:
    explicit launcher_store(std::chrono::milliseconds timeout = std::chrono::minutes(5)) {
        c10d::TCPStoreOptions opts;
        opts.port = 0;  // the kernel picks; getPort() reads what it picked
        opts.isServer = true;
        opts.waitWorkers = false;  // the ranks do not exist yet
        opts.timeout = timeout;
        store_ = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", opts);
    }

    int port() const { return store_->getPort(); }
    c10d::Store& store() const { return *store_; }

    // One rank's launcher variables, as torchrun sets them for `world` ranks on this host.
    std::vector<std::string> rank_env(int rank, int world) const {
        return {"MASTER_ADDR=127.0.0.1",
                "MASTER_PORT=" + std::to_string(port()),
                "RANK=" + std::to_string(rank),
                "WORLD_SIZE=" + std::to_string(world),
                "LOCAL_RANK=" + std::to_string(rank),
                "LOCAL_WORLD_SIZE=" + std::to_string(world),
                "TORCHELASTIC_USE_AGENT_STORE=True"};
    }

private:
    c10::intrusive_ptr<c10d::TCPStore> store_;
};

// This process's environment with `overrides` (NAME=value) replacing or adding entries.
inline std::vector<std::string> environment_with(const std::vector<std::string>& overrides) {
    std::vector<std::string> env = overrides;
    for (char** e = environ; *e; ++e) {
        const std::string entry = *e;
        const std::string name = entry.substr(0, entry.find('=') + 1);
        bool replaced = false;
        for (const std::string& mine : overrides) replaced |= mine.rfind(name, 0) == 0;
        if (!replaced) env.push_back(entry);
    }
    return env;
}

// fork + exec (args[0] looked up on PATH when it has no slash), stdout and stderr into `log`.
// The child keeps no other descriptor of ours: a rank must not hold the launcher's store socket
// (tests count a rank's descriptors). With `own_process_group` the child leads a process
// group of its own, so stopping it also stops whatever it started.
inline pid_t spawn(const std::vector<std::string>& args, const std::vector<std::string>& env,
                   const std::filesystem::path& log, bool own_process_group = false) {
    std::vector<std::string> a = args, e = env;
    std::vector<char*> argv, envp;
    for (std::string& s : a) argv.push_back(s.data());
    argv.push_back(nullptr);
    for (std::string& s : e) envp.push_back(s.data());
    envp.push_back(nullptr);
    const std::string log_path = log.string();
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error("fork failed");
    if (pid == 0) {
        if (own_process_group) ::setpgid(0, 0);
        const int fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd >= 0) {
            ::dup2(fd, 1);
            ::dup2(fd, 2);
        }
        ::close_range(3, ~0u, 0);
        ::execvpe(argv[0], argv.data(), envp.data());
        std::fprintf(stderr, "cannot execute %s\n", argv[0]);
        ::_exit(127);
    }
    if (own_process_group) ::setpgid(pid, pid);  // also here: no race with the first kill
    return pid;
}

struct child {
    pid_t pid = -1;
    std::string name;  // "rank 2", "torchrun"
    std::filesystem::path log;
    bool done = false;
    int status = 0;        // waitpid's, once done
    bool stopped = false;  // signalled by supervise(): past the deadline, or the job failed
    double seconds = 0;    // from the start of supervise() to the exit
    long long ended_ms = 0;  // when the exit was seen, steady clock ms (within one poll, 20 ms)

    bool failed() const { return done && !(WIFEXITED(status) && WEXITSTATUS(status) == 0); }
    int exit_code() const { return WIFEXITED(status) ? WEXITSTATUS(status) : -1; }  // -1: a signal
    int signal() const { return WIFSIGNALED(status) ? WTERMSIG(status) : 0; }
};

struct supervision {
    std::chrono::milliseconds deadline{std::chrono::minutes(5)};
    // One failed child stops the rest: ranks of a broken job would otherwise wait in a
    // collective until its timeout. Off where a test kills a rank on purpose and checks what
    // the others do.
    bool stop_on_failure = false;
    int stop_signal = SIGKILL;  // sent when stopping starts; 0 sends nothing (only the SIGKILL below)
    std::chrono::milliseconds grace{0};  // from then to SIGKILL for whatever is left
    bool process_groups = false;         // signal each child's process group (spawn's own_process_group)
    std::function<void()> on_poll;       // every round, e.g. to relay progress from a log
};

struct supervision_result {
    bool timed_out = false;  // stopped because the deadline passed
    int first_failed = -1;   // the child whose failure was seen first, or -1
};

// Waits for every child, stopping them as `how` says. Every child is reaped before it returns.
inline supervision_result supervise(std::vector<child>& children, const supervision& how) {
    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    std::optional<clock::time_point> stopping;
    bool killed = false;
    supervision_result out;
    auto signal_rest = [&](int sig) {
        for (child& c : children)
            if (!c.done && sig != 0) {
                ::kill(how.process_groups ? -c.pid : c.pid, sig);
                c.stopped = true;
            }
    };
    for (;;) {
        bool all_done = true;
        for (std::size_t i = 0; i < children.size(); ++i) {
            child& c = children[i];
            if (c.done) continue;
            int status = 0;
            if (::waitpid(c.pid, &status, WNOHANG) == c.pid) {
                c.done = true;
                c.status = status;
                c.seconds = std::chrono::duration<double>(clock::now() - start).count();
                c.ended_ms = std::chrono::duration_cast<std::chrono::milliseconds>(clock::now().time_since_epoch()).count();
                if (c.failed() && !c.stopped && out.first_failed < 0) out.first_failed = static_cast<int>(i);
            } else {
                all_done = false;
            }
        }
        if (how.on_poll) how.on_poll();
        if (all_done) break;
        if (!stopping) {
            const bool late = clock::now() - start > how.deadline;
            if (late || (how.stop_on_failure && out.first_failed >= 0)) {
                out.timed_out = late && out.first_failed < 0;
                stopping = clock::now();
                signal_rest(how.stop_signal);
            }
        }
        if (stopping && !killed && clock::now() - *stopping >= how.grace) {
            signal_rest(SIGKILL);
            killed = true;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return out;
}

// ---------------------------------------------------------------------------------------------
// For the tests

struct process_result {
    int exit_code = -1;  // -1 when killed by a signal
    int signal = 0;
    bool timed_out = false;
    double seconds = 0;
    long long ended_ms = 0;  // when the exit was seen, steady clock ms (CLOCK_MONOTONIC: one host's processes share it)
    std::string output;  // stdout and stderr together
};

// The directory of the running test binary, where the worker programs are built too.
inline std::filesystem::path binary_dir() {
    return std::filesystem::canonical("/proc/self/exe").parent_path();
}

// Starts `world` processes of `program` with args_for(rank) on a store of their own, waits for
// all of them up to `deadline`, kills whatever is left, and returns each one's result.
template <class ArgsFor>
std::vector<process_result> run_processes(const std::filesystem::path& program, int world,
                                          ArgsFor args_for, std::chrono::seconds deadline,
                                          std::vector<std::string> extra_env = {}) {
    const launcher_store store(deadline);
    const auto logs = std::filesystem::temp_directory_path() /
                      ("spbcast-proc-" + std::to_string(::getpid()) + "-" + std::to_string(store.port()));
    std::filesystem::create_directories(logs);
    std::vector<child> children;
    for (int rank = 0; rank < world; ++rank) {
        std::vector<std::string> args = args_for(rank);
        args.insert(args.begin(), program.string());
        std::vector<std::string> env = store.rank_env(rank, world);
        env.insert(env.end(), extra_env.begin(), extra_env.end());
        const auto log = logs / ("rank" + std::to_string(rank) + ".log");
        children.push_back({spawn(args, environment_with(env), log), "rank " + std::to_string(rank), log});
    }
    supervise(children, {.deadline = deadline});
    std::vector<process_result> results(world);
    for (int rank = 0; rank < world; ++rank) {
        const child& c = children[rank];
        results[rank].exit_code = c.exit_code();
        results[rank].signal = c.signal();
        results[rank].timed_out = c.stopped;
        results[rank].seconds = c.seconds;
        results[rank].ended_ms = c.ended_ms;
        std::ifstream in(c.log);
        std::stringstream text;
        text << in.rdbuf();
        results[rank].output = text.str();
    }
    std::filesystem::remove_all(logs);
    return results;
}

inline std::string describe(const std::vector<process_result>& results) {
    std::string out;
    for (std::size_t r = 0; r < results.size(); ++r)
        out += "\n--- rank " + std::to_string(r) + " (exit " + std::to_string(results[r].exit_code) +
               ", signal " + std::to_string(results[r].signal) +
               (results[r].timed_out ? ", TIMED OUT" : "") + ", " +
               std::to_string(results[r].seconds) + " s)\n" + results[r].output;
    return out;
}

// ---------------------------------------------------------------------------------------------
// The rank's side: a program started by the launcher above, by torchrun --no-python or by the
// netns scripts joins its job from the launcher environment.

struct joined_job {
    spbcast::dist::launch_env env;
    c10::intrusive_ptr<c10d::Store> store;
    c10::intrusive_ptr<c10d::ProcessGroupGloo> group;  // destroyed before the store
};

// The job this process joined, kept past the case that joined it until leave_job: its group
// must not close its connections before every rank is done (set_up.hpp, leave_together).
inline std::optional<joined_job>& kept_job() {
    static std::optional<joined_job> job;
    return job;
}

// Returns once every rank of the job has its group (set_up.hpp).
inline joined_job join_job(std::chrono::milliseconds timeout) {
    joined_job job;
    job.env = spbcast::dist::launch_env::from_environment();
    job.store = spbcast::dist::make_store(job.env, timeout);
    job.group = spbcast::dist::make_gloo_group(job.store, job.env.rank, job.env.world_size, timeout);
    wait_for_set_up(*job.store, job.env.rank, job.env.world_size, timeout);
    kept_job() = job;
    return job;
}

// A rank program's last step, with the exit code it ends with: waits for the job's other ranks
// (not when this one failed), then lets its group and store go.
inline int leave_job(int exit_code) {
    if (auto& job = kept_job()) {
        if (exit_code == 0) leave_together(*job->store, job->env.rank, job->env.world_size);
        job.reset();
    }
    return exit_code;
}

}  // namespace spbcast_test
