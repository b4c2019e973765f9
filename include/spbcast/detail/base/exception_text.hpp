// The text of an exception, as spbcast's own messages quote it.
#pragma once

#include <c10/util/Exception.h>

#include <exception>
#include <string>

namespace spbcast::detail {

// An exception's message for ours: c10's what() carries a stack trace, which would bury the
// message every rank needs to read.
inline std::string exception_text(const std::exception& e) {
    if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
    return e.what();
}

}  // namespace spbcast::detail
