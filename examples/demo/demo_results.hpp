// What one launch of spbcast_demo's ranks (one "arm") measured, and the arithmetic on it that
// both modes need: rank 0 of a launch summarises its arm, the launcher compares arms.
//
// Every rank reports as text; rank 0 collects the reports through the job's store and writes
// them, concatenated, to <run-dir>/arm.result:
//
//   rank R sp S world W sp_rank s dp_rank d has_loader 0|1 rng HEX build_s X
//   step K epoch E digest HEX start_ns T end_ns T fetch_ns T
//   pss T_NS BYTES
//   end
//
// Times are steady_clock nanoseconds, which is the same clock in every process of a machine,
// so the ranks' series line up.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace demo {

struct StepRecord {
    int64_t step = 0, epoch = 0;
    uint64_t digest = 0;
    int64_t start_ns = 0, end_ns = 0, fetch_ns = 0;
};

struct PssRecord {
    int64_t t_ns = 0;
    int64_t bytes = 0;
};

struct RankResult {
    int rank = 0, sp = 1, world = 1, sp_rank = 0, dp_rank = 0;
    bool has_loader = false;
    uint64_t rng = 0;         // checksum of the default CPU generator's state at the end
    double build_s = 0;       // building the leader_loader (with dedup: including its broadcast)
    std::vector<StepRecord> steps;
    std::vector<PssRecord> pss;
};

inline std::string hex64(uint64_t v) {
    char text[17];
    std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(v));
    return text;
}

inline std::string to_text(const RankResult& r) {
    std::ostringstream out;
    out << "rank " << r.rank << " sp " << r.sp << " world " << r.world << " sp_rank " << r.sp_rank
        << " dp_rank " << r.dp_rank << " has_loader " << (r.has_loader ? 1 : 0) << " rng " << hex64(r.rng)
        << " build_s " << r.build_s << "\n";
    for (const StepRecord& s : r.steps)
        out << "step " << s.step << " epoch " << s.epoch << " digest " << hex64(s.digest) << " start_ns "
            << s.start_ns << " end_ns " << s.end_ns << " fetch_ns " << s.fetch_ns << "\n";
    for (const PssRecord& p : r.pss) out << "pss " << p.t_ns << " " << p.bytes << "\n";
    out << "end\n";
    return out.str();
}

// All ranks of one arm, indexed by rank.
inline std::vector<RankResult> parse_results(const std::string& text, const std::string& where) {
    std::vector<RankResult> ranks;
    std::istringstream in(text);
    RankResult* current = nullptr;
    auto bad = [&](const std::string& line) {
        throw std::runtime_error(where + ": unreadable line '" + line + "'");
    };
    for (std::string line; std::getline(in, line);) {
        if (line.empty()) continue;
        std::istringstream fields(line);
        std::string kind, k1, k2, k3, k4, k5, k6, k7, k8, hex;
        fields >> kind;
        if (kind == "rank") {
            RankResult r;
            int has_loader = 0;
            fields >> r.rank >> k1 >> r.sp >> k2 >> r.world >> k3 >> r.sp_rank >> k4 >> r.dp_rank >> k5 >> has_loader >>
                k6 >> hex >> k7 >> r.build_s;
            if (!fields || k6 != "rng") bad(line);
            r.has_loader = has_loader != 0;
            r.rng = std::stoull(hex, nullptr, 16);
            if (r.rank < 0 || r.rank > 4096) bad(line);
            if (static_cast<int>(ranks.size()) <= r.rank) ranks.resize(static_cast<size_t>(r.rank) + 1);
            ranks[static_cast<size_t>(r.rank)] = r;
            current = &ranks[static_cast<size_t>(r.rank)];
        } else if (kind == "step" && current) {
            StepRecord s;
            fields >> s.step >> k1 >> s.epoch >> k2 >> hex >> k3 >> s.start_ns >> k4 >> s.end_ns >> k5 >> s.fetch_ns;
            if (!fields || k2 != "digest") bad(line);
            s.digest = std::stoull(hex, nullptr, 16);
            current->steps.push_back(s);
        } else if (kind == "pss" && current) {
            PssRecord p;
            fields >> p.t_ns >> p.bytes;
            if (!fields) bad(line);
            current->pss.push_back(p);
        } else if (kind == "end") {
            current = nullptr;
        } else {
            bad(line);
        }
    }
    return ranks;
}

