// Which host, user and network namespace a process runs in: ranks share the same-host path
// only when all three match the root's (an abstract socket lives in one network namespace).
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

namespace spbcast::detail {

struct host_identity {
    char boot_id[40] = {};
    std::uint32_t uid = 0;
    std::uint32_t pad = 0;
    std::uint64_t netns = 0;
    // Not part of the identity: who this is, for the peers that watch it (peer_watch.hpp) and
    // name it when it dies.
    std::int32_t pid = 0;
    std::int32_t global_rank = -1;  // the launcher's RANK, where it set one
    char hostname[64] = {};

    static host_identity of_this_process() {
        host_identity id;
        std::ifstream in("/proc/sys/kernel/random/boot_id");
        std::string boot;
        std::getline(in, boot);
        std::strncpy(id.boot_id, boot.c_str(), sizeof id.boot_id - 1);
        id.uid = static_cast<std::uint32_t>(::getuid());
        struct stat st {};
        if (::stat("/proc/self/ns/net", &st) == 0) id.netns = static_cast<std::uint64_t>(st.st_ino);
        id.pid = static_cast<std::int32_t>(::getpid());
        if (const char* rank = std::getenv("RANK")) id.global_rank = std::atoi(rank);
        ::gethostname(id.hostname, sizeof id.hostname - 1);
        return id;
    }
    bool known() const { return boot_id[0] != 0 && netns != 0; }
    bool operator==(const host_identity& o) const {
        return std::memcmp(boot_id, o.boot_id, sizeof boot_id) == 0 && uid == o.uid && netns == o.netns;
    }
};

// "rank 0 (RANK=4, host h1, pid 1234)": a peer as messages about its death name it - its rank
// in the group, the launcher's RANK (its global rank) where it set one, its host and process.
inline std::string describe_peer(int group_rank, const host_identity& id) {
    std::string hostname(id.hostname, strnlen(id.hostname, sizeof id.hostname));
    return "rank " + std::to_string(group_rank) + " (" +
           (id.global_rank >= 0 ? "RANK=" + std::to_string(id.global_rank) + ", " : std::string()) + "host " +
           (hostname.empty() ? std::string("?") : hostname) + ", pid " + std::to_string(id.pid) + ")";
}

// Why `b` does not share `a`'s host, as the handshake reports it.
inline std::string other_host_reason(const host_identity& a, const host_identity& b) {
    return std::memcmp(a.boot_id, b.boot_id, sizeof a.boot_id) != 0 ? "another host (boot id differs)"
           : a.uid != b.uid                                        ? "another user"
                                                                   : "another network namespace";
}

}  // namespace spbcast::detail
