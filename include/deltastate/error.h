// deltastate: the one exception type every public call throws.
#pragma once

#include <algorithm>
#include <stdexcept>
#include <string>

namespace deltastate {

// What kind of misuse (or failure) an Error reports. Bindings map these to their language's
// exception classes (Python: value -> ValueError, type -> TypeError, ...).
enum class ErrorKind {
  value,            // a contract violation: shape, stride, dtype, device, index, argument value
  type,             // wrong kind of argument (bindings only)
  not_implemented,  // a backend lacks a feature (e.g. built without CUDA)
  runtime,          // a failure while running (CUDA error, allocation failure)
};

// Messages may mark the dtype names they print (dtype_mark): what() gives the plain text
// ("float16"), marked() the text with each marked name between two kDTypeMark characters, so that
// a binding can print dtypes the way its caller's framework does (Python: "torch.float16" for
// torch tensors, "float16" for numpy arrays).
inline constexpr char kDTypeMark = '\x1f';

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message)
      : std::runtime_error(unmarked(message)), kind_(kind), marked_(message) {}
  ErrorKind kind() const noexcept { return kind_; }
  const std::string& marked() const noexcept { return marked_; }

  static std::string unmarked(std::string s) {
    s.erase(std::remove(s.begin(), s.end(), kDTypeMark), s.end());
    return s;
  }

 private:
  ErrorKind kind_;
  std::string marked_;
};

// A dtype name as an Error message prints it (see kDTypeMark).
inline std::string dtype_mark(const char* name) {
  return std::string(1, kDTypeMark) + name + std::string(1, kDTypeMark);
}

// Shorthand for the common case: a contract violation.
[[noreturn]] inline void throw_value_error(const std::string& message) {
  throw Error(ErrorKind::value, message);
}

}  // namespace deltastate
