// This process's share of the job's memory, and a thread that samples it over time. The share
// is the process's anonymous PSS (Pss_Anon: its private memory, and anonymous pages it shares
// split among their sharers) plus an equal part of the change in the host's shared memory
// (Shmem in /proc/meminfo) since the sampler started. Summed over the ranks that is the job's
// group memory, with every shared page counted once: the same-host path's segments live in
// Shmem whether a rank maps them (then they would show in its PSS, split) or only a descriptor
// holds them (then in nobody's PSS). RSS would count shared pages once per rank, and the plain
// Pss line would add the LibTorch libraries' file pages, the same in every arm.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <fstream>
#include <mutex>
#include <optional>
#include <ostream>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace demo {

namespace detail {

// Sum of the lines starting with `key` (values in kB) of a /proc file, or nullopt if it cannot
// be read or has none.
inline std::optional<int64_t> sum_kib_lines(const char* path, std::string_view key) {
    std::ifstream in(path);
    if (!in) return std::nullopt;
    bool found = false;
    int64_t kib = 0;
    for (std::string line; std::getline(in, line);) {
        if (line.rfind(key, 0) != 0) continue;
        kib += std::stoll(line.substr(key.size()));
        found = true;
    }
    if (!found) return std::nullopt;
    return kib * 1024;
}

}  // namespace detail

// smaps_rollup (Linux 4.14+) is one line per field and cheap; smaps lists every mapping.
inline int64_t read_pss_anon_bytes() {
    if (const auto bytes = detail::sum_kib_lines("/proc/self/smaps_rollup", "Pss_Anon:")) return *bytes;
    if (const auto bytes = detail::sum_kib_lines("/proc/self/smaps", "Pss_Anon:")) return *bytes;
    throw std::runtime_error("cannot read Pss_Anon from /proc/self/smaps_rollup or /proc/self/smaps; "
                             "it needs Linux 4.15 or later with /proc mounted");
}

inline int64_t read_host_shmem_bytes() {
    if (const auto bytes = detail::sum_kib_lines("/proc/meminfo", "Shmem:")) return *bytes;
    throw std::runtime_error("cannot read Shmem from /proc/meminfo");
}

struct PssPoint {
    double t_seconds;  // since the sampler's origin
    int64_t bytes;     // this rank's share of the group memory
};

// Records (t, this rank's share) every `period` on its own thread, from construction until
// stop(). Pass the same origin (steady_clock is system-wide on Linux) in every rank to line
// their series up, and the number of ranks that share the host's Shmem change.
class PssSampler {
public:
    PssSampler(std::chrono::milliseconds period, std::chrono::steady_clock::time_point origin, int ranks)
        : period_(period), origin_(origin), ranks_(ranks), shmem_start_(read_host_shmem_bytes()),
          thread_([this] { run(); }) {}

    ~PssSampler() { halt(); }

    PssSampler(const PssSampler&) = delete;
    PssSampler& operator=(const PssSampler&) = delete;

    // Takes a last sample, stops the thread and returns all samples; later calls return them
    // again. Rethrows what stopped the sampling early, if something did.
    std::vector<PssPoint> stop() {
        halt();
        std::lock_guard lock(mutex_);
        if (error_) std::rethrow_exception(error_);
        return points_;
    }

private:
    void halt() {
        {
            std::lock_guard lock(mutex_);
            stopping_ = true;
        }
        wake_.notify_all();
        if (thread_.joinable()) thread_.join();
    }

    void run() {
        try {
            sample_until_stopped();
        } catch (...) {
            std::lock_guard lock(mutex_);
            error_ = std::current_exception();
        }
    }

    void sample_until_stopped() {
        std::unique_lock lock(mutex_);
        while (true) {
            const bool last = stopping_;
            lock.unlock();
            const PssPoint point{std::chrono::duration<double>(std::chrono::steady_clock::now() - origin_).count(),
                                 read_pss_anon_bytes() + (read_host_shmem_bytes() - shmem_start_) / ranks_};
            lock.lock();
            points_.push_back(point);
            if (last) return;
            wake_.wait_for(lock, period_, [&] { return stopping_; });
        }
    }

    const std::chrono::milliseconds period_;
    const std::chrono::steady_clock::time_point origin_;
    const int ranks_;
    const int64_t shmem_start_;
    std::mutex mutex_;
    std::condition_variable wake_;
    bool stopping_ = false;
    std::vector<PssPoint> points_;
    std::exception_ptr error_;
    std::thread thread_;  // last: it starts running before the constructor returns
};

// The CSV that plot_pss.py reads.
inline constexpr std::string_view kPssCsvHeader = "setting,arm,rank,t_seconds,memory_bytes\n";

inline void write_pss_csv(std::ostream& out, std::string_view setting, std::string_view arm, int rank,
                          std::span<const PssPoint> points) {
    for (const PssPoint& p : points)
        out << setting << ',' << arm << ',' << rank << ',' << std::to_string(p.t_seconds) << ',' << p.bytes << '\n';
}

}  // namespace demo
