// The schema of a batch type: a canonical, readable description computed at compile time from
// the type alone, and its 64-bit fingerprint. The root sends both; a follower built with a
// different type sees the two schemas side by side in its error.
//
//   spbcast::schema_of<Batch>       -> "list<xtuner::Item{seq_ctx:xtuner::SequenceContext{...}}>"
//   spbcast::fingerprint_of<Batch>  -> FNV-1a 64 of the schema text
#pragma once

#include "detail/fields.hpp"
#include "detail/kinds.hpp"
#include "detail/type_name.hpp"

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <tuple>
#include <variant>
#include <vector>

namespace spbcast {
namespace detail {

// The schema text under construction. Not std::string: clang 14 rejects libstdc++'s constexpr
// std::string (assignment to its small-string union), while constexpr std::vector works with
// both compilers.
struct schema_builder {
    std::vector<char> chars;
    constexpr schema_builder& operator+=(char c) {
        chars.push_back(c);
        return *this;
    }
    constexpr schema_builder& operator+=(std::string_view text) {
        chars.insert(chars.end(), text.begin(), text.end());
        return *this;
    }
    constexpr std::size_t size() const { return chars.size(); }
    constexpr char operator[](std::size_t i) const { return chars[i]; }
};

constexpr void append_number(schema_builder& out, std::size_t n) {
    char digits[24]{};
    int count = 0;
    do {
        digits[count++] = static_cast<char>('0' + n % 10);
        n /= 10;
    } while (n != 0);
    while (count > 0) out += digits[--count];
}

template <class T>
constexpr void append_schema(schema_builder& out);

template <class... Ts>
constexpr void append_schema_list(schema_builder& out, char separator) {
    bool first = true;
    auto append_one = [&]<class U>() {
        if (!first) out += separator;
        first = false;
        append_schema<U>(out);
    };
    (append_one.template operator()<Ts>(), ...);
}

template <class T>
struct tuple_schema;
template <class... Ts>
struct tuple_schema<std::tuple<Ts...>> {
    static constexpr void append(schema_builder& out) { append_schema_list<Ts...>(out, ','); }
};
template <class A, class B>
struct tuple_schema<std::pair<A, B>> {
    static constexpr void append(schema_builder& out) { append_schema_list<A, B>(out, ','); }
};
template <class... Ts>
struct tuple_schema<std::variant<Ts...>> {
    static constexpr void append(schema_builder& out) { append_schema_list<Ts...>(out, '|'); }
};

template <class T>
constexpr void append_schema(schema_builder& out) {
    require_supported<T>();
    constexpr kind k = kind_v<T>;
    if constexpr (k == kind::custom) {
        static_assert(has_from_wire<T>,
                      "spbcast: this codec<T> has to_wire but no matching from_wire; add "
                      "'static T from_wire(Wire&& wire)' taking to_wire's result type, so followers "
                      "can rebuild T (README: 'Teaching spbcast a type').");
        out += type_name<T>();
        out += '=';
        append_schema<wire_type_t<T>>(out);
    } else if constexpr (k == kind::tensor) {
        out += "tensor";
    } else if constexpr (k == kind::ivalue) {
        out += "ivalue";
    } else if constexpr (k == kind::boolean) {
        out += "bool";
    } else if constexpr (k == kind::integer) {
        // By width and sign, so int64_t, long and long long agree; char keeps its own name
        // because its signedness differs between platforms.
        if constexpr (std::is_same_v<T, char>) {
            out += "char";
        } else {
            out += std::is_signed_v<T> ? 'i' : 'u';
            append_number(out, sizeof(T) * 8);
        }
    } else if constexpr (k == kind::floating) {
        out += 'f';
        append_number(out, sizeof(T) * 8);
    } else if constexpr (k == kind::enumeration) {
        out += "enum ";
        out += type_name<T>();
        out += ':';
        append_schema<std::underlying_type_t<T>>(out);
    } else if constexpr (k == kind::string) {
        out += "str";
    } else if constexpr (k == kind::optional) {
        out += "optional<";
        append_schema<typename T::value_type>(out);
        out += '>';
    } else if constexpr (k == kind::variant || k == kind::tuple) {
        out += k == kind::variant ? "variant<" : "tuple<";
        tuple_schema<T>::append(out);
        out += '>';
    } else if constexpr (k == kind::array) {
        out += "array<";
        append_schema<typename T::value_type>(out);
        out += ',';
        append_number(out, std::tuple_size_v<T>);
        out += '>';
    } else if constexpr (k == kind::sequence || k == kind::set) {
        out += k == kind::sequence ? "list<" : "set<";
        append_schema<typename T::value_type>(out);
        out += '>';
    } else if constexpr (k == kind::map) {
        static_assert(is_key_type<typename T::key_type>,
                      "spbcast: map keys must be strings, integers, bools or enums");
        out += "map<";
        append_schema<typename T::key_type>(out);
        out += ',';
        append_schema<typename T::mapped_type>(out);
        out += '>';
    } else if constexpr (k == kind::hana_struct || k == kind::aggregate) {
        out += type_name<T>();
        out += '{';
        for_each_field_index<T>([&](auto index) {
            constexpr std::size_t i = decltype(index)::value;
            if (i != 0) out += ',';
            if constexpr (k == kind::hana_struct) {
                out += field_name<T, i>();
                out += ':';
            }
            append_schema<field_type_t<T, i>>(out);
        });
        out += '}';
    }
}

template <class T>
constexpr schema_builder schema_string() {
    schema_builder out;
    append_schema<T>(out);
    return out;
}

// constexpr allocations cannot outlive constant evaluation, so the text is copied into a
// fixed array once per type.
template <class T>
struct schema_text {
    static constexpr std::size_t size = schema_string<T>().size();
    static constexpr std::array<char, size + 1> chars = [] {
        std::array<char, size + 1> a{};
        const schema_builder s = schema_string<T>();
        for (std::size_t i = 0; i < size; ++i) a[i] = s[i];
        return a;
    }();
};

constexpr std::uint64_t fnv1a64(std::string_view text) {
    std::uint64_t hash = 0xcbf29ce484222325ull;
    for (char c : text) {
        hash ^= static_cast<unsigned char>(c);
        hash *= 0x100000001b3ull;
    }
    return hash;
}

}  // namespace detail

template <class T>
inline constexpr std::string_view schema_of{detail::schema_text<T>::chars.data(),
                                            detail::schema_text<T>::size};

template <class T>
inline constexpr std::uint64_t fingerprint_of = detail::fnv1a64(schema_of<T>);

}  // namespace spbcast
