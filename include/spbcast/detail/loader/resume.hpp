// Resume: the loop's position - the epoch, the steps consumed and the batches taken in the
// current epoch - and the checkpoint state that carries it across a restart:
//     spbcast.leader_loader v1 epoch=E step=S in_epoch=I\n<the loader's own save_state()>
// The trainer's thread keeps the position of the last batch next() returned; the prefetch
// thread keeps its own (how far it fetched ahead).
#pragma once

#include "../../error.hpp"

#include <cstdint>
#include <sstream>
#include <string>
#include <string_view>

namespace spbcast::detail {

class loader_position {
public:
    std::int64_t epoch() const { return epoch_; }
    std::int64_t step() const { return step_; }
    std::int64_t in_epoch() const { return in_epoch_; }  // batches taken in the current epoch

    void count_batch() {
        ++step_;
        ++in_epoch_;
    }

    void next_epoch() {
        ++epoch_;
        in_epoch_ = 0;
    }

    // The counters of a step the leader sent (a follower's in_epoch is not kept: it saves no state).
    void take_leaders(std::int64_t epoch, std::int64_t step) {
        epoch_ = epoch;
        step_ = step;
    }

    // The checkpoint state: this position, then the loader's own state.
    std::string save(std::string_view loader_state) const {
        std::ostringstream out;
        out << "spbcast.leader_loader v1 epoch=" << epoch_ << " step=" << step_ << " in_epoch=" << in_epoch_
            << "\n";
        out << loader_state;
        return out.str();
    }

    // The position a state of save() holds; `loader_state` gets the loader's own state after it.
    // `where`: how this rank's messages begin.
    static loader_position load(std::string_view state, std::string_view& loader_state, const std::string& where) {
        const auto newline = state.find('\n');
        std::istringstream header(std::string(state.substr(0, newline)));
        std::string magic, version, epoch, step, in_epoch;
        header >> magic >> version >> epoch >> step >> in_epoch;
        if (magic != "spbcast.leader_loader" || version != "v1" || epoch.rfind("epoch=", 0) != 0 ||
            step.rfind("step=", 0) != 0 || in_epoch.rfind("in_epoch=", 0) != 0 ||
            newline == std::string_view::npos)
            throw error(errc::invalid_argument,
                        where + ": load_state got a state that leader_loader::save_state did not "
                                "write; pass the string that save_state returned on the SP leader");
        loader_position at;
        at.epoch_ = std::stoll(epoch.substr(6));
        at.step_ = std::stoll(step.substr(5));
        at.in_epoch_ = std::stoll(in_epoch.substr(9));
        loader_state = state.substr(newline + 1);
        return at;
    }

    // Saved right after an epoch's last batch: the continuous run would end that pass at its next
    // fetch, so the resumed run starts the next epoch. `length`: batches per epoch (-1: unknown).
    bool saved_at_epoch_end(std::int64_t length) const { return length > 0 && in_epoch_ >= length; }

private:
    std::int64_t epoch_ = 0, step_ = 0, in_epoch_ = 0;
};

}  // namespace spbcast::detail
