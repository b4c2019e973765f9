// spbcast_demo: why spbcast exists, in numbers. For each SP setting it runs the same DP x SP data
// iteration on local processes with sp_media_dedup off (BASE: every rank runs its own multimodal
// loader) and on (only the SP leaders load and broadcast), checks that every rank got the same
// batches either way, stops the dedup run at a checkpoint and resumes it in new processes, and
// reports loaders built, median step time and the group's CPU memory (pss.hpp) - the evidence
// table of the reference PR, at small scale. Dedup runs twice: over the network and over the
// same-host path. See README.md next to this file.
//
// This file is the launcher and the report; demo_worker.cpp is what every rank runs.
#include "dataset.hpp"
#include "demo_options.hpp"
#include "demo_results.hpp"
#include "demo_worker.hpp"
#include "packing.hpp"
#include "pss.hpp"
#include "support/processes.hpp"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using demo::DemoOptions;
using demo::RankResult;

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr double kMiB = 1024.0 * 1024.0;

double seconds_since(Clock::time_point start) {
    return std::chrono::duration<double>(Clock::now() - start).count();
}

std::string fixed(double x, int digits) {
    if (!std::isfinite(x)) return "n/a";
    std::ostringstream s;
    s << std::fixed << std::setprecision(digits) << x;
    return s.str();
}

std::string read_text(const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::runtime_error("cannot read " + path.string());
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
}

void write_text(const fs::path& path, const std::string& text) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << text;
    if (!out.flush()) throw std::runtime_error("cannot write " + path.string());
}

// The last `lines` lines of a log, indented, for an error message.
std::string tail_of(const fs::path& path, int lines) {
    std::string text;
    try {
        text = read_text(path);
    } catch (const std::exception&) {
        return "    (no log at " + path.string() + ")\n";
    }
    std::vector<std::string> all;
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);) all.push_back(line);
    std::string out;
    for (size_t i = all.size() > static_cast<size_t>(lines) ? all.size() - lines : 0; i < all.size(); ++i)
        out += "    " + all[i] + "\n";
    return out.empty() ? "    (empty log)\n" : out;
}

// ---------------------------------------------------------------------------------------------
// Starting ranks

// Prints the progress lines ("[demo] ...") that appear in a log while it grows.
class ProgressRelay {
public:
    explicit ProgressRelay(fs::path log) : log_(std::move(log)) {}

