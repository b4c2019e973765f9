// Which host, user and network namespace a process runs in: ranks share the same-host path
// only when all three match the root's (an abstract socket lives in one network namespace).
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>

namespace spbcast::detail {

struct host_identity {
    char boot_id[40] = {};
    std::uint32_t uid = 0;
    std::uint32_t pad = 0;
    std::uint64_t netns = 0;

    static host_identity of_this_process() {
        host_identity id;
        std::ifstream in("/proc/sys/kernel/random/boot_id");
        std::string boot;
        std::getline(in, boot);
        std::strncpy(id.boot_id, boot.c_str(), sizeof id.boot_id - 1);
        id.uid = static_cast<std::uint32_t>(::getuid());
        struct stat st {};
        if (::stat("/proc/self/ns/net", &st) == 0) id.netns = static_cast<std::uint64_t>(st.st_ino);
        return id;
    }
    bool known() const { return boot_id[0] != 0 && netns != 0; }
    bool operator==(const host_identity& o) const {
        return std::memcmp(boot_id, o.boot_id, sizeof boot_id) == 0 && uid == o.uid && netns == o.netns;
    }
};

// Why `b` does not share `a`'s host, as the handshake reports it.
inline std::string other_host_reason(const host_identity& a, const host_identity& b) {
    return std::memcmp(a.boot_id, b.boot_id, sizeof a.boot_id) != 0 ? "another host (boot id differs)"
           : a.uid != b.uid                                        ? "another user"
                                                                   : "another network namespace";
}

}  // namespace spbcast::detail
