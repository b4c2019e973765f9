// A root that is still producing its batch says so. A follower's wait for the frame is a
// transport wait, bounded by options.timeout (and, with LibTorch 1.13's Gloo, by the group's own
// timeout, which no per-call option can lift); a leader that takes longer to load a batch - a
// big video, a checkpoint saved on the leader - must not look like a dead peer. While a
// keep_alive lives on the root, it sends a keep-alive frame every quarter of options.timeout
// (or of options.root_wait, where that is shorter);
// followers receive it and go on waiting for the real frame, as a BASE rank waits for its own
// loader. A dead root still fails at once (its sockets close).
#pragma once

#include "../../group.hpp"
#include "../../options.hpp"
#include "../transport/collective.hpp"
#include "../wire/frame.hpp"
#include "../transport/group_state.hpp"
#include "send.hpp"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace spbcast::detail {

// One keep-alive frame, carrying the number of the broadcast it precedes.
template <class Group>
void send_keep_alive(Group& group, const options& opts) {
    const auto state = group_registry::instance().state_of(group);
    if (state->broken) return;  // the next broadcast raises why
    collective<Group> c(group, opts, *state, state->broadcasts + 1);
    frame_header header;
    header.status = static_cast<std::uint16_t>(frame_status::keep_alive);
    send_frame(c, header, {});
    c.wait_all();
}

template <class GroupArg>
class keep_alive {
public:
    keep_alive(GroupArg& group, const options& opts) {
        auto& g = group_of(group);
        if (g.getSize() == 1 || g.getRank() != opts.root) return;
        // Followers wait root_wait for each frame, and each send is bounded by timeout.
        const auto interval = std::max<std::chrono::milliseconds>(
            std::min(opts.timeout, opts.root_wait_or_timeout()) / 4, std::chrono::milliseconds(1));
        thread_ = std::thread([this, &g, opts, interval] {
            std::unique_lock<std::mutex> lock(mutex_);
            while (!wake_.wait_for(lock, interval, [&] { return stop_; })) {
                lock.unlock();
                try {
                    send_keep_alive(g, opts);
                } catch (...) {
                    return;  // the group is marked broken; the next broadcast raises the cause
                }
                lock.lock();
            }
        });
    }
    keep_alive(const keep_alive&) = delete;
    keep_alive& operator=(const keep_alive&) = delete;

    ~keep_alive() {
        if (!thread_.joinable()) return;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            stop_ = true;
        }
        wake_.notify_all();
        thread_.join();
    }

private:
    std::mutex mutex_;
    std::condition_variable wake_;
    bool stop_ = false;
    std::thread thread_;
};

}  // namespace spbcast::detail