    void poll(bool flush_partial = false) {
        std::ifstream in(log_, std::ios::binary);
        if (!in) return;
        in.seekg(static_cast<std::streamoff>(offset_));
        std::string chunk((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        offset_ += chunk.size();
        pending_ += chunk;
        for (size_t newline; (newline = pending_.find('\n')) != std::string::npos;) {
            emit(pending_.substr(0, newline));
            pending_.erase(0, newline + 1);
        }
        if (flush_partial && !pending_.empty()) {
            emit(pending_);
            pending_.clear();
        }
    }

private:
    static void emit(const std::string& line) {
        const size_t at = line.find("[demo] ");
        if (at != std::string::npos) std::cerr << "  " << line.substr(at) << std::endl;
    }

    fs::path log_;
    size_t offset_ = 0;
    std::string pending_;
};

std::string describe_status(int status) {
    if (WIFEXITED(status)) return "exit status " + std::to_string(WEXITSTATUS(status));
    if (WIFSIGNALED(status)) return std::string("killed by signal ") + ::strsignal(WTERMSIG(status));
    return "status " + std::to_string(status);
}

// Waits for all children up to the deadline, relaying progress. When one fails (or time is up)
// the others get SIGTERM and, 5 s later, SIGKILL: ranks of a broken job would otherwise wait in
// a collective until its timeout. Returns an empty string on success, else what went wrong.
std::string supervise(std::vector<spbcast_test::child>& children, ProgressRelay& relay, std::chrono::seconds deadline) {
    const auto outcome = spbcast_test::supervise(children, {.deadline = deadline,
                                                            .stop_on_failure = true,
                                                            .stop_signal = SIGTERM,
                                                            .grace = std::chrono::seconds(5),
                                                            .on_poll = [&] { relay.poll(); }});
    relay.poll(true);
    if (outcome.first_failed >= 0) {
        const spbcast_test::child& c = children[outcome.first_failed];
        return c.name + " failed (" + describe_status(c.status) + "); the end of its log " + c.log.string() +
               ":\n" + tail_of(c.log, 25);
    }
    if (outcome.timed_out)
        return "the ranks ran past the deadline of " + std::to_string(deadline.count()) +
               " s (--timeout); the end of " + children.front().log.string() + ":\n" +
               tail_of(children.front().log, 25);
    return {};
}

std::string find_torchrun(const DemoOptions& o, const std::string& python) {
    if (!o.torchrun.empty()) return o.torchrun;
    for (const std::string& p : {o.python, python}) {
        const fs::path candidate = fs::path(p).parent_path() / "torchrun";
        if (!fs::path(p).parent_path().empty() && fs::exists(candidate)) return candidate.string();
    }
    return "torchrun";  // on PATH
}

// One launch: `world` ranks of this program in rank mode with `args`, by fork/exec or torchrun.
// Either way the ranks meet at a store on a port the kernel picked: ours (support/processes.hpp,
// served here for the launch), or torchrun's (--standalone).
std::string launch(const DemoOptions& o, const std::vector<std::string>& args, const fs::path& logs,
                   const std::string& python) {
    fs::create_directories(logs);
    const std::string self = fs::canonical("/proc/self/exe").string();
    std::vector<spbcast_test::child> children;
    std::optional<spbcast_test::launcher_store> store;
    if (o.launcher == "torchrun") {
        std::vector<std::string> command = {find_torchrun(o, python), "--no-python", "--standalone", "--nnodes", "1",
                                            "--nproc-per-node", std::to_string(o.world_size), self};
        command.insert(command.end(), args.begin(), args.end());
        const fs::path log = logs / "torchrun.log";
        children.push_back({spbcast_test::spawn(command, spbcast_test::environment_with({}), log), "torchrun", log});
    } else {
        store.emplace(std::chrono::seconds(o.timeout_s + 60));
        for (int rank = 0; rank < o.world_size; ++rank) {
            std::vector<std::string> command = {self};
            command.insert(command.end(), args.begin(), args.end());
            const fs::path log = logs / ("rank" + std::to_string(rank) + ".log");
            const std::vector<std::string> env = spbcast_test::environment_with(store->rank_env(rank, o.world_size));
            children.push_back({spbcast_test::spawn(command, env, log), "rank " + std::to_string(rank), log});
        }
    }
    ProgressRelay relay(children.front().log);
    return supervise(children, relay, std::chrono::seconds(o.timeout_s));
}

// ---------------------------------------------------------------------------------------------
// The experiment

struct Setting {
    int sp = 1, dp = 1;
    // dedup: over the same-host path; dedup_network: the network path; part1/part2: the dedup
    // restart.
    std::vector<RankResult> base, dedup, dedup_network, part1, part2;
    double seconds = 0;
};

struct Check {
    std::string name;
    bool ok = true;
    std::string detail;  // the first problem, when not ok
};

struct Report {
    int sp = 1, dp = 1;
    int loaders_base = 0, loaders_dedup = 0;
    double step_base = 0, step_dedup = 0, step_dedup_network = 0;
    demo::PssSummary pss_base, pss_dedup, pss_dedup_network;
    int64_t window_first = 1, window_last = 1, saved_at = 0;
    std::vector<Check> checks;
    bool ok() const {
        return std::all_of(checks.begin(), checks.end(), [](const Check& c) { return c.ok; });
    }
};

// Every rank ran steps first..last (in order) in `arm`.
std::string missing_steps(const std::vector<RankResult>& arm, int world, int64_t first, int64_t last) {
    if (static_cast<int>(arm.size()) != world)
        return std::to_string(arm.size()) + " rank reports instead of " + std::to_string(world);
    for (const RankResult& r : arm) {
        if (static_cast<int64_t>(r.steps.size()) != last - first + 1)
            return "rank " + std::to_string(r.rank) + " ran " + std::to_string(r.steps.size()) + " steps, expected " +
                   std::to_string(last - first + 1);
        for (size_t i = 0; i < r.steps.size(); ++i)
            if (r.steps[i].step != first + static_cast<int64_t>(i))
                return "rank " + std::to_string(r.rank) + " reported step " + std::to_string(r.steps[i].step) +
                       " where step " + std::to_string(first + static_cast<int64_t>(i)) + " was due";
    }
    return {};
}

// The first (rank, step) where two arms' digests differ; both arms ran the same steps.
std::string first_difference(const std::vector<RankResult>& a, const std::vector<RankResult>& b,
                             const std::string& a_name, const std::string& b_name) {
    for (size_t r = 0; r < a.size() && r < b.size(); ++r)
        for (size_t i = 0; i < a[r].steps.size() && i < b[r].steps.size(); ++i)
            if (a[r].steps[i].digest != b[r].steps[i].digest)
                return "rank " + std::to_string(r) + " step " + std::to_string(a[r].steps[i].step) + ": " + a_name +
                       " " + demo::hex64(a[r].steps[i].digest) + ", " + b_name + " " +
                       demo::hex64(b[r].steps[i].digest);
    return {};
}

Report evaluate(const Setting& s, const DemoOptions& o) {
    Report rep;
    rep.sp = s.sp;
    rep.dp = s.dp;
    rep.saved_at = o.steps / 2;
    rep.window_first = demo::window_first_step(o.steps);
    rep.window_last = o.steps;
    rep.loaders_base = demo::loaders_built(s.base);
    rep.loaders_dedup = demo::loaders_built(s.dedup);
    rep.step_base = demo::median_step_seconds(s.base, rep.window_first, rep.window_last);
    rep.step_dedup = demo::median_step_seconds(s.dedup, rep.window_first, rep.window_last);
    rep.step_dedup_network = demo::median_step_seconds(s.dedup_network, rep.window_first, rep.window_last);
    rep.pss_base = demo::summarise_pss(s.base, rep.window_first, rep.window_last);
    rep.pss_dedup = demo::summarise_pss(s.dedup, rep.window_first, rep.window_last);
    rep.pss_dedup_network = demo::summarise_pss(s.dedup_network, rep.window_first, rep.window_last);

    auto add = [&](std::string name, std::string problem) {
        rep.checks.push_back({std::move(name), problem.empty(), std::move(problem)});
    };
    const int world = o.world_size;
    std::string ran = missing_steps(s.base, world, 1, o.steps);
    if (ran.empty()) ran = missing_steps(s.dedup, world, 1, o.steps);
    if (ran.empty()) ran = missing_steps(s.dedup_network, world, 1, o.steps);
    add("every rank ran all " + std::to_string(o.steps) + " steps in BASE and both dedup arms", ran);

    add("dedup built fewer loaders than BASE (" + std::to_string(rep.loaders_dedup) + " < " +
            std::to_string(rep.loaders_base) + ")",
        rep.loaders_dedup < rep.loaders_base ? "" : "dedup built " + std::to_string(rep.loaders_dedup) + ", BASE " +
                                                        std::to_string(rep.loaders_base));

    std::vector<std::string> mismatch = demo::sp_group_mismatches(s.base);
    for (const std::string& m : demo::sp_group_mismatches(s.dedup)) mismatch.push_back("dedup: " + m);
    for (const std::string& m : demo::sp_group_mismatches(s.dedup_network)) mismatch.push_back("dedup (network): " + m);
    add("batch digests equal across each SP group (BASE and both dedup arms)", mismatch.empty() ? "" : mismatch.front());

    std::string differ = "not every step ran";
    if (ran.empty()) differ = first_difference(s.base, s.dedup, "BASE", "dedup");
    if (ran.empty() && differ.empty()) differ = first_difference(s.base, s.dedup_network, "BASE", "dedup (network)");
    add("batch digests equal between BASE and both dedup arms, every rank and step", differ);

    std::string rng;
    for (const auto* dedup : {&s.dedup, &s.dedup_network})
        for (size_t r = 0; r < s.base.size() && r < dedup->size() && rng.empty(); ++r)
            if (s.base[r].rng != (*dedup)[r].rng)
                rng = "rank " + std::to_string(r) + ": BASE " + demo::hex64(s.base[r].rng) + ", " +
                      (dedup == &s.dedup ? "dedup " : "dedup (network) ") + demo::hex64((*dedup)[r].rng);
    add("default CPU generator ends in the same state in BASE and both dedup arms, every rank", rng);

    // The restart: steps 1..K in one job, K+1..N in a new one, against the continuous run.
    std::string restart = missing_steps(s.part1, world, 1, rep.saved_at);
    if (restart.empty()) restart = missing_steps(s.part2, world, rep.saved_at + 1, o.steps);
    if (restart.empty()) {
        std::vector<RankResult> joined = s.part1;
        for (size_t r = 0; r < joined.size(); ++r)
            joined[r].steps.insert(joined[r].steps.end(), s.part2[r].steps.begin(), s.part2[r].steps.end());
        restart = first_difference(joined, s.dedup, "restarted", "continuous");
        // Not compared: the generator states. A new process's first loader iterator draws a
        // base seed, as a restarted PyTorch trainer's does, so after a restart they differ from
        // the continuous run by design (in BASE as in dedup); the parity check above covers them.
    }
    add("dedup stopped after step " + std::to_string(rep.saved_at) + ", resumed in new processes: steps " +
            std::to_string(rep.saved_at + 1) + "-" + std::to_string(o.steps) + " equal the continuous run",
        restart);
    return rep;
}

std::vector<RankResult> read_arm(const fs::path& run_dir) {
    const fs::path path = run_dir / "arm.result";
    return demo::parse_results(read_text(path), path.string());
}

std::string setting_name(int sp, int dp) { return "SP" + std::to_string(sp) + "/DP" + std::to_string(dp); }

// ---------------------------------------------------------------------------------------------
// Output

struct RunInfo {
    std::string torch;
    int64_t model_iters = 0;
    double pack_rows = 0, pack_mib = 0, samples_per_pack = 0;
    int64_t packs = 0;
    bool cache_generated = false;
    double cache_seconds = 0;
    fs::path cache_folder;
    double wall_seconds = 0;
};

std::string markdown_table(const std::vector<Report>& reports, const DemoOptions& o) {
    std::ostringstream t;
    const std::string window = std::to_string(demo::window_first_step(o.steps)) + "-" + std::to_string(o.steps);
    t << "| SP / DP | Pack length | Global batch | Loaders built BASE -> dedup | Step median (s), steps " << window
      << ": BASE / dedup network / dedup same host | Group memory, steady: BASE / dedup network / dedup same host "
         "| Peak: BASE / network / same host | Batches equal (SP group, BASE = dedup) | Restart = continuous |\n";
    t << "|---|---|---|---|---|---|---|---|---|\n";
    auto gib = [](const demo::PssSummary& a, const demo::PssSummary& b, const demo::PssSummary& c, double demo::PssSummary::*f) {
        return fixed(a.*f / kGiB, 2) + " / " + fixed(b.*f / kGiB, 2) + " / " + fixed(c.*f / kGiB, 2) + " GiB";
    };
    for (const Report& r : reports) {
        auto ok = [&](size_t i) { return r.checks.at(i).ok ? std::string("yes") : std::string("**NO**"); };
        t << "| " << r.sp << " / " << r.dp << " | " << o.pack_length << " | " << r.dp * o.micro_batches << " | "
          << r.loaders_base << " -> " << r.loaders_dedup << " | " << fixed(r.step_base, 3) << " / "
          << fixed(r.step_dedup_network, 3) << " / " << fixed(r.step_dedup, 3) << " | "
          << gib(r.pss_base, r.pss_dedup_network, r.pss_dedup, &demo::PssSummary::steady_bytes) << " | "
          << gib(r.pss_base, r.pss_dedup_network, r.pss_dedup, &demo::PssSummary::peak_bytes) << " | " << ok(2)
          << ", " << ok(3) << " | " << ok(5) << " |\n";
    }
    return t.str();
}

std::string checks_text(const std::vector<Report>& reports) {
    std::ostringstream t;
    for (const Report& r : reports)
        for (const Check& c : r.checks) {
            t << "- " << (c.ok ? "ok    " : "FAILED") << " " << setting_name(r.sp, r.dp) << ": " << c.name;
            if (!c.ok) t << " - " << c.detail;
            t << "\n";
        }
    return t.str();
}

std::string json_string(const std::string& s) {
    std::string out = "\"";
    for (const char ch : s) {
        switch (ch) {
            case '"': out += "\\\""; break;
            case '\\': out += "\\\\"; break;
            case '\n': out += "\\n"; break;
            case '\t': out += "\\t"; break;
            default:
                if (static_cast<unsigned char>(ch) < 0x20) {
                    char esc[8];
                    std::snprintf(esc, sizeof esc, "\\u%04x", ch);
                    out += esc;
                } else {
                    out += ch;
                }
        }
    }
    return out + "\"";
}

std::string json_number(double x, int digits) { return std::isfinite(x) ? fixed(x, digits) : "null"; }

std::string json_digests(const std::vector<RankResult>& arm) {
    std::string out = "[";
    for (size_t r = 0; r < arm.size(); ++r) {
        out += r ? ", [" : "[";
        for (size_t i = 0; i < arm[r].steps.size(); ++i)
            out += (i ? ", " : "") + json_string(demo::hex64(arm[r].steps[i].digest));
        out += "]";
    }
    return out + "]";
}

std::string json_report(const std::vector<Report>& reports, const std::vector<Setting>& settings,
                        const DemoOptions& o, const RunInfo& info, bool ok) {
    std::ostringstream j;
    j << "{\n  \"ok\": " << (ok ? "true" : "false") << ",\n";
    j << "  \"torch\": " << json_string(info.torch) << ",\n";
    j << "  \"world_size\": " << o.world_size << ",\n  \"steps\": " << o.steps << ",\n";
    j << "  \"step_window\": [" << demo::window_first_step(o.steps) << ", " << o.steps << "],\n";
    j << "  \"launcher\": " << json_string(o.launcher) << ",\n";
    j << "  \"wall_seconds\": " << json_number(info.wall_seconds, 1) << ",\n";
    j << "  \"pipeline\": {\"samples\": " << o.samples << ", \"image_size\": " << o.image_size
      << ", \"max_text_tokens\": " << o.max_text_tokens << ", \"pack_length\": " << o.pack_length
      << ", \"micro_batches\": " << o.micro_batches << ", \"workers\": " << o.workers
      << ", \"persistent_workers\": " << (o.persistent_workers ? "true" : "false") << ", \"packs\": " << info.packs
      << ", \"mean_patch_rows_per_pack\": " << json_number(info.pack_rows, 1)
      << ", \"mean_pixel_values_mib_per_pack\": " << json_number(info.pack_mib, 2)
      << ", \"cache\": " << json_string(info.cache_folder.string()) << "},\n";
    j << "  \"model_step\": {\"ms\": " << json_number(o.model_ms, 1) << ", \"matmuls_256\": " << info.model_iters << "},\n";
    j << "  \"settings\": [\n";
    for (size_t i = 0; i < reports.size(); ++i) {
        const Report& r = reports[i];
        const Setting& s = settings[i];
        j << "    {\"name\": " << json_string(setting_name(r.sp, r.dp)) << ", \"sp\": " << r.sp << ", \"dp\": " << r.dp
          << ", \"pack_length\": " << o.pack_length << ", \"global_batch\": " << r.dp * o.micro_batches << ",\n";
        j << "     \"loaders_built\": {\"base\": " << r.loaders_base << ", \"dedup\": " << r.loaders_dedup << "},\n";
        j << "     \"step_median_seconds\": {\"base\": " << json_number(r.step_base, 4)
          << ", \"dedup\": " << json_number(r.step_dedup, 4)
          << ", \"dedup_network\": " << json_number(r.step_dedup_network, 4) << "},\n";
        j << "     \"group_memory_steady_gib\": {\"base\": " << json_number(r.pss_base.steady_bytes / kGiB, 3)
          << ", \"dedup\": " << json_number(r.pss_dedup.steady_bytes / kGiB, 3)
          << ", \"dedup_network\": " << json_number(r.pss_dedup_network.steady_bytes / kGiB, 3) << "},\n";
        j << "     \"group_memory_peak_gib\": {\"base\": " << json_number(r.pss_base.peak_bytes / kGiB, 3)
          << ", \"dedup\": " << json_number(r.pss_dedup.peak_bytes / kGiB, 3)
          << ", \"dedup_network\": " << json_number(r.pss_dedup_network.peak_bytes / kGiB, 3) << "},\n";
        j << "     \"restart\": {\"saved_after_step\": " << r.saved_at << ", \"resumed_steps\": [" << r.saved_at + 1
          << ", " << o.steps << "]},\n";
        j << "     \"checks\": [";
        for (size_t c = 0; c < r.checks.size(); ++c)
            j << (c ? ", " : "") << "{\"name\": " << json_string(r.checks[c].name)
              << ", \"ok\": " << (r.checks[c].ok ? "true" : "false") << ", \"detail\": " << json_string(r.checks[c].detail)
              << "}";
        j << "],\n";
        j << "     \"digests\": {\"base\": " << json_digests(s.base) << ",\n                 \"dedup\": "
          << json_digests(s.dedup) << ",\n                 \"dedup_network\": " << json_digests(s.dedup_network) << ",\n                 \"restart_first\": " << json_digests(s.part1)
          << ",\n                 \"restart_resumed\": " << json_digests(s.part2) << "},\n";
        j << "     \"seconds\": " << json_number(s.seconds, 1) << "}" << (i + 1 < reports.size() ? "," : "") << "\n";
    }
    j << "  ]\n}\n";
    return j.str();
}

// The group-memory CSV for plot_pss.py: every arm of every setting, time from each arm's start.
void write_pss_csv(const fs::path& path, const std::vector<Setting>& settings) {
    std::ofstream out(path, std::ios::trunc);
    out << demo::kPssCsvHeader;
    for (const Setting& s : settings)
        for (const auto& [arm, ranks] : {std::pair{"BASE", &s.base}, std::pair{"dedup (network)", &s.dedup_network},
                                         std::pair{"dedup (same host)", &s.dedup}}) {
            int64_t origin = INT64_MAX;
            for (const RankResult& r : *ranks)
                if (!r.pss.empty()) origin = std::min(origin, r.pss.front().t_ns);
            for (const RankResult& r : *ranks)
                for (const demo::PssRecord& p : r.pss)
                    out << setting_name(s.sp, s.dp) << ',' << arm << ',' << r.rank << ','
                        << fixed((p.t_ns - origin) * 1e-9, 3) << ',' << p.bytes << '\n';
        }
    if (!out.flush()) throw std::runtime_error("cannot write " + path.string());
}

int run_and_wait(const std::vector<std::string>& command, const fs::path& log) {
    const pid_t pid = spbcast_test::spawn(command, spbcast_test::environment_with({}), log);
    int status = 0;
    ::waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
}

// A Python that has matplotlib: CMake's SPBCAST_PYTHON (or --python), else the set-up script's
// virtual environment. Empty when there is none; `tried` says what was tried.
std::string plotting_python(const DemoOptions& o, const fs::path& logs, std::string& tried) {
    std::vector<std::string> candidates{o.python};
    if (const char* venv = std::getenv("SPBCAST_VENV"); venv && *venv)
        candidates.push_back((fs::path(venv) / "bin" / "python").string());
    if (const char* home = std::getenv("HOME"); home && *home)
        candidates.push_back((fs::path(home) / ".cache/spbcast/venv/bin/python").string());
    for (const std::string& python : candidates) {
        if (python.find('/') != std::string::npos && !fs::exists(python)) {
            tried += (tried.empty() ? "" : ", ") + python + " (missing)";
            continue;
        }
        if (run_and_wait({python, "-c", "import matplotlib, numpy"}, logs / "python-check.log") == 0) return python;
        tried += (tried.empty() ? "" : ", ") + python + " (no matplotlib/numpy)";
    }
    return {};
}

// ---------------------------------------------------------------------------------------------

int run_demo(const DemoOptions& o) {
    const auto start = Clock::now();
    RunInfo info;
    info.torch = demo::torch_description();
    std::string settings_text;
    for (int sp : o.sp_sizes) settings_text += (settings_text.empty() ? "" : ", ") + setting_name(sp, o.world_size / sp);
    std::cout << "spbcast demo: " << o.world_size << " ranks on this machine (" << o.launcher << " launcher), "
              << settings_text << ", " << o.steps << " steps per arm, " << info.torch << ", Gloo over loopback\n";

    // The media are generated here once, before any rank starts.
    const demo::PipelineConfig pipeline = o.pipeline(0, 1);
    std::cerr << "  [demo] media cache: checking " << (pipeline.cache_dir / demo::cache_key(pipeline)).string()
              << " (generated on first use)" << std::endl;
    const auto cache_start = Clock::now();
    const demo::CacheFolder cache = demo::ensure_cache(pipeline);
    info.cache_seconds = seconds_since(cache_start);
    info.cache_generated = cache.generated;
    info.cache_folder = cache.path;
    {
        const demo::Dataset dataset(pipeline);
        const auto packs = demo::plan_packs(dataset, o.pack_length);
        int64_t rows = 0, samples = 0;
        for (const auto& pack : packs) {
            samples += static_cast<int64_t>(pack.size());
            for (int64_t i : pack) rows += dataset.info(i).num_patches();
        }
        info.packs = static_cast<int64_t>(packs.size());
        info.pack_rows = static_cast<double>(rows) / info.packs;
        info.samples_per_pack = static_cast<double>(samples) / info.packs;
        info.pack_mib = info.pack_rows * demo::kPatchRowSize * 4 / kMiB;
    }
    std::cout << "media: " << o.samples << " samples of text, images and " << pipeline.video_frames
              << "-frame videos up to " << o.image_size << " px, stored as JPEG in " << cache.path.string() << " ("
              << (cache.generated ? "generated in " + fixed(info.cache_seconds, 1) + " s" : std::string("reused"))
              << ")\n";
    std::cout << "batches: " << o.micro_batches << " x packs of " << o.pack_length << " tokens, ~"
              << fixed(info.samples_per_pack, 1) << " samples and ~" << fixed(info.pack_rows, 0)
              << " patch rows (" << fixed(info.pack_mib, 1) << " MiB of pixel_values) per pack, " << info.packs
              << " packs per epoch; loader: " << o.workers << " worker threads"
              << (o.persistent_workers ? " (persistent)" : "") << ", prefetch 2 per worker\n";

    info.model_iters = o.model_iters > 0 ? o.model_iters : demo::calibrate_model_iters(o.model_ms);
    std::cout << "model step: " << info.model_iters << " matmuls of 256x256 float32 (~" << fixed(o.model_ms, 0)
              << " ms of single-thread compute, calibrated here), then an SP and a DP all-reduce" << std::endl;

    for (const char* sub : {"runs", "logs", "ckpt"}) fs::remove_all(o.out / sub);
    fs::create_directories(o.out / "logs");
    std::string tried;
    const std::string python = plotting_python(o, o.out / "logs", tried);

    std::vector<std::string> common = {
        "--worker", "--steps", std::to_string(o.steps), "--samples", std::to_string(o.samples),
        "--image-size", std::to_string(o.image_size), "--max-text-tokens", std::to_string(o.max_text_tokens),
        "--pack-length", std::to_string(o.pack_length), "--micro-batches", std::to_string(o.micro_batches),
        "--workers", std::to_string(o.workers), "--cache", o.cache_dir.string(),
        "--model-iters", std::to_string(info.model_iters), "--model-ms", fixed(o.model_ms, 3),
        "--timeout", std::to_string(o.timeout_s), "--out", o.out.string()};
    if (o.persistent_workers) common.push_back("--persistent-workers");
    if (o.receive_cache_mib >= 0) {
        common.push_back("--receive-cache-mib");
        common.push_back(std::to_string(o.receive_cache_mib));
    }

    std::vector<Setting> settings;
    for (int sp : o.sp_sizes) {
        Setting s;
        s.sp = sp;
        s.dp = o.world_size / sp;
        const auto setting_start = Clock::now();
        const std::string name = setting_name(sp, s.dp);
        const std::string tag = "sp" + std::to_string(sp);
        const fs::path ckpt = o.out / "ckpt" / tag;
        struct Arm {
            std::string key, label, arm;
            std::vector<std::string> extra;
            std::vector<RankResult>* into;
        };
        const int64_t k = o.steps / 2;
        const std::vector<Arm> arms = {
            {"base", name + " BASE", "base", {}, &s.base},
            {"dedup-network", name + " dedup (network)", "dedup", {"--transport", "network"}, &s.dedup_network},
            {"dedup", name + " dedup (same host)", "dedup", {"--transport", "auto"}, &s.dedup},
            {"restart1", name + " dedup, restart 1/2", "dedup", {"--save-at", std::to_string(k), "--ckpt", ckpt.string()}, &s.part1},
            {"restart2", name + " dedup, restart 2/2 (new processes)", "dedup", {"--resume", "--ckpt", ckpt.string()}, &s.part2},
        };
        for (const Arm& arm : arms) {
            const fs::path run_dir = o.out / "runs" / (tag + "-" + arm.key);
            std::vector<std::string> args = common;
            args.insert(args.end(), {"--sp", std::to_string(sp), "--arm", arm.arm, "--run-dir", run_dir.string(),
                                     "--label", arm.label});
            args.insert(args.end(), arm.extra.begin(), arm.extra.end());
            const auto arm_start = Clock::now();
            const std::string failure = launch(o, args, o.out / "logs" / (tag + "-" + arm.key), python);
            if (!failure.empty()) {
                std::cerr << "spbcast_demo: " << arm.label << ": " << failure;
                std::cerr << "spbcast_demo: stopped; all logs are in " << (o.out / "logs").string() << "\n";
                return 3;
            }
            *arm.into = read_arm(run_dir);
            std::cerr << "  [demo] " << arm.label << ": done in " << fixed(seconds_since(arm_start), 1) << " s"
                      << std::endl;
        }
        s.seconds = seconds_since(setting_start);
        settings.push_back(std::move(s));
    }

    std::vector<Report> reports;
    for (const Setting& s : settings) reports.push_back(evaluate(s, o));
    const bool ok = std::all_of(reports.begin(), reports.end(), [](const Report& r) { return r.ok(); });
    info.wall_seconds = seconds_since(start);

    const std::string table = markdown_table(reports, o);
    const std::string checks = checks_text(reports);
    std::cout << "\n" << table << "\n" << checks;

    // Files: JSON, markdown, the PSS samples and their plot.
    const fs::path json = o.out / "results.json", md = o.out / "results.md", csv = o.out / "pss.csv",
                   png = o.out / "pss.png";
    write_text(json, json_report(reports, settings, o, info, ok));
    write_pss_csv(csv, settings);
    std::string plot_note;
    if (python.empty()) {
        plot_note = "plot skipped: no Python with matplotlib and numpy (tried " + tried +
                    "); run scripts/setup.sh, or pass --python, or plot later with: python " +
                    std::string(SPBCAST_DEMO_SOURCE_DIR) + "/plot_pss.py " + csv.string() + " " + png.string();
    } else {
        const fs::path script = fs::path(SPBCAST_DEMO_SOURCE_DIR) / "plot_pss.py";
        const int rc = run_and_wait({python, script.string(), csv.string(), png.string(), "--title",
                                     "spbcast demo: group memory of " + std::to_string(o.world_size) +
                                         " ranks (sum of Pss_Anon + change in Shmem)"},
                                    o.out / "logs" / "plot.log");
        plot_note = rc == 0 ? "plot: " + png.string()
                            : "plot failed (" + python + " " + script.string() + ", exit " + std::to_string(rc) +
                                  "):\n" + tail_of(o.out / "logs" / "plot.log", 10);
    }

    std::ostringstream m;
    m << "# spbcast demo results\n\n"
      << o.world_size << " ranks, " << o.steps << " steps per arm, " << info.torch << ", " << o.launcher
      << " launcher; packs of " << o.pack_length << " tokens (~" << fixed(info.pack_rows, 0) << " patch rows, "
      << fixed(info.pack_mib, 1) << " MiB of pixel_values), " << o.workers << " loader workers"
      << (o.persistent_workers ? " (persistent)" : "") << "; model step " << info.model_iters
      << " matmuls (~" << fixed(o.model_ms, 0) << " ms). Wall time " << fixed(info.wall_seconds, 1) << " s.\n\n"
      << table << "\n"
      << "Step median: the slowest rank's step (fetch + model step + step-end all-reduces), median over steps "
      << demo::window_first_step(o.steps) << "-" << o.steps
      << ". Group memory: the sum over the ranks of their anonymous PSS (Pss_Anon) plus the change in the host's "
         "Shmem, on a common time grid, so a shared page counts once; steady = median over the same steps, peak = "
         "maximum over the whole run.\n\n"
      << "## Checks\n\n" << checks << "\n"
      << (python.empty() ? plot_note : "![group memory](pss.png)") << "\n";
    write_text(md, m.str());

    std::cout << "\nresults: " << json.string() << ", " << md.string() << ", " << csv.string() << "\n"
              << plot_note << "\n";
    std::cout << (ok ? "all checks passed" : "SOME CHECKS FAILED") << " in " << fixed(seconds_since(start), 1)
              << " s\n";
    return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
    DemoOptions options;
    try {
        options = demo::parse_options(argc, argv);
    } catch (const demo::UsageError& e) {
        std::cerr << "spbcast_demo: " << e.what() << "\n";
        return 2;
    }
    if (options.help) {
        std::cout << demo::kUsage;
        return 0;
    }
    if (options.worker) return demo::run_worker(options);
    try {
        return run_demo(options);
    } catch (const std::exception& e) {
        std::cerr << "spbcast_demo: error: " << e.what() << "\n";
        return 1;
    }
}
