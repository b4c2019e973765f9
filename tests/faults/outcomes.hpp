// What each rank of a fault test raised, in a form the tests can check, and the common check
// "the root failed with X; every follower raised spbcast::remote_error carrying it".
#pragma once

#include <spbcast/broadcast.hpp>

#include <doctest/doctest.h>

#include <chrono>
#include <exception>
#include <string>
#include <typeinfo>
#include <vector>

namespace spbcast_fault {

struct caught {
    bool threw = false;
    std::string type;  // remote_error, schema_error, transport_error, error, std::exception
    spbcast::errc code{};
    std::string what;
    std::string root_message;  // remote_error only
    int root_rank = -1;        // remote_error only
    std::string phase;         // transport_error only
    double seconds = 0;        // how long the failing call took
};

// Runs `call` and records what it raised, if anything.
template <class Call>
caught catch_from(Call&& call) {
    caught c;
    const auto start = std::chrono::steady_clock::now();
    try {
        call();
    } catch (const spbcast::remote_error& e) {
        c = {true, "remote_error", e.code(), e.what(), e.root_message(), e.root_rank(), {}};
    } catch (const spbcast::schema_error& e) {
        c = {true, "schema_error", e.code(), e.what(), {}, -1, {}};
    } catch (const spbcast::transport_error& e) {
        c = {true, "transport_error", e.code(), e.what(), {}, -1, e.phase()};
    } catch (const spbcast::error& e) {
        c = {true, "error", e.code(), e.what(), {}, -1, {}};
    } catch (const std::exception& e) {
        c = {true, std::string("std::exception (") + typeid(e).name() + ")", {}, e.what(), {}, -1, {}};
    }
    c.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return c;
}

inline std::string describe(const std::vector<caught>& ranks) {
    std::string out;
    for (std::size_t r = 0; r < ranks.size(); ++r) {
        const caught& c = ranks[r];
        out += "\n  rank " + std::to_string(r) + ": " +
               (c.threw ? c.type + " [" + spbcast::to_string(c.code) + "] after " +
                              std::to_string(c.seconds) + " s: " + c.what
                        : std::string("no exception"));
    }
    return out;
}

inline bool contains(const std::string& text, const std::string& part) {
    return text.find(part) != std::string::npos;
}

// The root raised spbcast::error with `code` and a message containing every `root_parts`;
// every follower raised spbcast::remote_error whose root_message() is the root's message, whose
// root_rank() is the root, and whose own message names the root.
inline void check_root_failure_reported(const std::vector<caught>& ranks, int root, spbcast::errc code,
                                        const std::vector<std::string>& root_parts) {
    const std::string all = describe(ranks);
    const caught& r = ranks.at(root);
    REQUIRE_MESSAGE(r.threw, all);
    CHECK_MESSAGE(r.type != "remote_error", all);
    CHECK_MESSAGE(!contains(r.type, "std::exception"), all);
    CHECK_MESSAGE(r.code == code, all);
    for (const auto& part : root_parts) CHECK_MESSAGE(contains(r.what, part), ("root lacks '" + part + "'" + all));
    for (std::size_t f = 0; f < ranks.size(); ++f) {
        if (static_cast<int>(f) == root) continue;
        const caught& c = ranks[f];
        REQUIRE_MESSAGE(c.threw, all);
        CHECK_MESSAGE(c.type == "remote_error", all);
        CHECK_MESSAGE(c.code == spbcast::errc::remote, all);
        CHECK_MESSAGE(c.root_rank == root, all);
        CHECK_MESSAGE(contains(c.what, "the root (rank " + std::to_string(root) + ")"), all);
        CHECK_MESSAGE(contains(c.what, "rank " + std::to_string(f)), all);
        for (const auto& part : root_parts)
            CHECK_MESSAGE(contains(c.root_message, part),
                          ("follower's root_message lacks '" + part + "'" + all));
    }
}

}  // namespace spbcast_fault