inline double median(std::vector<double> v) {
    if (v.empty()) return std::numeric_limits<double>::quiet_NaN();
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The first step of the steady window: 6 with 20 steps (steps 6-20, as the reference measures),
// the second half of shorter runs.
inline int64_t window_first_step(int64_t steps) { return steps >= 10 ? 6 : steps / 2 + 1; }

// A step's time is the slowest rank's (every rank joins the step-end collectives, so they
// finish together); the arm's step time is the median over the steady window.
inline double median_step_seconds(const std::vector<RankResult>& ranks, int64_t first, int64_t last) {
    std::map<int64_t, double> slowest;
    for (const RankResult& r : ranks)
        for (const StepRecord& s : r.steps)
            if (s.step >= first && s.step <= last)
                slowest[s.step] = std::max(slowest[s.step], (s.end_ns - s.start_ns) * 1e-9);
    std::vector<double> v;
    for (const auto& [step, seconds] : slowest) v.push_back(seconds);
    return median(v);
}

// The ranks' PSS summed on a common time grid (as plot_pss.py does): each rank's series is held
// from one sample to the next, and a rank counts between its first and its last sample.
struct PssSum {
    std::vector<int64_t> t_ns;
    std::vector<double> bytes;
};

inline PssSum summed_pss(const std::vector<RankResult>& ranks) {
    PssSum sum;
    int64_t start = std::numeric_limits<int64_t>::max(), stop = std::numeric_limits<int64_t>::min();
    std::vector<double> periods;
    for (const RankResult& r : ranks) {
        if (r.pss.empty()) continue;
        start = std::min(start, r.pss.front().t_ns);
        stop = std::max(stop, r.pss.back().t_ns);
        std::vector<double> gaps;
        for (size_t i = 1; i < r.pss.size(); ++i) gaps.push_back(static_cast<double>(r.pss[i].t_ns - r.pss[i - 1].t_ns));
        if (!gaps.empty()) periods.push_back(median(gaps));
    }
    if (start > stop) return sum;
    const int64_t period = periods.empty() ? 50'000'000 : std::max<int64_t>(1'000'000, static_cast<int64_t>(*std::min_element(periods.begin(), periods.end())));
    for (int64_t t = start;; t += period) {
        t = std::min(t, stop);
        double total = 0;
        for (const RankResult& r : ranks) {
            if (r.pss.empty() || t < r.pss.front().t_ns || t > r.pss.back().t_ns) continue;
            const auto after = std::upper_bound(r.pss.begin(), r.pss.end(), t,
                                                [](int64_t x, const PssRecord& p) { return x < p.t_ns; });
            total += static_cast<double>(std::prev(after)->bytes);
        }
        sum.t_ns.push_back(t);
        sum.bytes.push_back(total);
        if (t == stop) break;
    }
    return sum;
}

struct PssSummary {
    double steady_bytes = 0;  // median of the sum over the steady window
    double peak_bytes = 0;    // maximum of the sum over the whole run
};

// The steady window in time: from the start of step `first` to the end of step `last`, as rank
// 0 saw them.
inline PssSummary summarise_pss(const std::vector<RankResult>& ranks, int64_t first, int64_t last) {
    const PssSum sum = summed_pss(ranks);
    PssSummary out;
    int64_t from = std::numeric_limits<int64_t>::min(), to = std::numeric_limits<int64_t>::max();
    if (!ranks.empty())
        for (const StepRecord& s : ranks.front().steps) {
            if (s.step == first) from = s.start_ns;
            if (s.step == last) to = s.end_ns;
        }
    std::vector<double> steady;
    for (size_t i = 0; i < sum.t_ns.size(); ++i) {
        out.peak_bytes = std::max(out.peak_bytes, sum.bytes[i]);
        if (sum.t_ns[i] >= from && sum.t_ns[i] <= to) steady.push_back(sum.bytes[i]);
    }
    out.steady_bytes = steady.empty() ? std::numeric_limits<double>::quiet_NaN() : median(steady);
    return out;
}

// Problems with the SP groups of one arm: every rank of an SP group must have seen the same
// batch at every step. Empty when all is well.
inline std::vector<std::string> sp_group_mismatches(const std::vector<RankResult>& ranks) {
    std::vector<std::string> problems;
    for (const RankResult& r : ranks) {
        const RankResult& leader = ranks.at(static_cast<size_t>(r.dp_rank * r.sp));
        if (r.steps.size() != leader.steps.size()) {
            problems.push_back("rank " + std::to_string(r.rank) + " ran " + std::to_string(r.steps.size()) +
                               " steps, its SP leader " + std::to_string(leader.steps.size()));
            continue;
        }
        for (size_t i = 0; i < r.steps.size(); ++i)
            if (r.steps[i].digest != leader.steps[i].digest || r.steps[i].step != leader.steps[i].step) {
                problems.push_back("rank " + std::to_string(r.rank) + " step " + std::to_string(r.steps[i].step) +
                                   ": digest " + hex64(r.steps[i].digest) + ", its SP leader (rank " +
                                   std::to_string(leader.rank) + ") " + hex64(leader.steps[i].digest));
                break;
            }
    }
    return problems;
}

inline int loaders_built(const std::vector<RankResult>& ranks) {
    int n = 0;
    for (const RankResult& r : ranks) n += r.has_loader ? 1 : 0;
    return n;
}

}  // namespace demo
