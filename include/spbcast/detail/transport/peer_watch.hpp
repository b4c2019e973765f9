// Who of this host's peers has died, told by the kernel at once, whatever still holds the dead
// process's sockets.
//
// A rank killed while its forked children (DataLoader workers, a checkpoint writer) live on
// leaves its sockets open in them: its peers' reads see no end of stream until the last child
// exits (torch's worker watchdog notices a dead parent only every 5 s), and Gloo waits on. The
// process itself is gone at once, though, and Linux says so through a pidfd (pidfd_open, 5.3):
// it polls readable the moment the process exits, whoever holds its files, and never for a
// process that is only stopped (SIGSTOP) or slow - those keep the group's timeout.
//
// The same-host handshake tells every rank the process id of each rank on its host
// (host_identity), and the group's state lists them (group_state::peers). One thread per
// process sleeps in poll() on the pidfds of every watched peer and an eventfd for new ones: it
// wakes only when a watched process dies or one is added, never per step. When one dies it
// reads how (the exit status or signal: from the pidfd on Linux 6.15 and later, whoever reaped
// the process; before, from /proc while it is a zombie, as a pidfd's waitid works only for a
// parent) and wakes every wait registered here (collective.hpp), which then raises an error
// naming the dead rank, its host and how it ended.
//
// A rank's children do not keep its connections: a process whose peers are watched makes every
// child it forks (a DataLoader worker, a checkpoint writer) let go of the connected TCP sockets it
// inherited - the backend's links to the peers, which the child never uses (it has none of the
// backend's threads) - as the child starts, before fork() returns in it. Each such descriptor is
// replaced by /dev/null under the same number, so a stale object in the child that closes it
// closes nothing of anyone's. So when a rank dies, the kernel closes its sockets at once and the
// peers' backends fail by themselves too, freeing their threads: a survivor can exit at once.
// Listening sockets and every other descriptor are left as they are.
//
// Fork: a child gets none of the watch thread; every call checks the process id first and a
// child watches nothing (its copies of the pidfds are closed on exec and harmless before).
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace spbcast::detail {

// The start time of process `pid` (field 22 of /proc/<pid>/stat, clock ticks since boot) and,
// for a zombie, its wait status (field 52); nullopt when the process is gone.
struct proc_stat {
    char state = 0;
    unsigned long long start_time = 0;
    int exit_code = 0;
};
inline std::optional<proc_stat> read_proc_stat(int pid) {
    std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    if (!std::getline(in, line)) return std::nullopt;
    const auto close = line.rfind(')');  // the name may hold spaces and parentheses
    if (close == std::string::npos) return std::nullopt;
    std::istringstream fields(line.substr(close + 2));
    std::vector<std::string> f;  // f[0] is field 3 (state)
    for (std::string s; fields >> s;) f.push_back(s);
    if (f.size() < 20) return std::nullopt;
    proc_stat st;
    st.state = f[0].empty() ? 0 : f[0][0];
    st.start_time = std::stoull(f[19]);
    if (f.size() >= 50) st.exit_code = std::stoi(f[49]);
    return st;
}

// The wait status of the exited process behind `pidfd`, for any process holding the pidfd, its
// parent or not, and after its parent reaped it: Linux 6.15's PIDFD_GET_INFO with
// PIDFD_INFO_EXIT (<linux/pidfd.h>; defined here as the kernel's uapi has them, since older
// headers lack them). nullopt on older kernels and while the process lives.
struct pidfd_exit_info {  // struct pidfd_info, its first version (PIDFD_INFO_SIZE_VER0)
    std::uint64_t mask = 0, cgroupid = 0;
    std::uint32_t pid = 0, tgid = 0, ppid = 0, ruid = 0, rgid = 0, euid = 0, egid = 0, suid = 0, sgid = 0,
                  fsuid = 0, fsgid = 0;
    std::int32_t exit_code = 0;
};
static_assert(sizeof(pidfd_exit_info) == 64, "spbcast: struct pidfd_info's first version is 64 bytes");
inline std::optional<int> pidfd_exit_status(int pidfd) {
    constexpr std::uint64_t pidfd_info_exit = 1u << 3;
    pidfd_exit_info info;
    info.mask = pidfd_info_exit;
    if (::ioctl(pidfd, _IOWR(0xFF, 11, pidfd_exit_info), &info) != 0 || !(info.mask & pidfd_info_exit))
        return std::nullopt;
    return info.exit_code;
}

// "exited with status 3", "killed by signal 9 (SIGKILL)", from a wait status.
inline std::string describe_wait_status(int status) {
    if (status & 0x7f) {
        const int sig = status & 0x7f;
        const char* name = sig == SIGKILL ? "SIGKILL" : sig == SIGTERM ? "SIGTERM" : sig == SIGSEGV ? "SIGSEGV"
                         : sig == SIGABRT ? "SIGABRT" : sig == SIGBUS ? "SIGBUS" : sig == SIGINT ? "SIGINT"
                         : sig == SIGHUP ? "SIGHUP" : sig == SIGPIPE ? "SIGPIPE" : sig == SIGILL ? "SIGILL"
                         : sig == SIGFPE ? "SIGFPE" : nullptr;
        return "killed by signal " + std::to_string(sig) + (name ? " (" + std::string(name) + ")" : std::string());
    }
    return "exited with status " + std::to_string((status >> 8) & 0xff);
}

class peer_watch {
public:
    static peer_watch& instance() {
        static auto* w = new peer_watch();  // never destroyed: its thread runs until exit
        return *w;
    }

    // Whether this kernel gives pidfds (Linux 5.3 and later).
    static bool available() {
        static const bool ok = [] {
            const int fd = static_cast<int>(::syscall(SYS_pidfd_open, ::getpid(), 0));
            if (fd < 0) return false;
            ::close(fd);
            return true;
        }();
        return ok;
    }

    // Watches process `pid`, named in messages as `who` ("rank 0 (global rank 4, host h1,
    // pid 1234)"); `on_death`, where given, is called from the watch thread with how it ended
    // ("exited: killed by signal 9 (SIGKILL)") when it fails (death_board.hpp: telling other
    // hosts). Returns false where it cannot (no pidfds, the process is already gone).
    bool watch(int pid, const std::string& who, std::function<void(const std::string&)> on_death = {}) {
        if (!in_owner()) return false;
        std::lock_guard<std::mutex> lock(mutex_);
        if (auto it = peers_.find(pid); it != peers_.end()) {
            if (on_death) it->second.on_death.push_back(std::move(on_death));
            return true;
        }
        const auto st = read_proc_stat(pid);
        const int fd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
        if (fd < 0 || !st) {
            if (fd >= 0) ::close(fd);
            return false;
        }
        peers_[pid] = peer{fd, st->start_time, who, {}};
        if (on_death) peers_[pid].on_death.push_back(std::move(on_death));
        if (!thread_started_) {
            ::pthread_atfork(nullptr, nullptr, &release_connections_in_child);
            wake_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
            std::thread([this] { run(); }).detach();
            thread_started_ = true;
        }
        const std::uint64_t one = 1;
        (void)!::write(wake_, &one, sizeof one);  // the thread polls the new pidfd too
        return true;
    }

    // Which ends count: a failure (killed by a signal, an exit status other than 0, or an exit
    // whose status is gone, reaped at once by its parent), or any exit. A rank that exited with
    // status 0 did its part: a message it took part in may still complete for the others (a
    // follower that received the last broadcast and left), so waits end only on a failure; a
    // backend that failed already names any exit (collective.hpp).
    static constexpr bool any_exit = true;

    // The first of `pids` to fail: "rank 0 (global rank 0, host h1, pid 1234) exited:
    // killed by signal 9 (SIGKILL)"; empty when all live.
    std::string death_among(const std::vector<int>& pids) {
        if (pids.empty() || !in_owner() || deaths_.load(std::memory_order_acquire) == 0) return {};
        std::lock_guard<std::mutex> lock(mutex_);
        return death_among_locked(pids, false);
    }

    // Waits until `done()` is true, one of `pids` is dead, or `deadline`, and returns the
    // death's text (empty: none). `done` is checked under this watch's lock: whoever makes it
    // true calls notify() afterwards.
    template <class Done>
    std::string wait(const std::vector<int>& pids, std::chrono::steady_clock::time_point deadline, Done done,
                     bool exits = false) {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait_until(lock, deadline, [&] { return done() || !death_among_locked(pids, exits).empty(); });
        return death_among_locked(pids, exits);
    }

    // A completion that a wait above may be waiting for.
    void notify() {
        if (!in_owner()) return;
        { std::lock_guard<std::mutex> lock(mutex_); }
        cv_.notify_all();
    }

private:
    struct peer {
        int fd = -1;
        unsigned long long start_time = 0;
        std::string who;
        std::string death;  // how it ended, once it has
        bool failed = false;      // not an exit with status 0
        std::uint64_t order = 0;  // 1 for the first death seen here, 2 for the next...
        std::vector<std::function<void(const std::string&)>> on_death;
    };

    peer_watch() : owner_(::getpid()) {}

    // pthread_atfork's child handler: only system calls (the child of a threaded process may
    // call nothing else safely). Lists /proc/self/fd with getdents64, as a process may allow a
    // million descriptors.
    static void release_connections_in_child() {
        const int dir = ::open("/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (dir < 0) return;
        const int null = ::open("/dev/null", O_RDWR | O_CLOEXEC);
        alignas(8) char buffer[4096];
        for (;;) {
            const long n = ::syscall(SYS_getdents64, dir, buffer, sizeof buffer);
            if (n <= 0) break;
            for (long at = 0; at < n;) {
                struct entry { std::uint64_t ino; std::int64_t off; unsigned short reclen; unsigned char type; char name[1]; };
                const auto* e = reinterpret_cast<const entry*>(buffer + at);
                at += e->reclen;
                int fd = 0;
                bool number = e->name[0] != 0;
                for (const char* c = e->name; *c; ++c) {
                    if (*c < '0' || *c > '9') number = false;
                    fd = fd * 10 + (*c - '0');
                }
                if (number && fd != dir && fd != null && null >= 0 && connected_tcp(fd)) ::dup2(null, fd);
            }
        }
        if (null >= 0) ::close(null);
        ::close(dir);
    }

    static bool connected_tcp(int fd) {
        int domain = 0, type = 0, listening = 0;
        socklen_t len = sizeof domain;
        if (::getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &len) != 0 || (domain != AF_INET && domain != AF_INET6))
            return false;
        len = sizeof type;
        if (::getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0 || type != SOCK_STREAM) return false;
        len = sizeof listening;
        if (::getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0 || listening) return false;
        sockaddr_storage peer{};
        len = sizeof peer;
        return ::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &len) == 0;
    }
    bool in_owner() const { return ::getpid() == owner_; }

    // The earliest death, not the first dead rank in the group's order: a rank that failed
    // because of that death may exit too before a survivor names it.
    std::string death_among_locked(const std::vector<int>& pids, bool exits) const {
        const peer* first = nullptr;
        for (int pid : pids) {
            auto it = peers_.find(pid);
            if (it != peers_.end() && !it->second.death.empty() && (exits || it->second.failed) &&
                (!first || it->second.order < first->order))
                first = &it->second;
        }
        return first ? first->who + " " + first->death : std::string();
    }

    void run() {
        for (;;) {
            std::vector<pollfd> fds{{wake_, POLLIN, 0}};
            std::vector<int> pids{0};
            {
                std::lock_guard<std::mutex> lock(mutex_);
                for (const auto& [pid, p] : peers_)
                    if (p.death.empty()) {
                        fds.push_back({p.fd, POLLIN, 0});
                        pids.push_back(pid);
                    }
            }
            if (::poll(fds.data(), fds.size(), -1) < 0) continue;  // EINTR
            if (fds[0].revents) {
                std::uint64_t n;
                (void)!::read(wake_, &n, sizeof n);
            }
            bool died = false;
            std::vector<std::pair<std::function<void(const std::string&)>, std::string>> told;
            for (std::size_t i = 1; i < fds.size(); ++i) {
                if (!fds[i].revents) continue;
                // The pidfd tells the wait status on newer kernels; else a zombie tells it in
                // /proc until its parent reaps it (and the pidfd may tell it by then).
                std::lock_guard<std::mutex> lock(mutex_);
                peer& p = peers_[pids[i]];
                auto status = pidfd_exit_status(p.fd);
                if (!status)
                    if (const auto st = read_proc_stat(pids[i]); st && st->state == 'Z' && st->start_time == p.start_time)
                        status = st->exit_code;
                if (!status) status = pidfd_exit_status(p.fd);
                p.death = status ? "exited: " + describe_wait_status(*status) : "exited";
                p.failed = !status || *status != 0;
                ::close(p.fd);
                p.fd = -1;
                p.order = deaths_.fetch_add(1, std::memory_order_release) + 1;
                if (p.failed)
                    for (auto& f : p.on_death) told.emplace_back(std::move(f), p.death);
                p.on_death.clear();
                died = true;
            }
            if (died) cv_.notify_all();
            for (auto& [f, how] : told) f(how);  // outside the lock: it may talk to a store
        }
    }

    const pid_t owner_;
    std::mutex mutex_;
    std::condition_variable cv_;
    std::map<int, peer> peers_;
    std::atomic<std::uint64_t> deaths_{0};
    bool thread_started_ = false;
    int wake_ = -1;
};

}  // namespace spbcast::detail
