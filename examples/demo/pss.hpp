// This process's proportional set size (PSS) and a thread that samples it over time. PSS
// charges each shared page to the processes that share it in equal parts, so the PSS of all
// ranks adds up to the memory they really use together; RSS would count shared pages (the
// LibTorch libraries, a shared cache) once per rank.
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

// Sum of the "Pss:" lines (in kB) of a /proc smaps file, or nullopt if it cannot be read.
inline std::optional<int64_t> sum_pss_lines(const char* path) {
    std::ifstream in(path);
    if (!in) return std::nullopt;
    bool found = false;
    int64_t kib = 0;
    for (std::string line; std::getline(in, line);) {
        if (line.rfind("Pss:", 0) != 0) continue;  // not Pss_Anon:, Pss_File:, ...
        kib += std::stoll(line.substr(4));
        found = true;
    }
    if (!found) return std::nullopt;
    return kib * 1024;
}

}  // namespace detail

// smaps_rollup (Linux 4.14+) is one line per field and cheap; smaps lists every mapping.
inline int64_t read_pss_bytes() {
    if (const auto bytes = detail::sum_pss_lines("/proc/self/smaps_rollup")) return *bytes;
    if (const auto bytes = detail::sum_pss_lines("/proc/self/smaps")) return *bytes;
    throw std::runtime_error("cannot read Pss from /proc/self/smaps_rollup or /proc/self/smaps; "
                             "PSS needs Linux with /proc mounted");
}

struct PssPoint {
    double t_seconds;  // since the sampler's origin
    int64_t pss_bytes;
};

// Records (t, PSS) every `period` on its own thread, from construction until stop(). Pass the
// same origin (steady_clock is system-wide on Linux) in every rank to line their series up.
class PssSampler {
public:
    explicit PssSampler(std::chrono::milliseconds period,
                        std::chrono::steady_clock::time_point origin = std::chrono::steady_clock::now())
        : period_(period), origin_(origin), thread_([this] { run(); }) {}

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
                                 read_pss_bytes()};
            lock.lock();
            points_.push_back(point);
            if (last) return;
            wake_.wait_for(lock, period_, [&] { return stopping_; });
        }
    }

    const std::chrono::milliseconds period_;
    const std::chrono::steady_clock::time_point origin_;
    std::mutex mutex_;
    std::condition_variable wake_;
    bool stopping_ = false;
    std::vector<PssPoint> points_;
    std::exception_ptr error_;
    std::thread thread_;  // last: it starts running before the constructor returns
};

// The CSV that plot_pss.py reads.
inline constexpr std::string_view kPssCsvHeader = "setting,arm,rank,t_seconds,pss_bytes\n";

inline void write_pss_csv(std::ostream& out, std::string_view setting, std::string_view arm, int rank,
                          std::span<const PssPoint> points) {
    for (const PssPoint& p : points)
        out << setting << ',' << arm << ',' << rank << ',' << std::to_string(p.t_seconds) << ',' << p.pss_bytes << '\n';
}

}  // namespace demo
