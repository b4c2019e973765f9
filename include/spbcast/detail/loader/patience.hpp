// Patience: how long a rank of the leader loader waits for a peer, and what it says when the wait
// ends. A leader still producing its batch (or its loader) sends keep-alive frames, so the
// followers wait for it as a BASE rank waits for its own loader (keep_while_working); a peer busy
// outside the loader - saving a checkpoint, evaluating - gets root_wait, the SP group's own
// timeout unless loader_config::root_wait says otherwise (loader_patience's constructor); a
// follower whose wait for the leader's first message ends says so in the loader's terms
// (broadcast_from_leader).
#pragma once

#include "../../broadcast.hpp"
#include "../../dist.hpp"
#include "../../error.hpp"
#include "../../options.hpp"
#include "../orchestration/keep_alive.hpp"

#include <chrono>
#include <string>
#include <utility>

namespace spbcast::detail {

class loader_patience {
public:
    // `broadcasts`: the options of the loader's broadcasts but root_wait; `root_wait`:
    // loader_config::root_wait; `where`: how this rank's messages begin.
    template <class Group>
    loader_patience(Group& group, options broadcasts, std::chrono::milliseconds root_wait, std::string where,
                    bool leader)
        : options_(broadcasts), where_(std::move(where)), leader_(leader) {
        choose_root_wait(group, root_wait);
    }

    const options& broadcast_options() const { return options_; }

    // Runs the leader's `work` (building its loader, fetching a batch) while keep-alive frames tell
    // the followers on `group` that it is still working.
    template <class G, class Work>
    void keep_while_working(G& group, Work&& work) const {
        keep_alive<G> still_working(group, options_);
        work();
    }

    // broadcast(value) from the leader. A follower that waited root_wait for the leader's first
    // message says so in the loader's terms: the leader is hung, or busy outside the loader for
    // longer than the group allows.
    template <class G, class T>
    void broadcast_from_leader(G& group, T& value, const std::string& what) const {
        try {
            broadcast(value, group, options_);
        } catch (const transport_error& e) {
            if (leader_ || e.code() != errc::timeout || e.phase() != "frame") throw;
            const std::string said = e.what();  // its first line: its advice is about broadcast()
            throw transport_error(
                errc::timeout,
                where_ + ": the SP leader (SP rank 0) sent nothing for " + what + " within " +
                    std::to_string(options_.root_wait.count()) + " ms (" + root_wait_source_ +
                    "). A leader busy outside the loader (saving a checkpoint, evaluating) must be "
                    "back within that time: raise loader_config::root_wait or the SP group's "
                    "timeout; if the leader hangs, restart the job. The transport said: " +
                    said.substr(0, said.find('\n')),
                e.phase());
        }
    }

private:
    // A rank waits for a peer busy outside the loader as long as BASE would: the SP group's own
    // timeout (see loader_config::root_wait).
    template <class Group>
    void choose_root_wait(Group& group, std::chrono::milliseconds asked) {
        if (asked.count() > 0) {
            options_.root_wait = asked;
            root_wait_source_ = "loader_config::root_wait";
            return;
        }
        const auto own = dist::group_timeout(group);
        options_.root_wait = own.value_or(options_.timeout);
        root_wait_source_ = own ? "the SP group's own timeout"
                                : "loader_config::timeout; the SP group does not say its own timeout";
    }

    options options_;
    const char* root_wait_source_ = "";
    std::string where_;
    bool leader_;
};

}  // namespace spbcast::detail
