// Error text shared by the validators (src/contracts) and the state pool (src/pool): printf-style
// formatting into a std::string, and the throw of a contract violation.
#pragma once

#include <string>

namespace deltastate::detail {

// printf-style formatting into a std::string (messages only; never on a hot path).
std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// Throws deltastate::Error of ErrorKind::value with `message`.
[[noreturn]] void fail(const std::string& message);

}  // namespace deltastate::detail
