// A readable, stable name of a type at compile time, for schemas and error messages. It comes
// from the compiler's function signature, never from typeid or addresses, so it is the same in
// every process built from the same sources.
#pragma once

#include <string_view>

namespace spbcast::detail {

template <class T>
constexpr std::string_view type_name() {
#if defined(__clang__) || defined(__GNUC__)
    std::string_view signature = __PRETTY_FUNCTION__;
    // GCC: "... type_name() [with T = ns::Foo; std::string_view = ...]"; Clang: "... [T = ns::Foo]"
    const auto start = signature.find("T = ") + 4;
    auto end = signature.find(';', start);
    if (end == std::string_view::npos) end = signature.rfind(']');
    return signature.substr(start, end - start);
#else
    static_assert(sizeof(T) == 0, "spbcast: type names need GCC or Clang (__PRETTY_FUNCTION__)");
#endif
}

}  // namespace spbcast::detail
