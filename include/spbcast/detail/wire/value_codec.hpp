// Encodes a value's non-tensor content into the frame (tensors become table indices), and
// decodes it back on a follower. Each kind says how its values travel (kinds.hpp); both sides
// walk the type the same way, so the stream carries no tags: the schema fingerprint
// guarantees both sides walk the same type.
//
// The stream's vocabulary, which the kinds compose:
//   flag    u8, 0 or 1 (a bool, an optional's presence)
//   index   u32 (a variant's alternative)
//   scalar  its little-endian bytes (integers, floating point, enums, bucket layouts)
//   count   u64, bounded by limits.max_container_size (and, decoding, by the bytes left)
//   string  u64 length, bounded by limits.max_string_bytes, then the bytes
//   tensor  u32 index into the tensor table (0xffffffff: undefined)
#pragma once

#include "../../error.hpp"
#include "../../options.hpp"
#include "bytes.hpp"
#include "field_path.hpp"
#include "kinds.hpp"
#include "send_plan.hpp"
#include "wire_tables.hpp"

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace spbcast::detail {

class encoder {
public:
    encoder(byte_writer& out, send_plan& plan, const limits& lim)
        : out_(out), plan_(plan), limits_(lim) {}

    template <class T>
    void value(const T& v) {
        kind_traits<kind_v<T>>::encode(*this, v);
    }

    void flag(bool b) { out_.put<std::uint8_t>(b ? 1 : 0); }
    void index(std::uint32_t i) { out_.put<std::uint32_t>(i); }
    template <class T>
    void scalar(const T& v) {
        out_.put(v);
    }
    void bytes(const void* data, std::size_t size) { out_.put_bytes(data, size); }

    void count(std::uint64_t n) {
        if (n > limits_.max_container_size)
            fail(errc::limit_exceeded, "a container of " + std::to_string(n) +
                                           " elements exceeds limits.max_container_size = " +
                                           std::to_string(limits_.max_container_size) +
                                           "; raise it on every rank");
        out_.put<std::uint64_t>(n);
    }

    void string(const std::string& s) {
        if (s.size() > limits_.max_string_bytes)
            fail(errc::limit_exceeded, "a string of " + std::to_string(s.size()) +
                                           " bytes exceeds limits.max_string_bytes; raise it on "
                                           "every rank");
        out_.put_string(s);
    }

    void tensor(const at::Tensor& t) { index(plan_.add(t, limits_, [&] { return path_.str(); })); }

    // A part of the value, named in error paths: batch[3], batch["key"], batch.field.
    template <class T>
    void element(std::uint64_t i, const T& v) {
        path_.push_index(i);
        value(v);
        path_.pop();
    }
    template <class T>
    void keyed(std::string key, const T& v) {
        path_.push_key(std::move(key));
        value(v);
        path_.pop();
    }
    template <class T>
    void field(std::string_view name, std::size_t position, const T& v) {
        path_.push_field(name, position);
        value(v);
        path_.pop();
    }

    field_path& path() { return path_; }
    byte_writer& writer() { return out_; }
    const limits& bounds() const { return limits_; }

    [[noreturn]] void fail(errc code, const std::string& what) {
        throw error(code, "cannot send " + path_.str() + ": " + what);
    }

private:
    byte_writer& out_;
    send_plan& plan_;
    const limits& limits_;
    field_path path_;
};

// ---------------------------------------------------------------------------------------------

class decoder {
public:
    decoder(byte_reader& in, const std::vector<at::Tensor>& tensors, const limits& lim)
        : in_(in), tensors_(tensors), limits_(lim) {}

    template <class T>
    void value(T& v) {
        kind_traits<kind_v<T>>::decode(*this, v);
    }

    // A new T from the stream. A type without a default constructor is built by its kind
    // from its parts: a codec's type from its wire value, a tuple or an aggregate from its
    // fields in order.
    template <class T>
    T make() {
        using traits = kind_traits<kind_v<T>>;
        if constexpr (std::is_default_constructible_v<T>) {
            T v{};
            value(v);
            return v;
        } else if constexpr (requires { traits::template make<T>(*this); }) {
            return traits::template make<T>(*this);
        } else {
            static_assert(std::is_default_constructible_v<T>,
                          "spbcast: followers must be able to build this type: give it a default "
                          "constructor or send it through spbcast::codec<T>");
        }
    }

    bool flag() {
        const auto b = in_.get<std::uint8_t>();
        if (b > 1) fail("a bool or presence byte of value " + std::to_string(b));
        return b == 1;
    }
    std::uint32_t index() { return in_.get<std::uint32_t>(); }
    template <class T>
    void scalar(T& v) {
        v = in_.get<T>();
    }
    const std::uint8_t* bytes(std::size_t size) { return in_.get_bytes(size); }

    std::uint64_t count(std::size_t min_element_bytes) {
        return in_.get_count(limits_.max_container_size, min_element_bytes, "container size");
    }

    std::string string() { return in_.get_string(limits_.max_string_bytes); }

    at::Tensor tensor() {
        const std::uint32_t i = index();
        if (i == undefined_tensor) return at::Tensor();
        if (i >= tensors_.size()) fail("tensor index " + std::to_string(i) + " out of range");
        return tensors_[i];
    }

    // A part of the value, named in error paths (see encoder).
    template <class T>
    void element(std::uint64_t i, T& v) {
        path_.push_index(i);
        value(v);
        path_.pop();
    }
    template <class T>
    void field(std::string_view name, std::size_t position, T& v) {
        path_.push_field(name, position);
        value(v);
        path_.pop();
    }
    template <class T>
    T make_element(std::uint64_t i) {
        path_.push_index(i);
        T v = make<T>();
        path_.pop();
        return v;
    }
    template <class T>
    T make_field(std::string_view name, std::size_t position) {
        path_.push_field(name, position);
        T v = make<T>();
        path_.pop();
        return v;
    }

    byte_reader& reader() { return in_; }
    const limits& bounds() const { return limits_; }

    [[noreturn]] void fail(const std::string& what) {
        in_.fail(what + " while decoding " + path_.str());
    }

private:
    byte_reader& in_;
    const std::vector<at::Tensor>& tensors_;
    const limits& limits_;
    field_path path_;
};

}  // namespace spbcast::detail
