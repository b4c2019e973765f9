// Every failure spbcast reports is a spbcast::error (or a subclass), with a message that names
// the rank, the field path when there is one, and what to do about it.
#pragma once

#include <stdexcept>
#include <string>

namespace spbcast {

// Machine-readable reason of an error; the message says the same in words.
enum class errc {
    unsupported_value,   // a value that cannot be sent (CUDA/sparse tensor, bad IValue tag, ...)
    limit_exceeded,      // a frame or value beyond the configured spbcast::limits
    corrupt_frame,       // a frame that fails validation (bad magic, checksum, bounds)
    version_mismatch,    // a frame from another wire-format version
    schema_mismatch,     // leader and follower were built with different batch types
    payload_corrupt,     // payload checksum mismatch (options.checksum)
    remote,              // the root failed; this rank raises the root's message
    transport,           // the process group failed: dead peer, connection reset
    timeout,             // a wait ran past options.timeout
    invalid_argument,    // bad options or configuration
    loader,              // the data loader threw
    out_of_step,         // this rank and the root disagree on the broadcast count or options
};

inline const char* to_string(errc code) {
    switch (code) {
        case errc::unsupported_value: return "unsupported value";
        case errc::limit_exceeded: return "limit exceeded";
        case errc::corrupt_frame: return "corrupt frame";
        case errc::version_mismatch: return "version mismatch";
        case errc::schema_mismatch: return "schema mismatch";
        case errc::payload_corrupt: return "payload corrupt";
        case errc::remote: return "remote error";
        case errc::transport: return "transport error";
        case errc::timeout: return "timeout";
        case errc::invalid_argument: return "invalid argument";
        case errc::loader: return "loader error";
        case errc::out_of_step: return "out of step";
    }
    return "error";
}

class error : public std::runtime_error {
public:
    error(errc code, const std::string& message) : std::runtime_error(message), code_(code) {}
    errc code() const noexcept { return code_; }

private:
    errc code_;
};

// Raised on every non-root rank when the root failed before sending the batch. The root's own
// message (with its field path) is kept whole in root_message().
class remote_error : public error {
public:
    remote_error(const std::string& message, int root_rank, std::string root_message)
        : error(errc::remote, message), root_rank_(root_rank),
          root_message_(std::move(root_message)) {}
    int root_rank() const noexcept { return root_rank_; }
    const std::string& root_message() const noexcept { return root_message_; }

private:
    int root_rank_;
    std::string root_message_;
};

// Raised by a follower whose batch type differs from the root's; the payload was drained, so
// the group stays in step.
class schema_error : public error {
public:
    schema_error(const std::string& message, std::string local_schema, std::string root_schema)
        : error(errc::schema_mismatch, message), local_schema_(std::move(local_schema)),
          root_schema_(std::move(root_schema)) {}
    const std::string& local_schema() const noexcept { return local_schema_; }
    const std::string& root_schema() const noexcept { return root_schema_; }

private:
    std::string local_schema_;
    std::string root_schema_;
};

// Raised when the process group fails or a wait times out, and by every later call on a group
// this rank could not keep in step (the same code, the original cause in the message).
class transport_error : public error {
public:
    transport_error(errc code, const std::string& message, std::string phase)
        : error(code, message), phase_(std::move(phase)) {}
    const std::string& phase() const noexcept { return phase_; }

private:
    std::string phase_;
};

}  // namespace spbcast
