// The leaf kinds: tensors, bools, integers, floating point numbers, enums and strings
// (the contract: kind_traits.hpp).
#pragma once

#include "kind_traits.hpp"
#include "type_name.hpp"

#include <ATen/ATen.h>

#include <cstring>
#include <string>
#include <type_traits>

namespace spbcast::detail {

// A u32 index into the frame's tensor table (wire_tables.hpp), or undefined_tensor.
template <>
struct kind_traits<kind::tensor> {
    template <class T>
    static constexpr bool matches = std::is_same_v<T, at::Tensor>;
    template <class T>
    static constexpr void schema(schema_builder& out) { out += "tensor"; }
    template <class T>
    static constexpr std::size_t min_bytes() { return 4; }
    template <class T>
    static void encode(auto& out, const T& v) { out.tensor(v); }
    template <class T>
    static void decode(auto& in, T& v) { v = in.tensor(); }
    template <class T>
    static void compare(auto& same, const T& a, const T& b, const std::string& path) {
        same.tensor(a, b, path);
    }
};

// One byte, 0 or 1.
template <>
struct kind_traits<kind::boolean> {
    template <class T>
    static constexpr bool matches = std::is_same_v<T, bool>;
    template <class T>
    static constexpr void schema(schema_builder& out) { out += "bool"; }
    template <class T>
    static constexpr std::size_t min_bytes() { return 1; }
    template <class T>
    static void encode(auto& out, const T& v) { out.flag(v); }
    template <class T>
    static void decode(auto& in, T& v) { v = in.flag(); }
    template <class T>
    static void compare(auto& same, const T& a, const T& b, const std::string& path) {
        same.expect(a == b, path);
    }
};

// Integers, floating point numbers and enums travel as their little-endian bytes.
struct scalar_traits {
    template <class T>
    static constexpr std::size_t min_bytes() { return sizeof(T); }
    template <class T>
    static void encode(auto& out, const T& v) { out.scalar(v); }
    template <class T>
    static void decode(auto& in, T& v) { in.scalar(v); }
    template <class T>
    static void compare(auto& same, const T& a, const T& b, const std::string& path) {
        same.expect(a == b, path);
    }
};

template <>
struct kind_traits<kind::integer> : scalar_traits {
    template <class T>
    static constexpr bool matches = std::is_integral_v<T>;
    // By width and sign, so int64_t, long and long long agree; char keeps its own name
    // because its signedness differs between platforms.
    template <class T>
    static constexpr void schema(schema_builder& out) {
        if constexpr (std::is_same_v<T, char>) {
            out += "char";
        } else {
            out += std::is_signed_v<T> ? 'i' : 'u';
            append_number(out, sizeof(T) * 8);
        }
    }
};

template <>
struct kind_traits<kind::floating> : scalar_traits {
    template <class T>
    static constexpr bool matches = std::is_floating_point_v<T>;
    template <class T>
    static constexpr void schema(schema_builder& out) {
        out += 'f';
        append_number(out, sizeof(T) * 8);
    }
    // As bits: a NaN equals itself, and -0.0 differs from 0.0.
    template <class T>
    static void compare(auto& same, const T& a, const T& b, const std::string& path) {
        same.expect(std::memcmp(&a, &b, sizeof a) == 0, path);
    }
};

template <>
struct kind_traits<kind::enumeration> : scalar_traits {
    template <class T>
    static constexpr bool matches = std::is_enum_v<T>;
    template <class T>
    static constexpr void schema(schema_builder& out) {
        out += "enum ";
        out += type_name<T>();
        out += ':';
        append_schema<std::underlying_type_t<T>>(out);
    }
    template <class T>
    static constexpr std::size_t min_bytes() { return sizeof(std::underlying_type_t<T>); }
};

// A u64 length, then the bytes.
template <>
struct kind_traits<kind::string> {
    template <class T>
    static constexpr bool matches = std::is_same_v<T, std::string>;
    template <class T>
    static constexpr void schema(schema_builder& out) { out += "str"; }
    template <class T>
    static constexpr std::size_t min_bytes() { return 8; }
    template <class T>
    static void encode(auto& out, const T& v) { out.string(v); }
    template <class T>
    static void decode(auto& in, T& v) { v = in.string(); }
    template <class T>
    static void compare(auto& same, const T& a, const T& b, const std::string& path) {
        same.expect(a == b, path);
    }
};

}  // namespace spbcast::detail
