// Test transports for the fault tests and the fuzz corpus, and the frames they carry. None of
// them is a mock of spbcast: each one is a group that spbcast drives through its public
// process_group concept, and each either forwards to a real Gloo group (and then tampers with,
// delays or kills the traffic) or records and replays the exact messages a real root sends, so
// a follower's decoding can be fed hostile bytes without a network.
#pragma once

#include <spbcast/broadcast.hpp>

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <functional>
#include <span>
#include <stdexcept>
#include <string>
#include <typeinfo>
#include <vector>

namespace spbcast_fault {

// ---------------------------------------------------------------------------------------------
// A group that forwards every broadcast to a real group and calls a hook around it.
//
// `before(call, tensors)` runs before the broadcast is handed to the real group (call counts
// from 1 per broadcast() call of spbcast, i.e. per message: frame, frame body, payload slots,
// checksums). `after(call, tensors)` runs once the real broadcast has completed and before
// spbcast sees it, so it can change what "arrived". With an `after` hook the broadcast is
// waited for here, synchronously (the transport then has no overlap; the tests do not care).
template <class Inner>
class hooked_group {
public:
    using hook = std::function<void(int call, std::vector<at::Tensor>& tensors)>;

    hooked_group(Inner& inner, hook before = {}, hook after = {})
        : inner_(inner), before_(std::move(before)), after_(std::move(after)) {}
    hooked_group(const hooked_group&) = delete;
    // spbcast knows a transport of ours by its address (spbcast::forget_group).
    ~hooked_group() { spbcast::forget_group(*this); }

    int getRank() const { return inner_.getRank(); }
    int getSize() const { return inner_.getSize(); }

    c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                             const c10d::BroadcastOptions& opts) {
        const int call = ++calls_;
        if (before_) before_(call, tensors);
        auto work = inner_.broadcast(tensors, opts);
        if (after_) {
            work->wait(opts.timeout);
            after_(call, tensors);
        }
        return work;
    }

    int calls() const { return calls_; }
    void reset_calls() { calls_ = 0; }

private:
    Inner& inner_;
    hook before_, after_;
    int calls_ = 0;
};

// Rewrites the header of a frame message the root is about to send (its first message of a
// broadcast) and re-signs it, as a root speaking another wire-format version would.
inline void rewrite_header(at::Tensor& frame_message,
                           const std::function<void(spbcast::detail::frame_header&)>& change) {
    spbcast::detail::frame_header header;
    std::memcpy(&header, frame_message.data_ptr(), sizeof header);
    change(header);
    header.header_checksum = header.compute_checksum();
    std::memcpy(frame_message.data_ptr(), &header, sizeof header);
}

inline void flip_bit(at::Tensor& message, std::size_t bit) {
    auto* bytes = static_cast<std::uint8_t*>(message.data_ptr());
    const std::size_t n = static_cast<std::size_t>(message.numel() * message.element_size());
    bytes[(bit / 8) % n] ^= static_cast<std::uint8_t>(1u << (bit % 8));
}

// ---------------------------------------------------------------------------------------------
// In-process record and replay of one broadcast, with no network.

// A work handle that is complete on arrival.
struct done_work {
    bool wait(std::chrono::milliseconds = std::chrono::milliseconds(0)) { return true; }
};

// The root of a two-rank group whose "network" records each message the root sends.
class capture_group {
public:
    capture_group() = default;
    capture_group(const capture_group&) = delete;
    ~capture_group() { spbcast::forget_group(*this); }
    int getRank() const { return 0; }
    int getSize() const { return 2; }
    done_work broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions&) {
        const at::Tensor& t = tensors.at(0);
        const auto* p = static_cast<const std::uint8_t*>(t.data_ptr());
        messages.emplace_back(p, p + t.numel() * t.element_size());
        return {};
    }
    std::vector<std::vector<std::uint8_t>> messages;
};

// How many leading messages of a recording are the frame.
inline std::size_t frame_message_count(const std::vector<std::vector<std::uint8_t>>& messages) {
    spbcast::detail::frame_header header;
    std::memcpy(&header, messages.at(0).data(), sizeof header);
    return header.body_bytes > spbcast::detail::inline_body_bytes ? 2 : 1;
}

