// The kinds of value spbcast handles, and the contract each kind's traits fulfil. Every C++
// type is of exactly one kind; everything spbcast does with a value - its schema text, its
// smallest stream size, its encoding, its decoding, the tests' exact comparison - is the
// traits of that kind, in one place per kind (kinds.hpp lists the files).
//
//   template <> struct kind_traits<kind::K> {
//       template <class T> static constexpr bool matches;        // T is of this kind
//       template <class T> static constexpr void schema(schema_builder& out);
//       template <class T> static constexpr std::size_t min_bytes();  // one value's fewest bytes
//       template <class T> static void encode(auto& out, const T& v);  // out: encoder
//       template <class T> static void decode(auto& in, T& v);         // in: decoder
//       template <class T> static T make(auto& in);  // only kinds whose types may lack a
//                                                    // default constructor: build one
//       template <class T> static void compare(auto& same, const T& a, const T& b,
//                                              const std::string& path);
//   };
//
// encode and decode speak the stream vocabulary of value_codec.hpp (flag, index, scalar,
// count, string, tensor, and value/element/field to recurse). compare is the tests' bit-exact
// comparison (tests/support/identical.hpp): same.expect(ok, path) checks, same.require(ok,
// path) stops at a mismatch that makes the rest meaningless, same.check(x, y, path) recurses.
#pragma once

#include "../../codec.hpp"

#include <cstddef>
#include <string_view>
#include <type_traits>
#include <vector>

namespace spbcast::detail {

// In priority order: a type's kind is the first whose traits match it. So a codec beats
// reflection, a std::array is an array before it is tuple-like, an aggregate is the last resort,
// and whatever matches nothing else is unsupported.
enum class kind {
    custom,       // spbcast::codec<T>                   kind_wrappers.hpp
    tensor,       // at::Tensor                          kind_scalars.hpp
    ivalue,       // c10::IValue                         ivalue_codec.hpp
    boolean,      //                                     kind_scalars.hpp
    integer,      //                                     kind_scalars.hpp
    floating,     //                                     kind_scalars.hpp
    enumeration,  //                                     kind_scalars.hpp
    string,       // std::string                         kind_scalars.hpp
    optional,     // std::optional, c10::optional        kind_wrappers.hpp
    variant,      // std::variant                        kind_wrappers.hpp
    array,        // std::array                          kind_containers.hpp
    map,          // std::map, std::unordered_map        kind_containers.hpp
    set,          // std::set, std::unordered_set        kind_containers.hpp
    sequence,     // std::vector, std::deque, std::list  kind_containers.hpp
    tuple,        // std::pair, std::tuple               kind_tuples.hpp
    hana_struct,  // a Boost.Hana Struct: named fields   kind_records.hpp
    aggregate,    // a Boost.PFR aggregate: positional   kind_records.hpp
    unsupported,  // matches every type                  kinds.hpp
};
inline constexpr std::size_t kind_count = static_cast<std::size_t>(kind::unsupported) + 1;

// Every kind specializes this. The primary template is reached only by a struct kind in a
// translation unit built on the reflection-free core alone (kind_records.hpp is not included):
// one clear error there instead of an incomplete type.
template <kind K>
struct kind_traits {
    static_assert(K != K,
                  "spbcast: this type is a struct, which spbcast reflects with Boost.PFR or Boost.Hana; "
                  "include <spbcast/broadcast.hpp> (or <spbcast/schema.hpp>) rather than a detail header alone.");
    template <class T>
    static constexpr bool matches = false;
};

template <class T, kind K = kind{}>
constexpr kind kind_of() {
    if constexpr (kind_traits<K>::template matches<T>) return K;
    else return kind_of<T, static_cast<kind>(static_cast<std::size_t>(K) + 1)>();
}

template <class T>
inline constexpr kind kind_v = kind_of<std::remove_cv_t<T>>();

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

// Dispatch to T's kind (kinds.hpp); the traits recurse through these.
template <class T>
constexpr void append_schema(schema_builder& out);
template <class T>
constexpr std::size_t min_wire_bytes();

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

template <class T, template <class...> class Template>
inline constexpr bool is_specialization_of = false;
template <template <class...> class Template, class... Args>
inline constexpr bool is_specialization_of<Template<Args...>, Template> = true;

// A map key must be a string or a scalar, so that it has one canonical encoding.
template <class K>
inline constexpr bool is_key_type = kind_v<K> == kind::string || kind_v<K> == kind::integer ||
                                    kind_v<K> == kind::boolean || kind_v<K> == kind::enumeration;

// Fails once, at the outermost unsupported type; the compiler's instantiation note names it.
template <class T>
constexpr void require_supported() {
    static_assert(!std::is_pointer_v<T>,
                  "spbcast: raw pointers cannot be broadcast; hold the value itself, or "
                  "specialize spbcast::codec<T> for the owning type.");
    static_assert(std::is_pointer_v<T> || kind_v<T> != kind::unsupported,
                  "spbcast: this type cannot be broadcast (its name is in the 'T = ...' of the "
                  "instantiation note). Make it an aggregate, adapt it with "
                  "BOOST_HANA_DEFINE_STRUCT / BOOST_HANA_ADAPT_STRUCT, or specialize "
                  "spbcast::codec<T> with to_wire/from_wire (docs/broadcast.md: 'Teaching spbcast a type').");
}

}  // namespace spbcast::detail
