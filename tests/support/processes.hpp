// Real processes for the tests where process behaviour matters (crashes, restarts, memory):
// N copies of a worker program with the launcher environment torchrun would give them
// (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK), each bounded by a deadline.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace spbcast_test {

struct process_result {
    int exit_code = -1;  // -1 when killed by a signal
    int signal = 0;
    bool timed_out = false;
    double seconds = 0;
    std::string output;  // stdout and stderr together
};

inline int free_port() {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    socklen_t len = sizeof addr;
    if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
        ::close(fd);
        throw std::runtime_error("cannot find a free port");
    }
    ::close(fd);
    return ntohs(addr.sin_port);
}

// The directory of the running test binary, where the worker programs are built too.
inline std::filesystem::path binary_dir() {
    return std::filesystem::canonical("/proc/self/exe").parent_path();
}

// Starts `world` processes of `program` with args_for(rank), waits for all of them up to
// `deadline`, kills whatever is left, and returns each one's result.
template <class ArgsFor>
std::vector<process_result> run_processes(const std::filesystem::path& program, int world,
                                          ArgsFor args_for, std::chrono::seconds deadline,
                                          std::vector<std::string> extra_env = {}) {
    const int port = free_port();
    const auto logs = std::filesystem::temp_directory_path() /
                      ("spbcast-proc-" + std::to_string(::getpid()) + "-" + std::to_string(port));
    std::filesystem::create_directories(logs);
    std::vector<pid_t> pids(world);
    const auto start = std::chrono::steady_clock::now();
    for (int rank = 0; rank < world; ++rank) {
        std::vector<std::string> args = args_for(rank);
        args.insert(args.begin(), program.string());
        std::vector<std::string> env = {
            "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + std::to_string(port),
            "RANK=" + std::to_string(rank), "WORLD_SIZE=" + std::to_string(world),
            "LOCAL_RANK=" + std::to_string(rank)};
        env.insert(env.end(), extra_env.begin(), extra_env.end());
        for (char** e = environ; *e; ++e) {
            const std::string entry = *e;
            const auto name = entry.substr(0, entry.find('=') + 1);
            bool overridden = false;
            for (const auto& mine : env) overridden |= mine.rfind(name, 0) == 0;
            if (!overridden) env.push_back(entry);
        }
        const std::string log = (logs / ("rank" + std::to_string(rank) + ".log")).string();
        const pid_t pid = ::fork();
        if (pid == 0) {
            const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
            ::dup2(fd, 1);
            ::dup2(fd, 2);
            std::vector<char*> argv, envp;
            for (auto& a : args) argv.push_back(a.data());
            argv.push_back(nullptr);
            for (auto& e : env) envp.push_back(e.data());
            envp.push_back(nullptr);
            ::execve(argv[0], argv.data(), envp.data());
            ::_exit(127);
        }
        pids[rank] = pid;
    }
    std::vector<process_result> results(world);
    std::vector<bool> done(world, false);
    int remaining = world;
    while (remaining > 0) {
        const auto elapsed = std::chrono::steady_clock::now() - start;
        for (int rank = 0; rank < world; ++rank) {
            if (done[rank]) continue;
            int status = 0;
            const bool late = elapsed > deadline;
            if (late) ::kill(pids[rank], SIGKILL);
            if (::waitpid(pids[rank], &status, late ? 0 : WNOHANG) == pids[rank]) {
                done[rank] = true;
                --remaining;
                results[rank].timed_out = late;
                results[rank].seconds = std::chrono::duration<double>(elapsed).count();
                if (WIFEXITED(status)) results[rank].exit_code = WEXITSTATUS(status);
                if (WIFSIGNALED(status)) results[rank].signal = WTERMSIG(status);
            }
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    for (int rank = 0; rank < world; ++rank) {
        std::ifstream in(logs / ("rank" + std::to_string(rank) + ".log"));
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

}  // namespace spbcast_test