// The messages to replay, as views of the caller's buffers: a test puts thousands of changed
// frames in front of one recording's payload (megabytes), which copying would dominate.
class message_list {
public:
    using messages = std::vector<std::vector<std::uint8_t>>;
    message_list(const messages& all) { append(all, 0); }  // NOLINT: implicit on purpose
    // The messages of `frame`, then the payload that follows the frame of `recording`.
    message_list(const messages& frame, const messages& recording) {
        append(frame, 0);
        append(recording, frame_message_count(recording));
    }
    const std::vector<std::span<const std::uint8_t>>& views() const { return views_; }

private:
    void append(const messages& from, std::size_t first) {
        for (std::size_t i = first; i < from.size(); ++i) views_.emplace_back(from[i]);
    }
    std::vector<std::span<const std::uint8_t>> views_;
};

// A follower of a two-rank group whose "network" delivers recorded messages in order. A
// receive whose size differs from the next message, or past the last one, fails the way a
// transport fails (std::runtime_error from broadcast()), which spbcast reports as a
// transport_error.
class replay_group {
public:
    explicit replay_group(const message_list& messages) : messages_(messages.views()) {}
    replay_group(const replay_group&) = delete;
    ~replay_group() { spbcast::forget_group(*this); }
    int getRank() const { return 1; }
    int getSize() const { return 2; }
    done_work broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions&) {
        at::Tensor& t = tensors.at(0);
        if (next_ >= messages_.size())
            throw std::runtime_error("replay: the root sent nothing more");
        const auto& m = messages_[next_++];
        const auto want = static_cast<std::size_t>(t.numel() * t.element_size());
        if (m.size() != want)
            throw std::runtime_error("replay: message of " + std::to_string(m.size()) +
                                     " bytes for a receive of " + std::to_string(want));
        if (want != 0) std::memcpy(t.data_ptr(), m.data(), want);
        return {};
    }

private:
    std::vector<std::span<const std::uint8_t>> messages_;
    std::size_t next_ = 0;
};

// The messages a real root sends for `value`.
template <class T>
std::vector<std::vector<std::uint8_t>> record(const T& value, const spbcast::options& opts = {}) {
    capture_group root;
    T copy = value;  // broadcast takes T&; the root leaves it unchanged
    spbcast::broadcast(copy, root, opts);
    return std::move(root.messages);
}

// The frame of a recording as header and body (the first message, plus the frame-body message
// when the body did not fit inline).
struct frame_parts {
    spbcast::detail::frame_header header;
    std::vector<std::uint8_t> body;
};

inline frame_parts split_frame(const std::vector<std::vector<std::uint8_t>>& messages) {
    using namespace spbcast::detail;
    frame_parts parts;
    std::memcpy(&parts.header, messages.at(0).data(), sizeof parts.header);
    const std::size_t inline_part = std::min<std::size_t>(parts.header.body_bytes, inline_body_bytes);
    parts.body.assign(messages[0].begin() + sizeof(frame_header),
                      messages[0].begin() + sizeof(frame_header) + inline_part);
    if (parts.header.body_bytes > inline_part)
        parts.body.insert(parts.body.end(), messages.at(1).begin(), messages[1].end());
    return parts;
}

// Rebuilds the frame messages from a (possibly changed) header and body, re-signed like a real
// root would: a hostile root, not a noisy wire (a noisy wire is caught by the checksums).
inline std::vector<std::vector<std::uint8_t>> join_frame(frame_parts parts, bool resign = true) {
    using namespace spbcast::detail;
    if (resign) {
        parts.header.body_bytes = parts.body.size();
        parts.header.body_checksum = checksum64(parts.body.data(), parts.body.size());
        parts.header.header_checksum = parts.header.compute_checksum();
    }
    std::vector<std::vector<std::uint8_t>> out(1, std::vector<std::uint8_t>(inline_frame_bytes, 0));
    std::memcpy(out[0].data(), &parts.header, sizeof parts.header);
    const std::size_t inline_part = std::min(parts.body.size(), inline_body_bytes);
    if (inline_part != 0) std::memcpy(out[0].data() + sizeof(frame_header), parts.body.data(), inline_part);
    if (parts.body.size() > inline_part)
        out.emplace_back(parts.body.begin() + static_cast<std::ptrdiff_t>(inline_part), parts.body.end());
    return out;
}

// What a follower did with a replayed (possibly hostile) recording.
enum class outcome { ok, spbcast_error, other_exception };

struct replay_result {
    outcome what = outcome::ok;
    spbcast::errc code{};
    std::string message;
};

