// What spbcast remembers about a group between broadcasts: how many broadcasts it has carried
// (every header carries the root's count and followers check it against their own) and, once
// this rank could not finish a broadcast's announced collectives, why. Gloo matches messages
// by order and aborts the process on a size mismatch, so a rank that is out of step must never
// issue another collective on that group: every later call raises the original cause at once.
#pragma once

#include "../../error.hpp"

#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <unordered_map>
#include <vector>

namespace spbcast::detail {

class death_board;

struct group_state {
    std::uint64_t broadcasts = 0;  // calls that issued collectives on this group, on this rank
    std::optional<errc> broken;    // set when this rank left the group out of step
    std::string broken_cause;
    std::vector<int> peers;        // process ids of the ranks on this host, watched (peer_watch.hpp)
    std::shared_ptr<death_board> board;  // where other hosts tell a death (death_board.hpp), or null
};

// Entries are keyed by the group object's address. For c10d groups (intrusive_ptr targets)
// an entry holds a weak reference: the memory of a destroyed group cannot be reused while it
// is held, and the entry is dropped once the group is gone, so a new group never inherits an
// old one's count or broken mark. Other transports are keyed by address alone; their owners
// call spbcast::forget_group when destroying one (see group.hpp).
class group_registry {
public:
    static group_registry& instance() {
        static auto* registry = new group_registry();  // never destroyed: groups may outlive main
        return *registry;
    }

    template <class Group>
    std::shared_ptr<group_state> state_of(Group& group) {
        std::vector<owner_ref> released;  // dropped after the lock: may destroy a group
        std::lock_guard<std::mutex> lock(mutex_);
        for (auto it = entries_.begin(); it != entries_.end();) {
            if (it->second.owner && it->second.owner->expired()) {
                released.push_back(std::move(*it->second.owner));
                it = entries_.erase(it);
            } else {
                ++it;
            }
        }
        entry& e = entries_[static_cast<const void*>(&group)];
        // Another object at a forgotten address: a different type, rank or size is a new group.
        if (e.state && !e.owner &&
            (e.type != &typeid(Group) || e.rank != group.getRank() || e.size != group.getSize()))
            e = entry{};
        if (!e.state) {
            e.type = &typeid(Group);
            e.rank = group.getRank();
            e.size = group.getSize();
            e.state = std::make_shared<group_state>();
            if constexpr (std::is_base_of_v<c10::intrusive_ptr_target, Group>) {
                // A group on the stack has no owner to watch (its count is zero).
                if (c10::raw::intrusive_ptr::use_count(&group) > 0)
                    e.owner.emplace(c10::intrusive_ptr<c10::intrusive_ptr_target>(
                        c10::intrusive_ptr<Group>::unsafe_reclaim_from_nonowning(&group)));
            }
        }
        return e.state;
    }

    void forget(const void* group) {
        std::optional<owner_ref> released;
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = entries_.find(group);
        if (it == entries_.end()) return;
        released = std::move(it->second.owner);
        entries_.erase(it);
    }

private:
    using owner_ref = c10::weak_intrusive_ptr<c10::intrusive_ptr_target>;
    struct entry {
        std::shared_ptr<group_state> state;
        std::optional<owner_ref> owner;
        const std::type_info* type = nullptr;
        int rank = -1, size = -1;
    };
    std::mutex mutex_;
    std::unordered_map<const void*, entry> entries_;
};

}  // namespace spbcast::detail
