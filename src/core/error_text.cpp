#include "core/error_text.h"

#include <cstdarg>
#include <cstdio>

#include "deltastate/error.h"

namespace deltastate::detail {

std::string format(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  va_list ap2;
  va_copy(ap2, ap);
  const int n = std::vsnprintf(nullptr, 0, fmt, ap);
  va_end(ap);
  std::string s(static_cast<size_t>(n > 0 ? n : 0), '\0');
  if (n > 0) std::vsnprintf(s.data(), s.size() + 1, fmt, ap2);
  va_end(ap2);
  return s;
}

void fail(const std::string& message) { throw Error(ErrorKind::value, message); }

}  // namespace deltastate::detail