template <class T>
replay_result replay(const message_list& messages, const spbcast::options& opts = {}, T* out = nullptr) {
    replay_group follower(messages);
    T value{};
    replay_result r;
    try {
        spbcast::broadcast(value, follower, opts);
        if (out) *out = std::move(value);
    } catch (const spbcast::error& e) {
        r.what = outcome::spbcast_error;
        r.code = e.code();
        r.message = e.what();
    } catch (const std::exception& e) {
        r.what = outcome::other_exception;
        r.message = std::string(typeid(e).name()) + ": " + e.what();
    }
    return r;
}


// ---------------------------------------------------------------------------------------------
// A frame taken apart into its documented fields (docs/wire-format.md), edited by a test, and
// put back together and re-signed: the frames a hostile or buggy root could send.

struct slot_row {
    std::uint8_t in_place = 0;  // the slot mode: 0 bucket, 1 in place, 2 in the frame
    std::uint64_t bytes = 0;
    bool in_frame() const { return in_place == 2; }
};
struct tensor_row {
    std::uint8_t dtype_code = 0, flags = 0;
    std::uint32_t storage = 0;
    std::int64_t offset = 0;
    std::vector<std::int64_t> sizes, strides;
};
struct storage_row {
    std::uint64_t nbytes = 0;
    std::uint8_t gather = 0;
    std::uint32_t slot = 0;
    std::uint64_t slot_offset = 0, wire_bytes = 0;
};

struct editable_frame {
    spbcast::detail::frame_header header;
    std::vector<slot_row> slots;
    std::string schema;
    std::vector<std::uint8_t> values;
    std::vector<tensor_row> tensors;
    std::vector<storage_row> storages;
    std::vector<std::vector<std::uint8_t>> payload;  // per slot: its bytes (message or in frame)

    static editable_frame from(const std::vector<std::vector<std::uint8_t>>& messages) {
        using namespace spbcast::detail;
        const frame_parts parts = split_frame(messages);
        editable_frame f;
        f.header = parts.header;
        byte_reader in(parts.body.data(), parts.body.size(), "editable_frame");
        const auto slot_count = in.get<std::uint32_t>();
        for (std::uint32_t i = 0; i < slot_count; ++i) {
            slot_row s;
            s.in_place = in.get<std::uint8_t>();
            s.bytes = in.get<std::uint64_t>();
            f.slots.push_back(s);
        }
        f.schema = in.get_string(~std::uint64_t{0});
        const auto value_bytes = in.get<std::uint64_t>();
        const auto* v = in.get_bytes(value_bytes);
        f.values.assign(v, v + value_bytes);
        const auto tensor_count = in.get<std::uint32_t>();
        for (std::uint32_t i = 0; i < tensor_count; ++i) {
            tensor_row t;
            t.dtype_code = in.get<std::uint8_t>();
            t.flags = in.get<std::uint8_t>();
            const auto dim = in.get<std::uint8_t>();
            t.storage = in.get<std::uint32_t>();
            t.offset = in.get<std::int64_t>();
            for (int d = 0; d < dim; ++d) t.sizes.push_back(in.get<std::int64_t>());
            for (int d = 0; d < dim; ++d) t.strides.push_back(in.get<std::int64_t>());
            f.tensors.push_back(std::move(t));
        }
        const auto storage_count = in.get<std::uint32_t>();
        for (std::uint32_t i = 0; i < storage_count; ++i) {
            storage_row s;
            s.nbytes = in.get<std::uint64_t>();
            s.gather = in.get<std::uint8_t>();
            s.slot = in.get<std::uint32_t>();
            s.slot_offset = in.get<std::uint64_t>();
            s.wire_bytes = in.get<std::uint64_t>();
            f.storages.push_back(s);
        }
        std::size_t next = frame_message_count(messages);
        for (const slot_row& slot : f.slots) {
            if (slot.in_frame()) {
                const auto* bytes = in.get_bytes(static_cast<std::size_t>(slot.bytes));
                f.payload.emplace_back(bytes, bytes + slot.bytes);
            } else {
                f.payload.push_back(messages.at(next++));
            }
        }
        return f;
    }

