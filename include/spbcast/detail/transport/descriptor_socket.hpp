// The socket a root (or a host leader) and each follower of its host talk over: one
// SOCK_SEQPACKET Unix socket per follower, carrying messages of one fixed size that may bring
// descriptors along (SCM_RIGHTS).
//
// Before the frame of a batch the root sends one message with the descriptors of every segment
// the batch lies in, their ids and the broadcast's number (a host leader on another host: after
// the frame, once the relay is in, with a progress message per chunk before it); a follower
// answers "released" (or "forked") with segment ids when the last storage over them is gone,
// and at the start of every broadcast sends a "released" with no ids that names the broadcast:
// everything it let go of before is reported (follower_links.hpp). Every send and receive here
// is bounded by the timeout its caller passes (options.timeout, or none at all).
#pragma once

#include "fork_safety.hpp"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace spbcast::detail {

inline constexpr std::uint32_t shm_message_magic = 0x4D485353;  // "SSHM"
// hello: a follower's first message (its rank). segments: the descriptors of one broadcast,
// sent before its frame. released / forked: a follower's answers, several ids each; forked
// means a child forked since the segment was mapped may still map it (fork_safety.hpp). A
// released with no ids and a sequence: the follower starts that broadcast, and has reported
// every segment it let go of before (follower_link::arrive).
// relay_progress: a host leader on another host has one more chunk of the broadcast `sequence`
// (capacity: chunks landed so far); its followers wait for each one in turn, never for the whole
// relay at once. The root sends its host's followers the same reports of the chunks it has sent
// (ids[0]: the relay's chunk count; the last report has capacity == ids[0]).
// relay_failed: that leader (or the root) is alive but cannot finish the relay; `ids` holds its
// error text (NUL-terminated), which its followers raise.
enum class shm_message_kind : std::uint32_t {
    hello = 1, segments = 2, released = 3, forked = 4, relay_progress = 5, relay_failed = 6
};
// The most segments one batch lies in (its own and the leader's shared allocations, see
// shm_allocator.hpp); further shared allocations of a batch are copied into its own segment.
inline constexpr std::size_t max_batch_segments = 32;

struct shm_message {
    std::uint32_t magic = shm_message_magic;
    shm_message_kind kind = shm_message_kind::hello;
    // segments: the broadcast whose frame it precedes - the one key that keeps the stream in
    // step with the frames (take_segments). hello: the follower's rank.
    std::uint64_t sequence = 0;
    std::uint32_t count = 0;        // ids below
    std::uint32_t descriptors = 0;  // attached (SCM_RIGHTS), one per id, for segments
    std::uint64_t capacity = 0;     // segments from a host leader (relayed): the segment's size
    std::uint64_t ids[max_batch_segments] = {};
};
static_assert(sizeof(shm_message) == 32 + 8 * max_batch_segments);

enum class send_status { sent, would_block, failed };

// Sends `m` with `fds` attached, waiting at most `timeout` for room in the socket (negative:
// not at all). Never raises SIGPIPE, never blocks past the bound.
inline send_status send_message(int sock, const shm_message& m, const std::vector<int>& fds,
                                std::chrono::milliseconds timeout) {
    if (fds.size() > max_batch_segments || sock < 0) return send_status::failed;
    iovec iov{const_cast<shm_message*>(&m), sizeof m};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * max_batch_segments)] = {};
    if (!fds.empty()) {
        msg.msg_control = control;
        msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
        cmsghdr* c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
        std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
        const ssize_t n = ::sendmsg(sock, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n == static_cast<ssize_t>(sizeof m)) return send_status::sent;
        if (n < 0 && errno == EINTR) continue;
        if (n >= 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) return send_status::failed;
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
        if (timeout.count() < 0 || left.count() <= 0) return send_status::would_block;
        pollfd p{sock, POLLOUT, 0};
        ::poll(&p, 1, static_cast<int>(std::min<std::int64_t>(left.count(), 1000)));
    }
}
inline bool send_message(int sock, const shm_message& m, std::chrono::milliseconds timeout) {
    return send_message(sock, m, {}, timeout) == send_status::sent;
}

// truncated: the message arrived whole, but the kernel dropped its descriptors (MSG_CTRUNC:
// this process is at its descriptor limit); its ids are valid.
enum class receive_status { ok, closed, timed_out, malformed, truncated };

// Receives one message within `timeout` (negative: do not wait). Every descriptor that arrives
// is either returned in `fds` (as many as the message says) or closed here, so nothing a peer
// sends can leak.
inline receive_status receive_message(int sock, shm_message& m, std::vector<owned_fd>& fds_out,
                                      std::chrono::milliseconds timeout) {
    fds_out.clear();
    if (sock < 0) return receive_status::closed;
    pollfd p{sock, POLLIN, 0};
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        const int r = ::poll(&p, 1, timeout.count() < 0 ? 0 : static_cast<int>(std::max<std::int64_t>(left.count(), 0)));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return receive_status::timed_out;
        break;
    }
    iovec iov{&m, sizeof m};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * max_batch_segments)] = {};
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    // A peer that closed while a message of this rank lay unread in its socket leaves
    // ECONNRESET pending here, reported once, before the messages it had sent: they are still
    // queued (a root that ends its path right after its broadcast returned, while a follower
    // has yet to read that broadcast's segments), and the next read returns them.
    ssize_t n;
    bool reset_reported = false;
    do n = ::recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    while (n < 0 && (errno == EINTR || (errno == ECONNRESET && !std::exchange(reset_reported, true))));
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return receive_status::timed_out;
    std::vector<owned_fd> fds;
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        const std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (std::size_t i = 0; i < count; ++i) {
            int received;
            std::memcpy(&received, CMSG_DATA(c) + i * sizeof(int), sizeof received);
            fds.emplace_back(received);
        }
    }
    if (n <= 0) return receive_status::closed;
    if (n != static_cast<ssize_t>(sizeof m) || m.magic != shm_message_magic || (msg.msg_flags & MSG_TRUNC) ||
        m.count > max_batch_segments || m.descriptors > m.count)
        return receive_status::malformed;
    if (msg.msg_flags & MSG_CTRUNC) return receive_status::truncated;
    if (fds.size() != m.descriptors) return receive_status::malformed;
    fds_out = std::move(fds);
    return receive_status::ok;
}

// The error text a relay_failed message carries (tell_followers, relay.hpp, writes it
// NUL-terminated).
inline std::string relay_failure_text(const shm_message& m) {
    const char* text = reinterpret_cast<const char*>(m.ids);
    return std::string(text, strnlen(text, sizeof m.ids));
}

}  // namespace spbcast::detail