    std::vector<std::uint8_t> body() const {
        spbcast::detail::byte_writer out;
        out.put<std::uint32_t>(static_cast<std::uint32_t>(slots.size()));
        for (const auto& s : slots) {
            out.put(s.in_place);
            out.put(s.bytes);
        }
        out.put_string(schema);
        out.put<std::uint64_t>(values.size());
        out.put_bytes(values.data(), values.size());
        out.put<std::uint32_t>(static_cast<std::uint32_t>(tensors.size()));
        for (const auto& t : tensors) {
            out.put(t.dtype_code);
            out.put(t.flags);
            out.put(static_cast<std::uint8_t>(t.sizes.size()));
            out.put(t.storage);
            out.put(t.offset);
            for (auto v : t.sizes) out.put(v);
            for (auto v : t.strides) out.put(v);
        }
        out.put<std::uint32_t>(static_cast<std::uint32_t>(storages.size()));
        for (const auto& s : storages) {
            out.put(s.nbytes);
            out.put(s.gather);
            out.put(s.slot);
            out.put(s.slot_offset);
            out.put(s.wire_bytes);
        }
        for (std::size_t i = 0; i < slots.size(); ++i)
            if (slots[i].in_frame()) {
                const auto bytes = slot_bytes(i);
                out.put_bytes(bytes.data(), bytes.size());
            }
        return std::move(out.bytes());
    }

    // Slot i's bytes, as long as the slot: kept bytes, then a byte pattern.
    std::vector<std::uint8_t> slot_bytes(std::size_t i) const {
        std::vector<std::uint8_t> m = i < payload.size() ? payload[i] : std::vector<std::uint8_t>{};
        const auto old = m.size();
        m.resize(static_cast<std::size_t>(slots[i].bytes));
        for (std::size_t b = old; b < m.size(); ++b) m[b] = static_cast<std::uint8_t>(b * 37 + 11);
        return m;
    }

    std::uint32_t transferred_slots() const {
        return static_cast<std::uint32_t>(std::count_if(slots.begin(), slots.end(), [](const slot_row& s) { return !s.in_frame(); }));
    }

    // The messages a root would send for this frame: the frame (re-signed), then one payload
    // message per transferred slot, each as long as its slot, and the status trailer (status
    // ok; with the checksum flag its checksums are all zero: they will not match).
    std::vector<std::vector<std::uint8_t>> messages() const {
        auto out = frame_messages();
        for (std::size_t i = 0; i < slots.size(); ++i)
            if (!slots[i].in_frame()) out.push_back(slot_bytes(i));
        spbcast::detail::frame_header announced = header;
        announced.slot_count = transferred_slots();
        if (spbcast::detail::has_trailer(announced))
            out.emplace_back(spbcast::detail::trailer_bytes(transferred_slots(), header.flags), std::uint8_t{0});
        return out;
    }

    // Only the frame (for announcements too large to build the payload of).
    std::vector<std::vector<std::uint8_t>> frame_messages() const {
        frame_parts parts{header, body()};
        parts.header.slot_count = transferred_slots();
        return join_frame(std::move(parts));
    }
};

// A recording on disk, for replaying in a separate process (a frame that might crash the
// decoder must not take the test runner with it): u32 count, then per message u64 size and bytes.
inline void save_messages(const std::string& path, const std::vector<std::vector<std::uint8_t>>& messages) {
    std::FILE* f = std::fopen(path.c_str(), "wb");
    if (!f) throw std::runtime_error("cannot write " + path);
    const auto count = static_cast<std::uint32_t>(messages.size());
    std::fwrite(&count, sizeof count, 1, f);
    for (const auto& m : messages) {
        const auto size = static_cast<std::uint64_t>(m.size());
        std::fwrite(&size, sizeof size, 1, f);
        if (size) std::fwrite(m.data(), 1, m.size(), f);
    }
    std::fclose(f);
}

inline std::vector<std::vector<std::uint8_t>> load_messages(const std::string& path) {
    std::FILE* f = std::fopen(path.c_str(), "rb");
    if (!f) throw std::runtime_error("cannot read " + path);
    std::uint32_t count = 0;
    std::vector<std::vector<std::uint8_t>> messages;
    if (std::fread(&count, sizeof count, 1, f) == 1) {
        for (std::uint32_t i = 0; i < count; ++i) {
            std::uint64_t size = 0;
            if (std::fread(&size, sizeof size, 1, f) != 1 || size > (std::uint64_t{1} << 32)) break;
            std::vector<std::uint8_t> m(static_cast<std::size_t>(size));
            if (size && std::fread(m.data(), 1, m.size(), f) != m.size()) break;
            messages.push_back(std::move(m));
        }
    }
    std::fclose(f);
    return messages;
}

}  // namespace spbcast_fault
